"""The bf16 twin of a quantized drafter: what it shares, when it is built, and that prefills on it
leave the output unchanged (greedy identical to plain decoding, sampling identically distributed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_sampling_distribution import (
    CONFIGS,
    PROMPT,
    SMALL_VOCAB,
    check_marginals,
    exact_marginals,
    sample_marginals,
)
from tiny import save_tiny

import dflash2
from dflash2.drafters import autoregressive
from dflash2.drafters.autoregressive import AutoregressiveDrafter
from dflash2.runtime import twin
from dflash2.runtime.loader import load_decoder, load_spec
from dflash2.runtime.quant import HalfLinear, QuantLinear, quantize_linears

LONG = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"


def _twin_of(path: Path) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """(the loaded fp32 model, a second copy quantized to int4, that copy's twin)."""
    plain = load_decoder(path, torch.float32, torch.device("cpu"))
    model = load_decoder(path, torch.float32, torch.device("cpu"))
    copies = twin.halves(model)
    quantize_linears(model, "int4")
    return plain, model, twin.assemble(model, copies)


def test_the_twin_shares_all_but_the_projections(paths: dict[str, Path]) -> None:
    plain, model, double = _twin_of(paths["target"])
    assert double.embed_tokens is model.embed_tokens and double.lm_head is model.lm_head
    assert double.rope is model.rope and double.norm is model.norm
    for mine, theirs in zip(double.layers, model.layers, strict=True):
        assert mine.attn_norm is theirs.attn_norm and mine.mlp_norm is theirs.mlp_norm
        assert all(isinstance(p, HalfLinear) for p in (mine.attn.qkv, mine.attn.o, mine.mlp.gate_up, mine.mlp.down))
        assert isinstance(theirs.attn.qkv, QuantLinear)
    assert not any(t.is_meta for t in [*double.parameters(), *double.buffers()])
    # its keys and values are the loaded model's up to bf16 rounding, closer than the int4 model's own
    ids = torch.arange(3, 40)[None]
    caches = []
    with torch.inference_mode():
        for network in (plain, double, model):
            caches.append(network.new_cache(64))
            network(ids, caches[-1], logits="none")
    n = ids.shape[1]
    exact, rounded, quantized = (c.k[..., :n, :] for c in caches)
    error = float((rounded - exact).norm() / exact.norm())
    assert 0 < error < 0.02
    assert error < float((quantized - exact).norm() / exact.norm())


def test_a_twin_is_built_only_under_auto_where_bf16_pays(
    paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, cpu = load_spec(paths["target"]), torch.device("cpu")
    assert not twin.bf16_pays(spec, "int4", cpu)  # a tiny model's prefill is cheap: nothing to time
    monkeypatch.setattr(twin, "_SMALLEST", 0)
    timings = iter([1.0, 0.9])  # bf16, then int4: bf16 not clearly faster
    monkeypatch.setattr(twin, "_fastest", lambda layer, rows: next(timings))
    assert not twin.bf16_pays(spec, "int4", cpu)
    timings = iter([0.7, 1.0])
    assert twin.bf16_pays(spec, "int4", cpu)
    assert not twin.bf16_pays(spec, "same", cpu) and not twin.bf16_pays(spec, "bf16", cpu)

    monkeypatch.setattr(twin, "bf16_pays", lambda spec, fmt, device: True)
    auto = dflash2.load(paths["target"], drafter=paths["target"])
    assert isinstance(auto.drafter, AutoregressiveDrafter) and auto.drafter.prefill is not None
    chosen = dflash2.load(paths["target"], drafter=paths["target"], drafter_weights="int4")
    assert isinstance(chosen.drafter, AutoregressiveDrafter) and chosen.drafter.prefill is None


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_prefills_on_the_twin_leave_greedy_output_unchanged(
    pipeline: str, paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = dflash2.load(paths["target"])
    monkeypatch.setattr(twin, "bf16_pays", lambda spec, fmt, device: True)
    model = dflash2.load(paths["target"], drafter=["ngram", paths["random"]], block_size=4)
    drafter = model.drafter.model  # type: ignore[union-attr]
    assert isinstance(drafter, AutoregressiveDrafter) and drafter.prefill is not None
    rows: list[int] = []
    drafter.prefill.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[1]))
    for prompt in (LONG, LONG + "    return a * b\n"):
        expected = plain.generate(prompt, max_new_tokens=40).token_ids
        assert model.generate(prompt, max_new_tokens=40, pipeline=pipeline).token_ids == expected
    assert rows and min(rows) >= twin.TWIN_ROWS  # the prompts went through it, the draft tokens did not


def test_sampling_with_a_twin_matches_the_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = save_tiny(tmp_path / "target", "llama", seed=2, std=0.15, **SMALL_VOCAB)
    draft = save_tiny(tmp_path / "draft", "llama", seed=9, std=0.15, **SMALL_VOCAB)
    monkeypatch.setattr(twin, "bf16_pays", lambda spec, fmt, device: True)
    monkeypatch.setattr(autoregressive, "TWIN_ROWS", 4)  # the 8-token prompt's prefill runs on the twin
    config = CONFIGS[1]
    model = dflash2.load(target, drafter=draft, block_size=3)
    assert model.drafter.prefill is not None  # type: ignore[union-attr]
    prompt_ids = model.tokenizer(PROMPT).input_ids
    *counts, accepted = sample_marginals(model, config, 3, pipeline="sync")
    check_marginals(counts, exact_marginals(target, prompt_ids, config))
    assert accepted[0] > 0
