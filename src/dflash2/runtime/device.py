"""Device and dtype selection (the compute threads are in ``runtime.workers``)."""

from __future__ import annotations

import torch

from dflash2.errors import InvalidOptionError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` is the first CUDA device when there is one, else the CPU."""
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise InvalidOptionError(f"device must be a string such as 'auto', 'cpu' or 'cuda:0', not {device!r}.")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as err:
        raise InvalidOptionError(f"unknown device {device!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'.") from err
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidOptionError(f"device {device!r} was asked for but CUDA is not available; use 'cpu' or 'auto'.")
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidOptionError(f"device {device!r} is not supported; use 'auto', 'cpu' or 'cuda[:N]'.")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"`` is bfloat16 on CUDA and float32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise InvalidOptionError(f"dtype {dtype} is not supported; use one of {', '.join(_DTYPES)}.")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise InvalidOptionError(f"unknown dtype {dtype!r}; use 'auto' or one of {', '.join(_DTYPES)}.")
    return _DTYPES[dtype]
