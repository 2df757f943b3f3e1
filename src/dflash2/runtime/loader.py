"""Find a checkpoint (hub id, local dir or ``.gguf`` file) and load it with safetensors.

A hub id goes through ``huggingface_hub.snapshot_download`` (its cache, ``HF_HUB_OFFLINE``);
a ``.gguf`` file is dequantized once through transformers' GGUF support and cached as
safetensors under the dflash2 cache dir, so the next load reads plain safetensors.
Weights are never unpickled and ``trust_remote_code`` is never enabled.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from dflash2.errors import (
    CacheDirectoryError,
    CorruptCheckpointError,
    DFlash2Error,
    MissingDependencyError,
    ModelNotFoundError,
    OfflineModelError,
    UnsupportedModelError,
)
from dflash2.runtime.checkpoint import check_weights, projection_names
from dflash2.runtime.model import Decoder
from dflash2.runtime.spec import SUPPORTED_MODEL_TYPES, ModelSpec

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_TRUTHY = {"1", "true", "yes", "on"}
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def cache_dir() -> Path:
    """Where dflash2 keeps converted checkpoints: ``$DFLASH2_CACHE`` or ``~/.cache/dflash2``."""
    if env := os.environ.get("DFLASH2_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash2"


def cache_folder(name: str) -> Path:
    """The folder ``name`` of the cache dir, created if needed and checked to be writable: every
    cache entry goes through here, so an unusable ``DFLASH2_CACHE`` has one clear error."""
    folder = cache_dir() / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        writable = os.access(folder, os.W_OK | os.X_OK)
    except OSError as err:
        reason = err.strerror or type(err).__name__
    else:
        if writable:
            return folder
        reason = "not writable"
    raise CacheDirectoryError(
        f"dflash2 cannot write its cache at {folder} ({reason}); set DFLASH2_CACHE to a writable directory."
    )


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUTHY


def resolve_checkpoint(source: str | os.PathLike[str]) -> Path:
    """Return a local directory holding ``config.json``, safetensors weights and tokenizer files."""
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json; point to a Hugging Face model directory.")
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return gguf_to_safetensors(path)
        raise ModelNotFoundError(f"{path} is a file; pass a model directory, a .gguf file or a hub id.")
    text = str(source)
    if text.lower().endswith(".gguf") or text.startswith((".", "/", "~")) or not _HUB_ID.match(text):
        raise ModelNotFoundError(f"no model at {text!r}: the path does not exist. Check the path or pass a hub id.")
    return _snapshot(text)


def _hub_cache() -> Path:
    if env := os.environ.get("HF_HUB_CACHE"):
        return Path(env)
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def _snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = hub_offline()
    try:
        local = snapshot_download(repo_id, cache_dir=_hub_cache(), allow_patterns=_HUB_FILES, local_files_only=offline)
    except GatedRepoError as err:
        raise ModelNotFoundError(
            f"{repo_id} is gated: accept its licence on the hub and log in (`hf auth login`)."
        ) from err
    except RepositoryNotFoundError as err:
        raise ModelNotFoundError(f"no model {repo_id!r} on the hub; check the id or pass a local path.") from err
    except LocalEntryNotFoundError as err:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached"
        raise OfflineModelError(
            f"{repo_id} is not in the local hub cache ({_hub_cache()}) and {why}. Download it once while "
            "online (unset HF_HUB_OFFLINE), or pass a local directory or .gguf file instead."
        ) from err
    return Path(str(local))


# ---------------------------------------------------------------- GGUF
def gguf_to_safetensors(gguf: Path) -> Path:
    """Dequantize a GGUF file once; return the cached safetensors directory.

    The cache entry appears atomically (written to a temporary directory, then renamed), under a
    file lock: processes converting the same file at once convert it once, and a crash midway
    leaves no entry (its temporary directory is removed by the next conversion).
    """
    target = cache_dir() / "gguf" / f"{gguf.stem}-{file_fingerprint(gguf)}"
    if (target / "config.json").is_file():
        _name_architecture(target)
        return target
    cache_folder("gguf")
    try:
        import gguf as _gguf  # noqa: F401
    except ImportError as err:
        raise MissingDependencyError(
            "loading .gguf files needs the 'gguf' package: pip install 'dflash2[gguf]'"
        ) from err
    with FileLock(str(target.parent / f"{target.name}.lock")):
        if (target / "config.json").is_file():  # another process converted it meanwhile
            return target
        for stale in target.parent.glob(f".tmp-{target.name}-*"):  # left by a crash
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".tmp-{target.name}-"))
        try:
            _convert_gguf(gguf, tmp)
            share_as_umask(tmp)
            os.replace(tmp, target)
        except DFlash2Error:
            raise
        except (OSError, SafetensorError) as err:  # a full disk: safetensors reports it as its own error
            raise CacheDirectoryError(
                f"dflash2 could not write the converted {gguf.name} under {target.parent} ({err}); free space "
                "there or set DFLASH2_CACHE to a directory with room for the dequantized weights."
            ) from err
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def share_as_umask(path: Path) -> None:
    """Give ``path`` (a file, or a folder and the files in it) the modes the process's umask gives
    new files: temporary files and folders (``tempfile``, safetensors' own atomic writes) are
    private, and a cache entry made from one must serve every user the umask lets read it."""
    mask = os.umask(0o022)
    os.umask(mask)
    for item in [path, *(path.iterdir() if path.is_dir() else ())]:
        os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except DFlash2Error:
        raise
    except Exception as err:  # the gguf reader raises many kinds on a damaged file
        raise CorruptCheckpointError(
            f"{gguf} could not be read as a GGUF model ({type(err).__name__}: {err}). It may be truncated or "
            "damaged: download it again."
        ) from err
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"{gguf.name} holds a {config.model_type!r} model, which is not supported.")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    data = config.to_dict()
    data.pop("quantization_config", None)
    data["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(data, indent=2))
    tokenizer.save_pretrained(out)


def _name_architecture(folder: Path) -> None:
    """Name the model class in a converted folder's config.json where an older conversion left it
    out (transformers leaves ``architectures`` empty after reading a GGUF): other tools, such as
    llama.cpp's converter, read the folder by it. Rewritten atomically; the weights stay."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = folder / "config.json"
    data = json.loads(config.read_text())
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(data.get("model_type", ""))
    if data.get("architectures") or name is None:
        return
    data["architectures"] = [name]
    tmp = folder / f".config-{os.getpid()}.json"
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, config)


