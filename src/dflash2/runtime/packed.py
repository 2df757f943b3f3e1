"""Quantized weights kept in the cache, so that a model quantizes once per checkpoint and format.

Quantizing a model at load takes time (Qwen2.5-Coder-1.5B to int4: about half a minute on a 2-core
CPU, most of it finding each group's grid), and gives the same tensors every time for the same
weights. So the layers :func:`~dflash2.runtime.quant.quantize_linears` makes are stored once, as
one safetensors file under the dflash2 cache dir (``DFLASH2_CACHE``), and later loads read them
back instead, without reading the full-precision projections at all (only their shapes are
checked): Qwen2.5-Coder-1.5B in int4 then loads in about 6 s with a peak of 2.8 GB resident, where
reading and quantizing the fp32 weights takes 50 s and 13.5 GB. The entry's name holds a
fingerprint of the checkpoint (its ``config.json``; the size, modification time, first and last MiB
of each weight file), the format, the torch version and the CPU's vector capability (the int4
kernel's packed layout is torch's own); any change makes a new entry. An entry appears atomically;
one that cannot be read or does not fit the model is quantized again and replaced. Where the cache
cannot be written, the model is quantized each time.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from dflash2.errors import CacheDirectoryError
from dflash2.runtime.linear import Linear
from dflash2.runtime.loader import cache_folder, file_fingerprint, load_decoder, safetensors_files, share_as_umask
from dflash2.runtime.model import Decoder
from dflash2.runtime.quant import GROUP, HalfLinear, QuantLinear, WeightFormat, quantize_linears

ModuleT = TypeVar("ModuleT", bound=nn.Module)
LAYOUT = 1  # bumped when what an entry holds changes


def entry_name(checkpoint: Path, fmt: WeightFormat) -> str:
    """The cache entry of ``checkpoint``'s linear layers in ``fmt`` on this torch and CPU."""
    digest = hashlib.sha256()
    digest.update((checkpoint / "config.json").read_bytes())
    for name in safetensors_files(checkpoint):
        path = checkpoint / name  # its time too: an edit in place that keeps the size and both ends
        digest.update(f"{name}:{file_fingerprint(path)}:{path.stat().st_mtime_ns}".encode())
    digest.update(f"{fmt}|{GROUP}|{LAYOUT}|{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}".encode())
    return f"{checkpoint.name}-{fmt}-{digest.hexdigest()[:16]}.safetensors"


def load_quantized(checkpoint: Path, fmt: WeightFormat, dtype: torch.dtype, device: torch.device) -> Decoder:
    """The decoder of ``checkpoint`` with its linear layers in ``fmt`` (``"same"``: as stored).
    From a cache entry the full-precision projections are never read, only their shapes checked:
    the load takes the time and memory of the quantized model (plus what stays in full precision:
    embeddings, norms). Without one the model is loaded whole, quantized, and stored."""
    if fmt == "same":
        return load_decoder(checkpoint, dtype, device)
    path = _entry(checkpoint, fmt)
    if path is not None and path.is_file():
        shell = load_decoder(checkpoint, dtype, device, projections=False)
        if _restore(shell, path):
            return shell
    return _quantize_and_store(load_decoder(checkpoint, dtype, device), fmt, path)


def quantize_cached(module: nn.Module, fmt: WeightFormat, checkpoint: Path) -> nn.Module:
    """:func:`~dflash2.runtime.quant.quantize_linears` for a model already loaded whole from
    ``checkpoint``, read from its cache entry when there is one (else quantized and stored);
    returns ``module``."""
    if fmt == "same":
        return module
    path = _entry(checkpoint, fmt)
    if path is not None and path.is_file() and _restore(module, path):
        return module
    return _quantize_and_store(module, fmt, path)


def _quantize_and_store(module: ModuleT, fmt: WeightFormat, path: Path | None) -> ModuleT:
    """``module`` quantized to ``fmt`` in place, its layers stored at ``path`` (None: not kept)."""
    quantize_linears(module, fmt)
    if path is not None:
        _store(module, path)
    return module


def _entry(checkpoint: Path, fmt: WeightFormat) -> Path | None:
    """Where ``checkpoint``'s layers in ``fmt`` are kept; None where the cache cannot be used or
    a weight file cannot be read (loading the checkpoint then says what is wrong with it)."""
    try:
        return cache_folder("quantized") / entry_name(checkpoint, fmt)
    except (CacheDirectoryError, OSError):
        return None


def _store(module: nn.Module, path: Path) -> None:
    formats: dict[str, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, layer in module.named_modules():
        if isinstance(layer, QuantLinear):
            formats[name] = layer.format
            tensors[f"{name}.qweight"], tensors[f"{name}.scales"] = layer.qweight, layer.scales
        elif isinstance(layer, HalfLinear):
            formats[name] = "bf16"
            tensors[f"{name}.weight"] = layer.weight.detach()
        else:
            continue
        if layer.bias is not None:
            tensors[f"{name}.bias"] = layer.bias.detach()
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.stem}-", suffix=".safetensors")
        os.close(fd)
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"formats": json.dumps(formats)})
        share_as_umask(Path(tmp))
        os.replace(tmp, path)
    except (OSError, SafetensorError):  # safetensors reports its failed writes as SafetensorError
        pass  # a full disk or a read-only cache: the next load quantizes again
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)


def _restore(module: nn.Module, path: Path) -> bool:
    """Put the stored layers in place of ``module``'s linear layers; False (``module`` untouched)
    where the entry cannot be read or does not hold exactly those layers in their shapes."""
    try:
        with safe_open(str(path), framework="pt") as f:
            formats = json.loads((f.metadata() or {}).get("formats", "{}"))
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
    except (SafetensorError, OSError, ValueError):
        return False
    targets = {name: layer for name, layer in module.named_modules() if isinstance(layer, Linear)}
    if set(formats) != set(targets):
        return False
    built: dict[str, nn.Module] = {}
    for name, layer in targets.items():
        restored = _layer(formats[name], name, tensors, layer)
        if restored is None:
            return False
        built[name] = restored
    for name, restored in built.items():
        parent, _, attribute = name.rpartition(".")
        setattr(module.get_submodule(parent), attribute, restored)
    return True


def _layer(fmt: str, name: str, tensors: dict[str, torch.Tensor], like: Linear) -> nn.Module | None:
    """The stored layer ``name`` in ``fmt``, or None where its tensors do not fit ``like``."""
    bias, expected = tensors.get(f"{name}.bias"), like.bias
    if (None if bias is None else bias.shape) != (None if expected is None else expected.shape):
        return None
    out_features, in_features = like.weight.shape
    if fmt == "bf16":
        weight = tensors.get(f"{name}.weight")
        if weight is None or weight.shape != like.weight.shape or weight.dtype != torch.bfloat16:
            return None
        return HalfLinear(weight, bias)
    qweight, scales = tensors.get(f"{name}.qweight"), tensors.get(f"{name}.scales")
    if fmt not in ("int8", "int4") or qweight is None or scales is None:
        return None
    try:
        return QuantLinear.restored(fmt, qweight, scales, bias, in_features, out_features)  # type: ignore[arg-type]
    except ValueError:
        return None
