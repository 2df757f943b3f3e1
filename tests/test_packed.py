"""Quantized layers are kept in the cache: a later load of the same checkpoint and format reads
them back (the same tensors, the same output) instead of quantizing again; a changed checkpoint
or a damaged entry is quantized anew; an unwritable cache only costs the time."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tiny import save_tiny

import dflash2
from dflash2.runtime import loader, packed
from dflash2.runtime.loader import load_decoder
from dflash2.runtime.quant import QuantLinear

PROMPT = "The cache keeps"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "quantized"


def _layers(model: dflash2.Model) -> dict[str, tuple[torch.Tensor, ...]]:
    return {
        name: (m.qweight, m.scales, *(() if m.bias is None else (m.bias,)))
        for name, m in model.target.named_modules()
        if isinstance(m, QuantLinear)
    }


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The checkpoint tensors read from now on (their values, not just their shapes), by name."""
    read: list[str] = []

    class Recording:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.file = safe_open(*args, **kwargs)

        def __enter__(self) -> Recording:
            self.opened = self.file.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.__exit__(*exc)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.opened, name)

        def get_tensor(self, key: str) -> torch.Tensor:
            read.append(key)
            return self.opened.get_tensor(key)

    monkeypatch.setattr(loader, "safe_open", Recording)
    return read


def _no_quantizing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("quantized again although the cache holds the layers")

    monkeypatch.setattr(packed, "quantize_linears", refuse)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: projections with a bias
def test_a_second_load_reads_the_quantized_layers_back(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, fmt: str
) -> None:
    path = save_tiny(tmp_path / arch, arch, seed=5)
    first = dflash2.load(path, weights=fmt)
    assert len(list(cache.glob("*.safetensors"))) == 1
    expected = first.generate(PROMPT, max_new_tokens=12).token_ids
    _no_quantizing(monkeypatch)
    read = _reads(monkeypatch)
    second = dflash2.load(path, weights=fmt)
    assert read and not [name for name in read if name.endswith("_proj.weight")]  # nor are they checked
    mine, theirs = _layers(first), _layers(second)
    assert mine.keys() == theirs.keys() and len(mine) == 4 * second.target.spec.num_layers + 1
    for name in mine:
        assert all(torch.equal(a, b) for a, b in zip(mine[name], theirs[name], strict=True)), name
    assert second.generate(PROMPT, max_new_tokens=12).token_ids == expected


def test_each_format_and_checkpoint_has_its_own_entry(cache: Path, tmp_path: Path) -> None:
    path = save_tiny(tmp_path / "tiny", "llama", seed=5)
    dflash2.load(path, weights="int4")
    dflash2.load(path, weights="int8")
    assert len(list(cache.glob("*.safetensors"))) == 2
    weights = path / "model.safetensors"
    tensors = {name: t * 1.5 if "up_proj" in name else t for name, t in load_file(str(weights)).items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})  # new weights under the same file name
    changed = dflash2.load(path, weights="int4")
    assert len(list(cache.glob("*.safetensors"))) == 3
    fresh = load_decoder(path, torch.float32, torch.device("cpu"))
    fresh.quantize("int4")  # without the cache
    theirs = _layers(changed)
    for name, layer in fresh.named_modules():
        if isinstance(layer, QuantLinear):
            assert torch.equal(layer.qweight, theirs[name][0]) and torch.equal(layer.scales, theirs[name][1]), name


@pytest.mark.parametrize("damage", ["truncated", "another-model"])
def test_a_damaged_entry_is_quantized_again_and_replaced(cache: Path, tmp_path: Path, damage: str) -> None:
    path = save_tiny(tmp_path / "tiny", "llama", seed=5)
    expected = dflash2.load(path, weights="int4").generate(PROMPT, max_new_tokens=12).token_ids
    (entry,) = cache.glob("*.safetensors")
    if damage == "truncated":
        entry.write_bytes(entry.read_bytes()[:1000])
    else:  # an entry whose layers are not this model's
        other = save_tiny(tmp_path / "other", "llama", seed=5, num_hidden_layers=1)
        dflash2.load(other, weights="int4")
        (foreign,) = set(cache.glob("*.safetensors")) - {entry}
        foreign.replace(entry)
    assert dflash2.load(path, weights="int4").generate(PROMPT, max_new_tokens=12).token_ids == expected
    assert len({key.rsplit(".", 1)[0] for key in load_file(str(entry))}) == 4 * 2 + 1  # replaced: this model's layers
    assert dflash2.load(path, weights="int4").generate(PROMPT, max_new_tokens=12).token_ids == expected


def test_an_unwritable_cache_only_costs_the_quantizing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = save_tiny(tmp_path / "tiny", "llama", seed=5)
    expected = dflash2.load(path, weights="int4").generate(PROMPT, max_new_tokens=12).token_ids
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("DFLASH2_CACHE", str(blocker))
    assert dflash2.load(path, weights="int4").generate(PROMPT, max_new_tokens=12).token_ids == expected


def test_a_model_drafter_keeps_its_quantized_layers_too(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = save_tiny(tmp_path / "target", "llama", seed=5)
    drafter = save_tiny(tmp_path / "drafter", "llama", seed=6, num_hidden_layers=1)
    expected = dflash2.load(target, drafter=drafter).generate(PROMPT, max_new_tokens=12).token_ids
    assert len(list(cache.glob("drafter-int4-*.safetensors"))) == 1
    _no_quantizing(monkeypatch)
    read = _reads(monkeypatch)
    assert dflash2.load(target, drafter=drafter).generate(PROMPT, max_new_tokens=12).token_ids == expected
    assert read.count("model.embed_tokens.weight") == 2  # the target's and the drafter's
    assert read.count("model.layers.0.mlp.down_proj.weight") == 1  # the fp32 target's only


# a full disk, where the temporary file is made and where safetensors writes it (it reports
# its failed writes, a full disk or a vanished folder, as its own error type)
FAILED_WRITES = {
    "mkstemp": (packed.tempfile, "mkstemp", OSError(28, "No space left on device")),
    "save_file": (
        packed,
        "save_file",
        SafetensorError("Error while serializing: I/O error: No space left (os error 28)"),
    ),
}


@pytest.mark.parametrize("where", FAILED_WRITES)
def test_a_cache_that_fails_to_write_only_costs_the_quantizing(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    path = save_tiny(tmp_path / "tiny", "llama", seed=5)
    expected = dflash2.load(path, weights="int4").generate(PROMPT, max_new_tokens=12).token_ids
    for entry in cache.glob("*.safetensors"):
        entry.unlink()
    owner, name, error = FAILED_WRITES[where]

    def full_disk(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(owner, name, full_disk)
    assert dflash2.load(path, weights="int4").generate(PROMPT, max_new_tokens=12).token_ids == expected
    assert not list(cache.iterdir())


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_an_entry_is_readable_as_the_umask_allows(cache: Path, tmp_path: Path) -> None:
    """Entries are written through private temporary files; the entry itself gets the usual mode
    (a cache warmed by one user, e.g. while building a container image, serves the others)."""
    path = save_tiny(tmp_path / "tiny", "llama", seed=5)
    dflash2.load(path, weights="int4")
    (entry,) = cache.glob("*.safetensors")
    assert stat.S_IMODE(entry.stat().st_mode) == 0o666 & ~_umask()
