"""Loading from a hub id (offline cache), a local dir (single and sharded) and a GGUF file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny import EOS, save_tiny

import dflash2
from dflash2.runtime.loader import load_safetensors, resolve_checkpoint


def _hub_cache_entry(hf_home: Path, repo_id: str, source: Path) -> Path:
    """Lay out a model exactly as huggingface_hub caches it: refs/main -> snapshots/<sha>/files."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / sha
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    return snapshot


def test_local_dir(tiny_dirs: dict[str, Path]) -> None:
    model = dflash2.load(tiny_dirs["qwen2"], device="cpu")
    assert model.target.spec.model_type == "qwen2"
    assert model.dtype == torch.float32
    assert EOS in model.eos_token_ids


def test_sharded_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    source = save_tiny(tmp_path / "single", "llama", seed=3)
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(source).save_pretrained(sharded, max_shard_size="100KB")
    shutil.copy(source / "tokenizer.json", sharded)
    shutil.copy(source / "tokenizer_config.json", sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert load_safetensors(sharded).keys() == load_safetensors(source).keys()
    a = dflash2.load(source, device="cpu").generate("abc", max_new_tokens=8)
    b = dflash2.load(sharded, device="cpu").generate("abc", max_new_tokens=8)
    assert a.token_ids == b.token_ids


def test_hub_id_from_offline_cache(tiny_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = _hub_cache_entry(tmp_path, "tiny-org/tiny-llama", tiny_dirs["llama"])
    assert resolve_checkpoint("tiny-org/tiny-llama") == snapshot
    local = dflash2.load(tiny_dirs["llama"], device="cpu").generate("hub", max_new_tokens=6)
    hub = dflash2.load("tiny-org/tiny-llama", device="cpu").generate("hub", max_new_tokens=6)
    assert hub.token_ids == local.token_ids


def test_offline_without_cache_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(dflash2.OfflineModelError, match="HF_HUB_OFFLINE"):
        dflash2.load("tiny-org/not-downloaded")


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(dflash2.ModelNotFoundError, match="does not exist"):
        dflash2.load(tmp_path / "nowhere")
    with pytest.raises(dflash2.ModelNotFoundError, match="does not exist"):
        dflash2.load("./nowhere/model.gguf")
    with pytest.raises(dflash2.ModelNotFoundError, match=r"config\.json"):
        dflash2.load(tmp_path)


def test_unsupported_architecture(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    target = shutil.copytree(tiny_dirs["llama"], tmp_path / "gpt2ish")
    config = json.loads((target / "config.json").read_text())
    config["model_type"] = "gpt2"
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(dflash2.UnsupportedModelError, match="gpt2"):
        dflash2.load(target)


def test_unsupported_rope_type(tmp_path: Path) -> None:
    target = save_tiny(
        tmp_path / "dyn", "llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    )
    with pytest.raises(dflash2.UnsupportedModelError, match="dynamic"):
        dflash2.load(target)


def test_no_pickle_weights(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    target = shutil.copytree(tiny_dirs["llama"], tmp_path / "pickled")
    (target / "model.safetensors").rename(target / "pytorch_model.bin")
    with pytest.raises(dflash2.ModelNotFoundError, match="safetensors"):
        dflash2.load(target)


def test_bad_device_and_dtype(tiny_dirs: dict[str, Path]) -> None:
    with pytest.raises(dflash2.InvalidOptionError, match="dtype"):
        dflash2.load(tiny_dirs["llama"], dtype="float8")
    with pytest.raises(dflash2.InvalidOptionError, match="device"):
        dflash2.load(tiny_dirs["llama"], device="tpu")
    with pytest.raises(dflash2.InvalidOptionError, match="target"):
        dflash2.load(42)  # type: ignore[arg-type]


@pytest.mark.smollm2
def test_gguf_is_converted_once_then_cached(smollm2_gguf: Path, smollm2: dflash2.Model) -> None:
    converted = resolve_checkpoint(smollm2_gguf)  # the `smollm2` fixture already converted it
    weights = converted / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert resolve_checkpoint(smollm2_gguf) == converted
    assert weights.stat().st_mtime_ns == stamp
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    assert smollm2.target.spec.num_layers == 30
