"""Shared fixtures: tiny random checkpoints and the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny import SPEC_PROMPTS, hf_greedy, save_tiny, save_tiny_dflash

from dflash2.runtime.loader import cache_dir

_CACHE = Path(tempfile.mkdtemp(prefix="dflash2-test-cache-"))
USER_CACHE = str(cache_dir())  # before the run's own replaces it: the opt-in real-size tests reuse it


def pytest_configure(config: pytest.Config) -> None:
    # Never touch the user's caches; every conversion in the test run starts from scratch.
    os.environ["DFLASH2_CACHE"] = str(_CACHE)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: save_tiny(root / arch, arch) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def tiny_model(tiny_dirs: dict[str, Path]) -> Any:
    import dflash2

    return dflash2.load(tiny_dirs["llama"], device="cpu")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from dflash2.demo_model import smollm2_gguf

    return smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf: Path) -> Any:
    """dflash2's SmolLM2, loaded through the GGUF path (converted into the test cache)."""
    import dflash2

    return dflash2.load(smollm2_gguf, device="cpu")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf: Path) -> Iterator[Any]:
    """The reference: transformers' own model, dequantized by transformers from the same GGUF."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32)
    yield model.eval()


@pytest.fixture(scope="session")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny checkpoints for the speculative tests: a target, drafters, another family."""
    root = tmp_path_factory.mktemp("spec")
    return {
        "target": save_tiny(root / "target", "llama", seed=0),
        "random": save_tiny(root / "random", "llama", seed=11),
        "qwen3": save_tiny(root / "qwen3", "qwen3", seed=1),
        "dflash1": save_tiny_dflash(root / "dflash1", version=1),
        "dflash2": save_tiny_dflash(root / "dflash2", version=2),
    }


@pytest.fixture(scope="session")
def references(paths: dict[str, Path]) -> dict[str, list[int]]:
    """transformers' own greedy output (48 tokens) of the target for each of ``SPEC_PROMPTS``."""
    from transformers import AutoModelForCausalLM

    import dflash2

    hf = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32).eval()
    tokenizer = dflash2.load(paths["target"]).tokenizer
    return {p: hf_greedy(hf, tokenizer(p).input_ids, 48) for p in SPEC_PROMPTS}


@pytest.fixture
def gpu_scripts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The development scripts of scripts/gpu (not installed) importable, as they import each other."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts" / "gpu"))
