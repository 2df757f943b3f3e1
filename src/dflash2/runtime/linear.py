"""``Linear``: a linear layer that can pre-pack its weight for fast small-batch inference on CPU.

Decoding and verification multiply a few rows (1-16 tokens) by every weight matrix, where
MKL's plain GEMM is poor. Measured on this project's 2-core x86 CPU (SmolLM2-135M, fp32, one
forward after a 200-token prompt): with ``F.linear`` one token took 56 ms and an 8-token
verification block 118 ms; with each weight pre-packed once for oneDNN (``mkldnn``) one token
took 34 ms and 8 tokens 38 ms, so verifying a block costs little more than decoding one
token. One packed copy serves every row count; a model loaded for inference releases the plain
weight it replaces, so packing costs no memory.

oneDNN builds (and caches, up to 1,024 per process in each of two caches) a kernel for each row
count it sees, so traffic with prompts of every length grew memory without end (a tiny model, 320
streams: 553 to 926 MiB). Row counts above 16 are therefore padded up to a few buckets
(:func:`row_bucket`); the padded rows are dropped, and a row's result does not depend on the rows
beside it (checked: 2 .. 1,100 rows, projections of 576 to 8,960 inputs), so the output is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def packing_available(weight: torch.Tensor) -> bool:
    """Packed oneDNN linear exists for fp32 weights on the CPU in mkldnn builds of torch, and for
    bf16 ones where oneDNN multiplies bf16 on this CPU."""
    return (
        weight.device.type == "cpu"
        and (
            weight.dtype == torch.float32
            or (weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
        )
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


# oneDNN picks the packed layout for a row count; one packed for 16 rows was as fast as one
# packed for each size at 1-200 rows in our measurements.
_PACK_ROWS = 16


# oneDNN multiplies 2 or 3 rows by a packed weight more slowly than 4, and a single row by another
# kernel (a matrix-vector product) that for a weight too large for the CPU's caches is slower than
# 4 rows at once and rounds otherwise. Measured on a 2-core AMD EPYC (fp32, one forward after a
# 200-token prompt, interleaved): Qwen2.5-1.5B 1 token 256 -> 221 ms, 2 tokens 274 -> 227 ms;
# SmolLM2-135M 2 tokens 40.0 -> 37.3 ms, 1 token unchanged. So 2 or 3 rows run at 4, and so does
# a single row for a weight of ``WIDE`` elements or more (smaller ones, cached, are faster at one
# row); for those weights a row comes out with the same bits whether it is decoded alone or
# verified in a block.
FEWEST_ROWS = 4
WIDE = 8 * 2**20  # weights of this many elements and more (32 MiB in fp32)


def row_bucket(rows: int, fewest: int = 1) -> int:
    """The row count a product of ``rows`` rows runs at: at least ``fewest``, itself up to 16
    (decoding, verification), then the next multiple of 16 up to 256, of 64 up to 1,024, of 256
    beyond (prefills): at most about 60 kernels per weight shape, and at most a quarter more rows
    than asked above 16."""
    if rows <= 16:
        return max(rows, fewest)
    step = 16 if rows <= 256 else 64 if rows <= 1024 else 256
    return -(-rows // step) * step


def padded_product(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor], fewest: int = 1) -> torch.Tensor:
    """``product(x)`` over the rows of ``x`` [..., K], run at :func:`row_bucket` rows."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if rows == 0:
        return product(x)
    bucket = row_bucket(rows, fewest)
    if bucket == rows:
        return product(x)
    flat = F.pad(x.reshape(rows, k), (0, 0, 0, bucket - rows))
    out = product(flat)[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] pre-packed for oneDNN's small-batch products (:func:`packed_product`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS)


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, wide: bool) -> torch.Tensor:
    """``x W^T + b`` by oneDNN on a weight from :func:`pack_weight`, at :func:`row_bucket` rows (at
    least ``FEWEST_ROWS`` where there are several rows or the weight is ``wide``)."""
    pointwise = torch.ops.mkldnn._linear_pointwise
    fewest = FEWEST_ROWS if wide or x.numel() > x.shape[-1] else 1
    return padded_product(x, lambda rows: pointwise(rows, packed, bias, "none", [], ""), fewest)


class Packable(nn.Module):
    """A linear layer that may compute on a oneDNN-packed copy of its weight (:func:`pack_weight`)."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    _packed: torch.Tensor | None = None

    def _pack(self, release: bool) -> None:
        """Pack the weight; ``release``: drop the plain one (its shape and dtype stay, on the meta device)."""
        self._packed = pack_weight(self.weight)
        if release:
            meta = torch.empty(self.weight.shape, dtype=self.weight.dtype, device="meta")
            self.weight = nn.Parameter(meta, requires_grad=False)

    def pack(self, release: bool = False) -> None:
        """Pre-pack the weight where oneDNN computes in its dtype here; ``release``: drop the plain one."""
        raise NotImplementedError

    @property
    def packed(self) -> bool:
        return self._packed is not None

    @property
    def packed_weight(self) -> torch.Tensor:
        """The pre-packed weight the layer computes with (after ``pack``)."""
        if self._packed is None:
            raise ValueError("this layer is not packed")
        return self._packed


class Linear(Packable):
    """``y = x W^T + b``; after :meth:`pack`, inference (no grad) runs on a oneDNN-packed copy."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._released = False  # the plain weight is gone: only the packed copy computes
        self._wide = False  # a single row runs at FEWEST_ROWS too

    def pack(self, release: bool = False) -> None:
        """Pre-pack the weight (a snapshot: call again after changing it); no-op where unsupported.

        ``release``: drop the plain weight (its shape stays, on the meta device), for layers that
        only ever run inference and whose weight nothing else reads."""
        if self.weight.dtype == torch.float32 and packing_available(self.weight):  # bf16 weights: quant.HalfLinear
            self._wide = self.weight.numel() >= WIDE
            self._pack(release)
            self._released = release

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None and x.dtype == torch.float32 and (self._released or not torch.is_grad_enabled()):
            return packed_product(x, self._packed, self.bias, self._wide)
        return F.linear(x, self.weight, self.bias)


def pack_linears(module: nn.Module, release: bool = False, keep: tuple[nn.Module, ...] = ()) -> None:
    """Pre-pack every :class:`Packable` layer inside ``module`` (fp32 :class:`Linear`, bf16
    ``HalfLinear``); ``release`` drops their plain weights, except those of the layers in ``keep``."""
    for child in module.modules():
        if isinstance(child, Packable):
            child.pack(release and not any(child is k for k in keep))
