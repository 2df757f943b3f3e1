"""A bfloat16 twin of a quantized decoder, for forwards over many tokens (a drafter's prefill).

torch's int4 / int8 weight-only kernels read few bytes per weight, which is what a draft token
needs, but over many rows they unpack the weights again for every tile of rows, and where the
CPU multiplies bfloat16 natively a plain bf16 product overtakes them. Measured on a 2-core AMD
EPYC with AVX512-BF16 (Qwen2.5-Coder-0.5B, 2 threads): a prefill of 150 tokens took 0.77 s in
int4 and 0.42 s with bf16 projections, 1,000 tokens 5.3 s and 2.9 s; at 16 rows or fewer int4
was as fast or faster (a bf16 row reads 4× the bytes).

The twin shares the model's embeddings, norms, rotary tables, LM head and mixture-of-experts
layers and holds only the attention and MLP projections again, 2 bytes per weight; it reads and
writes the same KV cache. A drafter's precision only changes how often its tokens are accepted,
never the output.
"""

from __future__ import annotations

import time
from typing import cast

import torch

from dflash2.runtime.linear import Linear
from dflash2.runtime.model import MLP, Decoder, DecoderLayer
from dflash2.runtime.quant import HalfLinear, WeightFormat, quantize_linear
from dflash2.runtime.spec import ModelSpec

TWIN_ROWS = 32  # forwards over at least this many tokens run on the twin
_PROBE_ROWS = 64
_SMALLEST = 2**20  # projections of fewer weights fit the CPU's caches: their prefill is cheap anyway
_MARGIN = 0.8  # the twin is built where bf16 takes at most this share of the quantized product's time

Halves = dict[str, HalfLinear]


def _projections(model: Decoder) -> dict[str, tuple[torch.nn.Module, str]]:
    """Where the attention and (dense) MLP projections of every layer sit: name -> (parent, attribute)."""
    found: dict[str, tuple[torch.nn.Module, str]] = {}
    for i, layer in enumerate(_layers(model)):
        found[f"{i}.qkv"], found[f"{i}.o"] = (layer.attn, "qkv"), (layer.attn, "o")
        if isinstance(layer.mlp, MLP):
            found[f"{i}.gate_up"], found[f"{i}.down"] = (layer.mlp, "gate_up"), (layer.mlp, "down")
    return found


def _linears(model: Decoder) -> dict[str, Linear]:
    return {name: getattr(parent, attr) for name, (parent, attr) in _projections(model).items()}


def _layers(model: Decoder) -> list[DecoderLayer]:
    return [cast(DecoderLayer, layer) for layer in model.layers]


def bf16_pays(spec: ModelSpec, fmt: WeightFormat, device: torch.device) -> bool:
    """Whether a bf16 product over many rows is clearly faster than ``fmt``'s on this CPU for a model
    of ``spec`` (timed on random weights in the shape of its largest projection: no weight is read)."""
    if device.type != "cpu" or fmt not in ("int8", "int4"):
        return False
    with torch.device("meta"):
        shapes = [layer.weight.shape for layer in _linears(Decoder(spec)).values()]
    largest = max(shapes, key=lambda shape: shape.numel(), default=None)
    if largest is None or largest.numel() < _SMALLEST:
        return False
    probe = Linear(largest[1], largest[0])
    probe.weight = torch.nn.Parameter(torch.randn(largest) * 0.02, requires_grad=False)
    half, quantized = HalfLinear(probe.weight, None), quantize_linear(probe, fmt)
    rows = torch.randn(_PROBE_ROWS, largest[1])
    with torch.inference_mode():
        return _fastest(half, rows) <= _MARGIN * _fastest(quantized, rows)


def _fastest(layer: torch.nn.Module, rows: torch.Tensor, runs: int = 3) -> float:
    layer(rows)  # oneDNN builds its kernel on first use
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        layer(rows)
        times.append(time.perf_counter() - start)
    return min(times)


def halves(model: Decoder) -> Halves:
    """bf16 copies of ``model``'s projections; take them before it is quantized (from its loaded weights)."""
    return {name: HalfLinear(layer.weight, layer.bias) for name, layer in _linears(model).items()}


def assemble(model: Decoder, copies: Halves) -> Decoder:
    """The twin: ``model`` (quantized by now) with the projections of ``copies`` (see :func:`halves`)."""
    with torch.device("meta"):
        twin = Decoder(model.spec, model.dtype)
    twin.embed_tokens, twin.lm_head, twin.rope, twin.norm = model.embed_tokens, model.lm_head, model.rope, model.norm
    for mine, theirs in zip(_layers(twin), _layers(model), strict=True):
        mine.attn_norm, mine.mlp_norm = theirs.attn_norm, theirs.mlp_norm
        mine.attn.q_norm, mine.attn.k_norm = theirs.attn.q_norm, theirs.attn.k_norm
        if not isinstance(theirs.mlp, MLP):
            mine.mlp = theirs.mlp  # a mixture of experts runs as it is
    for name, (parent, attr) in _projections(twin).items():
        setattr(parent, attr, copies[name])
    twin.weights = model.weights
    return twin.eval().requires_grad_(False)