def file_fingerprint(path: Path, chunk: int = 1 << 20) -> str:
    """Hash of the size and the first and last MiB: cheap, and changes when the file does."""
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        digest.update(f.read(chunk))
        f.seek(max(0, path.stat().st_size - chunk))
        digest.update(f.read(chunk))
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------- config, weights, tokenizer
def read_config(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({err}); download the model again or fix it.") from err
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"{path} holds a {type(data).__name__}, not a JSON object of model settings.")
    return data


def load_hf_config(checkpoint: Path) -> PretrainedConfig:
    model_type = read_config(checkpoint).get("model_type")
    if model_type is None:
        raise UnsupportedModelError(
            f"{checkpoint / 'config.json'} has no model_type, so its architecture is unknown; "
            f"dflash2 runs {', '.join(SUPPORTED_MODEL_TYPES)} decoders."
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{checkpoint} is a {model_type!r} model; dflash2 runs {', '.join(SUPPORTED_MODEL_TYPES)} decoders."
        )
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(checkpoint, trust_remote_code=False)
    except (ValueError, TypeError, KeyError) as err:
        raise CorruptCheckpointError(f"{checkpoint / 'config.json'} has invalid settings: {err}") from err
    return config


def safetensors_files(checkpoint: Path) -> list[str]:
    """The weight files of a single-file or sharded (``model.safetensors.index.json``) checkpoint."""
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CorruptCheckpointError(f"{index} is not a safetensors index ({err}); download it again.") from err
    else:
        files = sorted(p.name for p in checkpoint.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(
            f"{checkpoint} has no *.safetensors weights (dflash2 never loads pickled .bin files); "
            "convert the checkpoint with transformers' save_pretrained(safe_serialization=True)."
        )
    return files


def load_safetensors(checkpoint: Path, shapes_only: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """Every tensor of a single-file or sharded (``model.safetensors.index.json``) checkpoint; those
    named in ``shapes_only`` are not read: each is an empty tensor of its shape and dtype on the
    ``meta`` device."""
    tensors: dict[str, torch.Tensor] = {}
    for name in safetensors_files(checkpoint):
        path = checkpoint / name
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensors[key] = _shape_of(f.get_slice(key)) if key in shapes_only else f.get_tensor(key)
        except FileNotFoundError as err:
            raise ModelNotFoundError(f"{path} is missing (the index names it); download it again.") from err
        except (SafetensorError, OSError) as err:
            why = f"{path} cannot be read ({err}); it may be truncated: download it again."
            raise CorruptCheckpointError(why) from err
    return tensors


def _shape_of(stored: Any) -> torch.Tensor:
    dtype = _DTYPES.get(stored.get_dtype(), torch.uint8)  # any other is no model weight: check_weights says so
    return torch.empty(stored.get_shape(), dtype=dtype, device="meta")


def load_spec(checkpoint: Path) -> ModelSpec:
    """What the checkpoint's ``config.json`` says about the model's shape."""
    return ModelSpec.from_hf_config(load_hf_config(checkpoint))


def load_decoder(checkpoint: Path, dtype: torch.dtype, device: torch.device, projections: bool = True) -> Decoder:
    """The checkpoint's model, checked against its config. ``projections=False``: the weights of its
    linear layers are not read (:func:`~dflash2.runtime.checkpoint.projection_names`, checked by
    shape only) and stay on the ``meta`` device, for a caller that puts quantized layers in their place."""
    spec = load_spec(checkpoint)
    tensors = load_safetensors(checkpoint, () if projections else frozenset(projection_names(spec)))
    check_weights(spec, tensors, str(checkpoint))
    try:
        return Decoder.from_hf_state(spec, tensors, dtype, device)
    except KeyError as err:  # a mixture of experts' expert weights
        raise CorruptCheckpointError(
            f"{checkpoint}: weight {err} is missing; the checkpoint is incomplete: download it again."
        ) from err


def load_tokenizer(checkpoint: Path) -> PreTrainedTokenizerBase:
    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ModelNotFoundError(
            f"{checkpoint} has no usable tokenizer files ({err}); save the tokenizer beside the weights "
            "(tokenizer.save_pretrained) or download the model again."
        ) from err
    return tokenizer


def load_eos_ids(checkpoint: Path, spec: ModelSpec) -> frozenset[int]:
    """EOS ids as ``transformers.generate`` uses them: generation_config.json first, else config.json."""
    generation = checkpoint / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        if eos is not None:
            return frozenset(eos if isinstance(eos, list) else [eos])
    return frozenset(spec.eos_token_ids)
