"""Weight-only quantized linear layers in pure PyTorch: int8 per output channel, int4 per group.

A draft model's precision changes how often its tokens are right, never the output (the target
verifies every token), so drafters run in the cheapest weights that keep their agreement. Small
batches of rows (one draft token at a time) are bound by reading the weights: int4 reads an
eighth of fp32's bytes. The kernels are torch's own (``aten._weight_int8pack_mm``,
``aten._weight_int4pack_mm_for_cpu``, the ones gpt-fast and torchao use); on the CPU they are fast
with bfloat16 activations, so a quantized model computes in bfloat16 between its matmuls.

- ``int8``: ``w ≈ q * scale``, q in [-127, 127], one scale per output channel.
- ``int4``: ``w ≈ (q - 8) * scale + zero``, q in [0, 15], one (scale, zero) per ``GROUP`` inputs of
  an output channel: an affine group, the form of GGUF's Q4_0 / Q4_1 / Q4_K blocks, so such a
  weight (dequantized at load) is held on its own grid, exactly up to the bf16 scale and zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.errors import InvalidOptionError
from dflash2.runtime.linear import Linear, Packable, packed_product, packing_available, padded_product

WeightFormat = Literal["same", "bf16", "int8", "int4"]  # "same": as loaded, no conversion
WEIGHT_FORMATS: tuple[WeightFormat, ...] = ("same", "bf16", "int8", "int4")
GROUP = 32  # int4 inputs per (scale, zero): GGUF's Q4_K sub-block
INT4_ROWS = 16  # the CPU int4 layout packs output channels in sixteens
# the CPU int8 kernel reads a row's inputs 16 at a time (under AVX-512 from rows it takes to be 32-byte
# aligned): of other widths it reads past each row, computing garbage or crashing
INT8_INPUTS = 16
ALIGNMENT = 64  # bytes: where torch's allocator starts a tensor; the CPU kernels' aligned loads need 16 or 32
CHUNK_ROWS = 4096  # output channels quantized at once
SAMPLE_ROWS = 16  # whose groups tell whether a weight lies on int4 grids (a GGUF Q4 tensor dequantized)
LEVEL_TOLERANCE = 1e-3  # values this close to a grid point (in steps) lie on it: fp32 rounding is far below


def check_weight_format(fmt: object, option: str) -> WeightFormat:
    if fmt not in WEIGHT_FORMATS:
        raise InvalidOptionError(f"{option} must be one of {', '.join(map(repr, WEIGHT_FORMATS))}; got {fmt!r}.")
    return fmt


TARGET_WEIGHTS = WEIGHT_FORMATS
ROW_COUNTS = (1, 2, 3, 4, 5, 8, 16, 17, 64, 256)  # products a bf16 target is probed at: decoding to prefills


def check_target_weights(fmt: object) -> WeightFormat:
    """A target's weights: formats whose kernels give a row the same bits in a block of any size
    (torch's int8 and int4 kernels do; bf16 is probed on the CPU at hand: :func:`check_bf16_rows`)."""
    if fmt not in TARGET_WEIGHTS:
        raise InvalidOptionError(f"weights must be one of {', '.join(map(repr, TARGET_WEIGHTS))}; got {fmt!r}.")
    return check_weight_format(fmt, "weights")


def rows_alone(
    layer: Callable[[torch.Tensor], torch.Tensor], in_features: int, counts: tuple[int, ...] = ROW_COUNTS
) -> bool:
    """Whether ``layer`` gives a row the same bits in a product of each of ``counts`` rows as alone
    (random rows; the first and the last row of each product)."""
    x = torch.randn(max(counts), in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        alone = {i: layer(x[i : i + 1])[0] for n in counts for i in (0, n - 1)}
        for n in counts:
            out = layer(x[:n])
            if not (torch.equal(out[0], alone[0]) and torch.equal(out[n - 1], alone[n - 1])):
                return False
    return True


def check_bf16_rows(module: nn.Module) -> None:
    """Refuse a bf16 target on a CPU whose bf16 products round a row by how many rows they multiply:
    each distinct shape of ``module``'s bf16 layers is probed (:func:`rows_alone`). oneDNN picks its
    kernel by CPU, shape and row count: with AVX512-BF16 every count gives the same bits."""
    seen: set[tuple[int, int, bool]] = set()
    for layer in module.modules():
        if not isinstance(layer, HalfLinear):
            continue
        shape = (layer.out_features, layer.in_features, layer.bias is not None)
        if shape in seen:
            continue
        seen.add(shape)
        if not rows_alone(layer, layer.in_features):
            raise InvalidOptionError(
                "weights='bf16' is not exact on this CPU: its bf16 products round a row differently by how "
                f"many rows they multiply (a {shape[0]} x {shape[1]} projection), so speculative output could "
                "part from plain decoding. Use 'int8' or 'int4' (exact against plain decoding in that mode), "
                "or 'same'."
            )


def int4_available(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def int8_available(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [N, K] int8, scale [N] fp32)`` with ``q * scale`` the nearest symmetric grid to ``weight``."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [N, K] in 0..15, scale [N, K / group], zero [N, K / group])``, fp32 scales, with
    ``(q - 8) * scale + zero`` the group's affine grid nearest to ``weight``: the grid its groups
    already lie on where they do (:func:`grid_steps`), else the one from each group's min to max."""
    k = weight.shape[1]
    sample = weight[:SAMPLE_ROWS].float().reshape(-1, k // group, group)
    low, high = sample.amin(dim=-1), sample.amax(dim=-1)
    fits, flat = grid_steps(sample, low, high) > 0, low == high
    on_grids = bool(fits.any() and (fits | flat).all())
    q, scales, zeros = [], [], []
    for rows in torch.split(weight, CHUNK_ROWS):  # bounds the temporaries on a large LM head
        w = rows.float().reshape(len(rows), k // group, group)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scale = (high - low) / 15
        if on_grids:
            step = grid_steps(w, low, high)
            scale = torch.where(step > 0, step, scale)
        scale = scale.clamp_min(torch.finfo(torch.float32).tiny)
        q.append(torch.round((w - low[..., None]) / scale[..., None]).clamp_(0, 15).reshape(len(rows), k))
        scales.append(scale)
        zeros.append(low + 8 * scale)
    return torch.cat(q).to(torch.int32), torch.cat(scales), torch.cat(zeros)


def grid_steps(w: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """For each group of ``w`` [..., size] (its least and greatest values ``low``, ``high``), the
    step of an evenly spaced grid of at most 16 points from ``low`` that holds every value up to
    fp32 rounding, or 0 where there is none.

    A GGUF Q4_0 / Q4_1 / Q4_K block dequantized is such a grid (``d * sc * q - dmin * m``, q in
    0..15), but an optimised Q4_K sub-block often leaves its top or bottom points unused, so the
    grid from its min to its max would be finer and miss its values; on its own grid int4 holds
    them exactly (up to the kernel's bf16 scale and zero).
    """
    span = high - low
    found = torch.zeros_like(span)
    for points in range(15, 0, -1):  # intervals between the least and greatest value
        pending = ((found == 0) & (span > 0)).nonzero(as_tuple=True)
        if len(pending[0]) == 0:
            break
        step = span[pending] / points
        level = (w[pending] - low[pending][..., None]) / step[..., None]
        fits = ((level - torch.round(level)).abs() <= LEVEL_TOLERANCE).all(dim=-1)
        found[pending] = torch.where(fits, step, 0.0)
    return found


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    n, k = q.shape
    w = (q.reshape(n, k // group, group).float() - 8) * scale[..., None] + zero[..., None]
    return w.reshape(n, k)


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with W held as int8 or int4 (see the module docstring); bfloat16 compute."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: Literal["int8", "int4"]) -> None:
        super().__init__()
        if fmt == "int8":
            qweight, scales = quantize_int8(weight)
        else:
            q, scale, zero = quantize_int4(weight)
            qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            scales = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()  # the kernel's [K / group, N, 2]
        out_features, in_features = weight.shape
        self._hold(fmt, qweight, scales.to(torch.bfloat16), bias, in_features, out_features)

    def _hold(
        self,
        fmt: Literal["int8", "int4"],
        qweight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        in_features: int,
        out_features: int,
    ) -> None:
        self.out_features, self.in_features, self.format = out_features, in_features, fmt
        self.compute_dtype = torch.bfloat16
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(self.compute_dtype), requires_grad=False)
        self.qweight: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("qweight", _aligned(qweight))
        self.register_buffer("scales", _aligned(scales))

    @classmethod
    def restored(
        cls,
        fmt: Literal["int8", "int4"],
        qweight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        in_features: int,
        out_features: int,
    ) -> QuantLinear:
        """A layer from the tensors an earlier one of ``fmt`` held (``qweight``, ``scales``, ``bias``
        as its attributes); ``ValueError`` where they are not of that format and shape."""
        n, k = out_features, in_features
        expected = {
            "int8": ((n, k), torch.int8, (n,)),
            "int4": ((n, k // 2), torch.uint8, (k // GROUP, n, 2)),
        }[fmt]
        if (tuple(qweight.shape), qweight.dtype, tuple(scales.shape)) != expected or scales.dtype != torch.bfloat16:
            raise ValueError(f"not an {fmt} weight of shape {[n, k]}")
        if not _shape_fits(n, k, fmt):
            raise ValueError(f"the {fmt} kernel does not take a weight of shape {[n, k]}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._hold(fmt, qweight, scales, bias, in_features, out_features)
        return layer

    @staticmethod
    def fits(weight: torch.Tensor, fmt: Literal["int8", "int4"]) -> bool:
        """Whether the kernel of ``fmt`` takes a weight of this shape on its device."""
        n, k = weight.shape
        available = int8_available if fmt == "int8" else int4_available
        return available(weight.device) and _shape_fits(n, k, fmt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.compute_dtype)
        if self.format == "int8":
            y = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.qweight, GROUP, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy of it where it does not start on an ``ALIGNMENT``-byte boundary: tensors
    read from a file (a safetensors entry) start wherever the file put them, and the CPU int8
    kernel's aligned loads crash on such a weight."""
    return tensor if tensor.data_ptr() % ALIGNMENT == 0 else tensor.clone()


def _shape_fits(n: int, k: int, fmt: Literal["int8", "int4"]) -> bool:
    """Whether the CPU kernel of ``fmt`` computes right with ``n`` output channels of ``k`` inputs."""
    return k % INT8_INPUTS == 0 if fmt == "int8" else n % INT4_ROWS == 0 and k % GROUP == 0


class HalfLinear(Packable):
    """``y = x W^T + b`` with W in bfloat16 (the ``bf16`` format, whatever the model computes in).
    After :meth:`pack` it computes on a oneDNN-packed copy where oneDNN multiplies bf16 on this CPU
    (as :class:`~dflash2.runtime.linear.Linear` does in fp32): on a 2-core AMD EPYC with
    AVX512-BF16 a single row through Qwen2.5-Coder-1.5B's MLP took a third of the unpacked time."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def pack(self, release: bool = False) -> None:
        """Pre-pack the weight where supported; ``release``: then drop the plain one (its shape
        stays, on the meta device), for layers whose weight nothing else reads."""
        if packing_available(self.weight):
            self._pack(release)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # oneDNN kernels by row count: see linear.row_bucket
        rows = x.to(torch.bfloat16)
        if self._packed is not None:
            # a single row too runs at FEWEST_ROWS: oneDNN's one-row bf16 kernel rounds otherwise
            return packed_product(rows, self._packed, self.bias, wide=True).to(x.dtype)
        return padded_product(rows, lambda r: F.linear(r, self.weight, self.bias)).to(x.dtype)


def format_of(layer: nn.Module) -> WeightFormat:
    """The format a linear layer computes in (``"same"``: as loaded)."""
    if isinstance(layer, QuantLinear):
        return layer.format
    return "bf16" if isinstance(layer, HalfLinear) else "same"


def weight_of(layer: nn.Module, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 weight [N, K] a linear layer of any format computes with (``rows``: only those
    output rows), e.g. to build a smaller head from a quantized LM head."""
    if isinstance(layer, QuantLinear):  # its kernel applied to the identity gives W^T as it reads it
        eye = torch.eye(layer.in_features, dtype=layer.compute_dtype, device=layer.qweight.device)
        bias, layer.bias = layer.bias, None
        try:
            weight = layer(eye).t()
        finally:
            layer.bias = bias
    elif isinstance(layer, (Linear, HalfLinear)):
        weight = layer.weight.detach()
    else:
        raise TypeError(f"not a linear layer: {type(layer).__name__}")
    return (weight if rows is None else weight[rows]).float()


def quantize_linears(module: nn.Module, fmt: WeightFormat) -> nn.Module:
    """Replace every :class:`Linear` inside ``module`` by its ``fmt`` form, in place; returns ``module``.

    ``same`` changes nothing. A layer whose shape the int4 kernel cannot take falls back to int8,
    and int8 to bfloat16 where its kernel is missing or cannot take the shape either. A weight
    shared with an embedding stays where it is (the embedding keeps reading it); the layer gets its
    own quantized copy.
    """
    if fmt == "same":
        return module
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, quantize_linear(child, fmt))
    return module


def quantize_linear(linear: Linear, fmt: WeightFormat) -> nn.Module:
    """``linear`` in ``fmt`` (a new module; ``linear`` itself is unchanged), see :func:`quantize_linears`."""
    if fmt == "same":
        return linear
    weight, bias = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
    if fmt == "int4" and not QuantLinear.fits(weight, "int4"):
        fmt = "int8"
    if fmt == "int8" and not QuantLinear.fits(weight, "int8"):
        fmt = "bf16"
    if fmt == "bf16":
        return HalfLinear(weight, bias)
    assert fmt in ("int8", "int4")
    return QuantLinear(weight, bias, fmt)
