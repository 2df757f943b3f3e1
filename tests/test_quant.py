"""Weight-only quantized drafters: the kernels compute what the formats say, and a drafter's
precision never changes the output (greedy here, sampling in ``test_sampling_distribution.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_speculative import PIPELINES, PROMPTS
from tiny import save_tiny_dflash

import dflash2
from dflash2 import InvalidOptionError
from dflash2.drafters import HybridDrafter, draft_weights, load_drafter
from dflash2.drafters.autoregressive import AutoregressiveDrafter
from dflash2.runtime.linear import Linear, packing_available
from dflash2.runtime.quant import (
    GROUP,
    HalfLinear,
    QuantLinear,
    dequantize_int4,
    quantize_int4,
    quantize_int8,
    quantize_linears,
    weight_of,
)

FORMATS = ("bf16", "int8", "int4")


def _linear(n: int, k: int, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(k, n, bias=True)
    layer.weight.data.normal_(0, 0.05)
    layer.bias.data.normal_(0, 0.05)  # type: ignore[union-attr]
    return layer


def test_int4_groups_are_affine_grids() -> None:
    w = torch.randn(32, 128) * 0.05
    q, scale, zero = quantize_int4(w)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15
    assert scale.shape == zero.shape == (32, 128 // GROUP)
    error = (dequantize_int4(q, scale, zero) - w).abs().reshape(32, -1, GROUP)
    assert bool((error <= scale[..., None] / 2 * (1 + 1e-5)).all())  # the nearest point of the grid


def _gguf_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A [rows, cols] weight as GGUF's own dequantizer reads random blocks of ``kind`` (every bit
    pattern is a valid block once its fp16 scales are sane)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 3e-3, (rows, cols // block, 2)).astype(np.float16).view(np.uint8)
    if kind == "Q4_K":  # d and dmin lead the block
        raw[..., :4] = scales.reshape(rows, cols // block, 4)
    else:  # Q6_K: d ends it; Q8_0: d leads it
        at = size - 2 if kind == "Q6_K" else 0
        raw[..., at : at + 2] = scales[..., :2]
    return torch.from_numpy(quants.dequantize(raw.reshape(rows, -1), qtype).copy())


def test_gguf_q4k_blocks_are_held_on_their_own_grids() -> None:
    """A Q4_K sub-block holds d * sc * q - dmin * m, q in 0..15: int4's affine group holds it
    exactly, also where the sub-block leaves q = 0 or q = 15 unused (the min-to-max grid would not)."""
    w = _gguf_blocks("Q4_K", 32, 512)
    groups = w.reshape(32, -1, GROUP)
    span = groups.amax(-1) - groups.amin(-1)
    q, scale, zero = quantize_int4(w)
    assert bool((scale[span > 0] > span[span > 0] / 15 * (1 + 1e-4)).any())  # some leave an end unused
    back = dequantize_int4(q, scale, zero)
    assert torch.allclose(back, w, rtol=0, atol=1e-6 * float(w.abs().max()))
    # the kernel keeps scale and zero in bf16 (8 bits of mantissa) and so is its product, here
    # the weight itself: each value within those roundings
    kernel = QuantLinear(w, None, "int4")
    bound = ((8 * scale.abs() + zero.abs())[..., None] + w.abs().reshape(32, -1, GROUP)) * 2**-8
    error = (weight_of(kernel) - w).abs().reshape(32, -1, GROUP)
    assert bool((error <= bound).all())


@pytest.mark.parametrize("kind", ["Q6_K", "Q8_0"])
def test_finer_gguf_blocks_requantize_to_the_nearest_int4_grid(kind: str) -> None:
    """Q6_K (64 levels) and Q8_0 (256) do not fit 16 points: each group goes onto its min-to-max grid."""
    w = _gguf_blocks(kind, 16, 256, seed=1)
    q, scale, zero = quantize_int4(w)
    groups = w.reshape(16, -1, GROUP)
    assert torch.allclose(scale, (groups.amax(-1) - groups.amin(-1)) / 15)
    error = (dequantize_int4(q, scale, zero) - w).abs().reshape(16, -1, GROUP)
    assert bool((error <= scale[..., None] / 2 * (1 + 1e-5)).all())


def test_int8_is_symmetric_per_channel() -> None:
    w = torch.randn(24, 40)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (24,)
    assert torch.allclose(q.float() * scale[:, None], w, atol=float(scale.max()) / 2 + 1e-6)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_linear_computes_the_dequantized_product(fmt: str) -> None:
    layer = _linear(48, 96)
    w = layer.weight.detach()
    if fmt == "int4":
        grid = dequantize_int4(*quantize_int4(w))
    else:
        q, scale = quantize_int8(w)
        grid = q.float() * scale.bfloat16().float()[:, None]
    quantized = QuantLinear(w, layer.bias, fmt)  # type: ignore[arg-type]
    x = torch.randn(2, 5, 96)
    expected = x.bfloat16().float() @ grid.T + layer.bias.detach()  # type: ignore[union-attr]
    got = quantized(x)
    assert got.shape == (2, 5, 48) and got.dtype == torch.float32
    assert torch.allclose(got, expected, rtol=0.02, atol=0.02)  # bfloat16 activations and scales


def test_quantize_linears_replaces_every_projection_and_keeps_shapes_the_kernels_refuse() -> None:
    model = torch.nn.Sequential(_linear(64, 64), _linear(40, 64), _linear(64, 48))  # 40 rows, 48 inputs: not int4
    quantize_linears(model, "int4")
    first, odd_rows, odd_inputs = model
    assert isinstance(first, QuantLinear) and first.format == "int4"
    assert isinstance(odd_rows, QuantLinear) and odd_rows.format == "int8"  # int4 packs rows in sixteens
    assert isinstance(odd_inputs, QuantLinear) and odd_inputs.format == "int8"  # and inputs in groups of 32
    assert [tuple(layer(torch.randn(3, layer.in_features)).shape) for layer in model] == [(3, 64), (3, 40), (3, 64)]
    half = quantize_linears(torch.nn.Sequential(_linear(16, 32)), "bf16")
    assert isinstance(half[0], HalfLinear) and half[0].weight.dtype == torch.bfloat16
    same = torch.nn.Sequential(_linear(16, 32))
    assert isinstance(quantize_linears(same, "same")[0], Linear)


@pytest.mark.parametrize("inputs", [40, 44, 24])
def test_int8_takes_only_inputs_its_kernel_reads_whole(inputs: int) -> None:
    """torch's CPU int8 kernel reads a row's inputs 16 at a time (on AVX-512 rows 32-byte aligned):
    with other widths it reads past each row, computes garbage and may crash. Such a layer is held
    in bf16 instead, from scratch or from a stored int8 layer."""
    layer = _linear(32, inputs)
    (kept,) = quantize_linears(torch.nn.Sequential(layer), "int8")
    assert isinstance(kept, HalfLinear)
    x = torch.randn(5, inputs)
    expected = layer(x)
    for rows in (x[:1], x):  # one row read past its end; several misaligned
        assert torch.allclose(kept(rows), expected[: len(rows)], rtol=0.02, atol=0.02)
    q, scales = quantize_int8(layer.weight.detach())
    with pytest.raises(ValueError):
        QuantLinear.restored("int8", q, scales.bfloat16(), None, inputs, 32)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_stored_layer_read_back_at_any_address_computes_right(fmt: str) -> None:
    """A layer read back from a file starts where the file put it (a safetensors entry: 8-byte
    steps); the int8 kernel's aligned loads crashed on such a weight. It is held aligned."""
    fresh = QuantLinear(_linear(32, 64).weight.detach(), None, fmt)  # type: ignore[arg-type]
    shifted = []
    for tensor in (fresh.qweight, fresh.scales):
        raw = tensor.reshape(-1).view(torch.uint8)
        buffer = torch.empty(raw.numel() + 8, dtype=torch.uint8)[8:]  # 8 bytes past an aligned start
        buffer.copy_(raw)
        shifted.append(buffer.view(tensor.dtype).view(tensor.shape))
    assert shifted[0].data_ptr() % 16 == 8
    restored = QuantLinear.restored(fmt, shifted[0], shifted[1], None, 64, 32)  # type: ignore[arg-type]
    assert restored.qweight.data_ptr() % 64 == 0 and restored.scales.data_ptr() % 64 == 0
    x = torch.randn(3, 64)
    assert torch.equal(restored(x), fresh(x))


