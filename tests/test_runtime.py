"""Our decoder against transformers itself: logits, greedy decoding, RoPE variants, cache rollback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import SPEC_PROMPTS, VOCAB, hf_greedy, save_tiny, tiny_hf_model
from transformers import AutoModelForCausalLM

from dflash2.runtime.model import Decoder
from dflash2.runtime.spec import ModelSpec

ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}


def ours_from(hf_model: torch.nn.Module) -> Decoder:
    spec = ModelSpec.from_hf_config(hf_model.config)
    return Decoder.from_hf_state(spec, hf_model.state_dict(), torch.float32, torch.device("cpu"))


def incremental_logits(model: Decoder, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Prefill ``prefill`` tokens as one block, then one token per forward."""
    cache = model.new_cache(ids.shape[1])
    chunks = [model(ids[:, :prefill], cache).logits]
    for i in range(prefill, ids.shape[1]):
        chunks.append(model(ids[:, i : i + 1], cache).logits)
    return torch.cat(chunks, dim=1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers(arch: str, tied: bool) -> None:
    hf = tiny_hf_model(arch, tie_word_embeddings=tied)
    ours = ours_from(hf)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference = hf(ids).logits
        prefill_only = ours(ids, ours.new_cache(40)).logits
        stepwise = incremental_logits(ours, ids, prefill=17)
    assert (prefill_only - reference).abs().max().item() < 1e-4
    assert (stepwise - reference).abs().max().item() < 1e-4


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_rope_scaling_matches_transformers(variant: str) -> None:
    hf = tiny_hf_model("llama", rope_parameters={"rope_theta": 10000.0, **ROPE_VARIANTS[variant]})
    ours = ours_from(hf)
    ids = torch.randint(0, VOCAB, (1, 300), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        reference = hf(ids).logits
        stepwise = incremental_logits(ours, ids, prefill=250)
    assert (stepwise - reference).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_64_greedy_tokens_identical_to_generate(arch: str) -> None:
    hf = tiny_hf_model(arch, eos_token_id=None)
    ours = ours_from(hf)
    prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    reference = hf_greedy(hf, prompt, 64)
    with torch.inference_mode():
        cache = ours.new_cache(12 + 64)
        logits = ours(prompt, cache, logits="last").logits
        tokens = [int(logits[0, -1].argmax())]
        while len(tokens) < 64:
            logits = ours(torch.tensor([[tokens[-1]]]), cache, logits="last").logits
            tokens.append(int(logits[0, -1].argmax()))
    assert tokens == reference


def test_rollback_equals_never_having_processed() -> None:
    ours = ours_from(tiny_hf_model("qwen3"))
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    junk = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        clean = ours.new_cache(64)
        ours(ids[:, :20], clean)
        expected = ours(ids[:, 20:], clean).logits

        dirty = ours.new_cache(64)
        ours(ids[:, :20], dirty)
        ours(junk, dirty)  # k = 7 tokens that will be rejected
        dirty.rollback(23)  # keep 3 of them ...
        dirty.rollback(20)  # ... then drop those too
        got = ours(ids[:, 20:], dirty).logits
    assert dirty.length == 30
    assert torch.equal(got, expected)


def test_partial_rollback_keeps_the_accepted_prefix() -> None:
    ours = ours_from(tiny_hf_model("llama"))
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        full = ours(ids, ours.new_cache(32)).logits
        cache = ours.new_cache(32)
        ours(ids[:, :10], cache)
        block = ids[:, 10:18].clone()
        block[0, 5:] = (block[0, 5:] + 1) % VOCAB  # the last 3 tokens of the block are wrong
        ours(block, cache)
        cache.rollback(15)  # accept the 5 correct ones
        rest = ours(ids[:, 15:], cache).logits
    assert (rest - full[:, 15:]).abs().max().item() < 1e-5


def test_hidden_state_capture_matches_transformers() -> None:
    hf = tiny_hf_model("qwen3", num_hidden_layers=3)
    ours = ours_from(hf)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        reference = hf(ids, output_hidden_states=True).hidden_states
        cache = ours.new_cache(16)
        ours(ids[:, :10], cache)
        out = ours(ids[:, 10:], cache, capture=(0, 2), logits="none")  # 2 is the last layer
    assert out.logits is None and out.hidden is not None
    expected = torch.cat([reference[1][:, 10:], reference[3][:, 10:]], dim=-1)
    assert (out.hidden - expected).abs().max().item() < 1e-4


def test_cache_overflow_is_a_clear_error() -> None:
    from dflash2 import ContextLengthError

    ours = ours_from(tiny_hf_model("llama"))
    cache = ours.new_cache(8)
    with torch.inference_mode(), pytest.raises(ContextLengthError, match="max_new_tokens"):
        ours(torch.zeros(1, 9, dtype=torch.long), cache)


def test_packed_projections_give_the_same_logits() -> None:
    ours = ours_from(tiny_hf_model("qwen2"))
    ids = torch.randint(0, VOCAB, (1, 21), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        plain = incremental_logits(ours, ids, prefill=5)
        ours.pack()
        packed = incremental_logits(ours, ids, prefill=5)
        cache = ours.new_cache(21)
        ours(ids[:, :17], cache)
        block = ours(ids[:, 17:], cache).logits  # a 4-token block through the packed path
    assert (packed - plain).abs().max().item() < 1e-4
    assert (block - plain[:, 17:]).abs().max().item() < 1e-4


def test_a_packed_projection_gives_a_row_the_same_bits_alone_as_in_a_block() -> None:
    """Decoding multiplies one row, verification a few: for a weight larger than the CPU's caches
    both run the same oneDNN kernel (a one-row product alone takes a slower matrix-vector path
    that rounds otherwise)."""
    from dflash2.runtime.linear import WIDE, Linear

    layer = Linear(1536, 6144)
    assert layer.weight.numel() >= WIDE
    torch.nn.init.normal_(layer.weight, std=0.05, generator=torch.Generator().manual_seed(0))
    layer.pack()
    x = torch.randn(5, 1536, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        block = layer(x)
        for rows in (1, 2, 3, 4):
            assert torch.equal(layer(x[:rows]), block[:rows])


def test_moe_routing_follows_the_config() -> None:
    hf = tiny_hf_model("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[2], decoder_sparse_step=1)
    spec = ModelSpec.from_hf_config(hf.config)
    assert spec.moe is not None and spec.moe.layers == {0, 1, 3} and spec.moe.top_k == 2
    every_other = ModelSpec.from_hf_config(tiny_hf_model("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[],
                                                        decoder_sparse_step=2).config)  # fmt: skip
    assert every_other.moe is not None and every_other.moe.layers == {1, 3}


@pytest.mark.parametrize("normalize", [True, False])
def test_moe_checkpoint_on_disk_decodes_and_speculates_losslessly(
    tmp_path: Path, normalize: bool, paths: dict[str, Path]
) -> None:
    """Per-expert tensors as checkpoints store them; greedy equal to transformers, and every
    drafter lossless on the MoE target (the DFlash drafter reading its captured features)."""
    import dflash2

    target = save_tiny(tmp_path / "moe", "qwen3_moe", seed=4, norm_topk_prob=normalize, eos_token_id=None)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    plain = dflash2.load(target)
    prompt = SPEC_PROMPTS[0]
    expected = hf_greedy(hf, plain.tokenizer(prompt).input_ids, 40)
    assert list(plain.generate(prompt, max_new_tokens=40).token_ids) == expected
    for drafter in ("ngram", paths["dflash1"], ["ngram", paths["dflash2"]]):
        model = plain.with_drafter(drafter)
        for pipeline in ("sync", "async"):
            assert list(model.generate(prompt, max_new_tokens=40, pipeline=pipeline).token_ids) == expected
