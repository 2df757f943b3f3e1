"""Loading from a hub id (offline cache), a local dir (single and sharded) and a GGUF file."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
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
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]  # other tools (llama.cpp's converter) need it
    assert smollm2.target.spec.num_layers == 30
    mask = os.umask(0o022)
    os.umask(mask)  # the folder and its files as any other the user makes, not private temporaries
    assert stat.S_IMODE(converted.stat().st_mode) == 0o777 & ~mask
    assert {stat.S_IMODE(f.stat().st_mode) for f in converted.iterdir()} == {0o666 & ~mask}


@pytest.mark.smollm2
def test_a_folder_converted_without_its_architecture_gets_it(smollm2_gguf: Path, smollm2: dflash2.Model) -> None:
    """Folders converted before the architecture was written are mended in place, not converted again."""
    converted = resolve_checkpoint(smollm2_gguf)
    config = converted / "config.json"
    data = json.loads(config.read_text())
    config.write_text(json.dumps({**data, "architectures": None}))
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert resolve_checkpoint(smollm2_gguf) == converted
    assert json.loads(config.read_text()) == data
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in converted.iterdir() if p.name.startswith(".")) == []


CONVERT = """
import sys
from dflash2.runtime.loader import gguf_to_safetensors
from pathlib import Path
print("converted", gguf_to_safetensors(Path(sys.argv[1])))
"""


@pytest.mark.smollm2
@pytest.mark.timeout(300)
def test_two_processes_converting_one_gguf_at_once(smollm2_gguf: Path, tmp_path: Path) -> None:
    env = {**os.environ, "DFLASH2_CACHE": str(tmp_path / "cache")}
    runs = [
        subprocess.Popen([sys.executable, "-c", CONVERT, str(smollm2_gguf)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [run.communicate(timeout=240)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outs
    converted = {line.split(" ", 1)[1] for out in outs for line in out.splitlines() if line.startswith("converted")}
    assert len(converted) == 1  # both got the one cache entry
    entries = sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.endswith(".lock"))
    assert entries == [Path(converted.pop()).name]  # and no temporary directory is left


def test_a_conversion_that_crashes_leaves_no_cache_entry(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dflash2.runtime import loader

    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    target = tmp_path / "gguf" / f"{smollm2_gguf.stem}-{loader.file_fingerprint(smollm2_gguf)}"
    target.parent.mkdir(parents=True)
    killed = target.parent / f".tmp-{target.name}-killed"  # what a process killed midway leaves
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"half")

    def crash(gguf: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(loader, "_convert_gguf", crash)
    with pytest.raises(OSError, match="disk full"):
        resolve_checkpoint(smollm2_gguf)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == [f"{target.name}.lock"]  # the crash's leftovers are gone