def test_a_tied_head_is_quantized_apart_from_the_embedding(paths: dict[str, Path]) -> None:
    target = dflash2.load(paths["target"])
    tied = dflash2.load(paths["target"]).target  # a fresh copy to quantize
    tied.lm_head.weight = tied.embed_tokens.weight
    embedding = tied.embed_tokens.weight.detach().clone()
    quantize_linears(tied, "int4")
    assert isinstance(tied.lm_head, QuantLinear)
    assert torch.equal(tied.embed_tokens.weight, embedding)  # still the fp32 table, read a row at a time
    assert target.target.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("kind", ["autoregressive", "hybrid", "dflash2"])
def test_a_drafters_precision_never_changes_the_output(
    fmt: str, pipeline: str, kind: str, paths: dict[str, Path], references: dict[str, list[int]]
) -> None:
    drafter = {"autoregressive": paths["target"], "hybrid": ["ngram", paths["target"]]}.get(kind, paths["dflash2"])
    model = dflash2.load(paths["target"], drafter=drafter, drafter_weights=fmt)
    quantized = [m for m in _drafter_modules(model) if isinstance(m, (QuantLinear, HalfLinear))]
    assert quantized and not any(isinstance(m, Linear) for m in _drafter_modules(model))
    for prompt in PROMPTS:
        completion = model.generate(prompt, max_new_tokens=48, pipeline=pipeline)
        assert list(completion.token_ids) == references[prompt]


@pytest.mark.parametrize("kind", ["autoregressive", "dflash2"])
def test_a_bf16_drafter_computes_on_packed_copies_where_onednn_multiplies_bf16(
    kind: str, paths: dict[str, Path]
) -> None:
    if not packing_available(torch.zeros(1, dtype=torch.bfloat16)):
        pytest.skip("oneDNN does not multiply bf16 on this CPU: bf16 layers compute unpacked")
    model = dflash2.load(paths["target"], drafter=paths["target" if kind == "autoregressive" else kind],
                         drafter_weights="bf16")  # fmt: skip
    halves = [m for m in _drafter_modules(model) if isinstance(m, HalfLinear)]
    assert halves and all(m.packed for m in halves)


def _drafter_modules(model: dflash2.Model) -> list[torch.nn.Module]:
    drafter = model.drafter
    inner = drafter.model if isinstance(drafter, HybridDrafter) else drafter  # a hybrid's model drafter
    network = getattr(inner, "model", None)
    assert isinstance(network, torch.nn.Module)
    return list(network.modules())


def test_auto_weights_are_int4_for_a_causal_lm_on_the_cpu_and_leave_a_dflash_drafter(paths: dict[str, Path]) -> None:
    target = dflash2.load(paths["target"])
    drafter = load_drafter(paths["target"], target.target, target.tokenizer)
    assert isinstance(drafter, AutoregressiveDrafter)
    formats = {m.format for m in drafter.model.modules() if isinstance(m, QuantLinear) and m.out_features % 16 == 0}
    assert formats == {"int4"}  # (the byte vocabulary's head, 260 rows, takes int8)
    dflash = load_drafter(paths["dflash2"], target.target, target.tokenizer)
    assert not any(isinstance(m, QuantLinear) for m in dflash.model.modules())  # type: ignore[union-attr]
    with pytest.raises(InvalidOptionError, match="drafter_weights must be one of"):
        dflash2.load(paths["target"], drafter=paths["target"], drafter_weights="int2")


def test_the_weight_only_kernels_are_refused_off_the_cpu() -> None:
    cuda = torch.device("cuda")  # no device needed: the choice is made before anything loads there
    assert draft_weights("auto", cuda) == "same" and draft_weights("bf16", cuda) == "bf16"
    with pytest.raises(InvalidOptionError, match="CPU only"):
        draft_weights("int4", cuda)


def test_a_drafter_of_its_own_head_quantizes_that_head(tmp_path: Path, paths: dict[str, Path]) -> None:
    limited = save_tiny_dflash(tmp_path / "d", version=1)
    (limited / "draft_vocab.json").write_text('{"token_ids": [' + ", ".join(str(i) for i in range(32)) + "]}")
    model = dflash2.load(paths["target"], drafter=limited, drafter_weights="int4")
    head = model.drafter.head  # type: ignore[union-attr]
    assert isinstance(head, QuantLinear) and head.out_features == 32
    assert model.target.lm_head is not head and isinstance(model.target.lm_head, Linear)
