"""Interop with z-lab's reference release (PyPI ``dflash`` 0.1.0, installed ``--no-deps``): its
drafters load in dflash2 and draft the same, and dflash2's exports load in it.

The reference's model classes are driven step by step exactly as its own ``dflash_generate``
drives them (the target's features, its DynamicCache cropped after every draft), beside a
dflash2 session fed the same features and outcomes; block logits, selector paths and proposal
distributions are compared at every step. The reference runs in float64, its math without
rounding, and dflash2 in fp32 must stay within 1e-5 of it: two fp32 implementations each carry
their own rounding (with stronger convolutions than here the reference's fp32 logits are 8e-6
from its float64 ones), so fp32 against fp32 would measure rounding twice. Only the reference's model
classes and helpers are used, never its generation loop's output as ground truth for ours.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import SPEC_PROMPTS, byte_tokenizer, random_model
from transformers import Qwen3Config

import dflash2
from dflash2 import SamplingConfig
from dflash2.drafters.base import DraftContext, Outcome
from dflash2.drafters.dflash import DFlashDrafter, DFlashSession, DFlashSpec, spread_layers

ref = pytest.importorskip("dflash.model")

BLOCK = 5
STEPS = 10
TOLERANCE = 1e-5


def _target(path: Path, arch: str, layers: int = 6) -> Path:
    model = random_model(arch, seed=1, std=0.2, num_hidden_layers=layers)
    model.save_pretrained(path)
    byte_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


def reference_config(
    target: Any, version: int, layer_ids: list[int] | None, sliding: bool, style: str = "v5"
) -> Qwen3Config:
    """A drafter config as z-lab writes one; ``style="v4"``: the RoPE in transformers-4 fields."""
    t = target.config
    draft: dict[str, Any] = {"block_size": BLOCK, "mask_token_id": 3}
    if layer_ids is not None:
        draft["target_layer_ids"] = layer_ids
    if version == 2:
        draft.update(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=6, output_multiplier=0.8)
        draft["final_logit_softcapping"] = 25.0
    rope: dict[str, Any] = (
        {"rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"}}
        if style == "v5"
        else {"rope_theta": 50000.0, "rope_scaling": None}
    )
    return Qwen3Config(
        architectures=["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"],
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_target_layers=t.num_hidden_layers,
        use_sliding_window=sliding,
        sliding_window=6 if sliding else None,
        layer_types=["sliding_attention", "full_attention"] if sliding else None,
        dflash_config=draft,
        **rope,
    )


def reference_drafter(config: Qwen3Config, seed: int = 0) -> Any:
    """The reference's model class with random weights: norms near 1, the rest N(0, 0.2) as in the
    target, but DFlash2's convolutions N(0, 0.02), transformers' initializer_range. Those multiply
    their input by kernels computed from it, four per layer: at N(0, 0.2) they amplify fp32
    rounding so much that the reference's own fp32 block logits differ from its float64 ones by
    8e-6, and no fp32 implementation can be held to 1e-5 of its math."""
    cls = ref.DFlash2DraftModel if "DFlash2DraftModel" in config.architectures else ref.DFlashDraftModel
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.02 if "_conv." in name else 0.2)
    return model


class Compared:
    """What the reference and dflash2 drafted at one step."""

    def __init__(self) -> None:
        self.logits_diff: list[float] = []
        self.probs_diff: list[float] = []
        self.paths: list[tuple[list[int], list[int]]] = []


def drive(reference: Any, drafter: DFlashDrafter, target: Any, prompt: list[int], temperature: float) -> Compared:
    """Both drafters through ``STEPS`` blocks of the target's greedy text, fed the same features."""
    sampling = SamplingConfig(temperature=temperature)
    found = Compared()
    ids = torch.tensor([prompt])
    start = len(prompt)
    positions = torch.arange(start + (STEPS + 1) * BLOCK)[None]
    target_cache, draft_cache = ref._make_cache(target.config), ref._make_cache(reference.config)
    with torch.inference_mode():
        out = target(ids, position_ids=positions[:, :start], past_key_values=target_cache, use_cache=True,
                     output_hidden_states=True, logits_to_keep=1)  # fmt: skip
        last = int(out.logits[0, -1].argmax())
        features = ref.extract_context_feature(out.hidden_states, reference.target_layer_ids)
        session = drafter.start(DraftContext(prompt, last, features[0], sampling, None, start + (STEPS + 2) * BLOCK))
        assert isinstance(session, DFlashSession)
        dtype = next(reference.parameters()).dtype  # float64: the reference's math, exactly
        head = copy.deepcopy(ref._output_head(target)).to(dtype)
        scale = float(ref._draft_value(reference.config, "input_embedding_scale", 1.0))
        for _ in range(STEPS):
            block = torch.tensor([[last] + [reference.mask_token_id] * (BLOCK - 1)])
            noise = ref._raw_input_embeddings(target, block, scale).to(dtype)
            hidden = reference(target_hidden=features.to(dtype), noise_embedding=noise, past_key_values=draft_cache,
                               position_ids=positions[:, start - features.shape[1] : start + BLOCK],
                               use_cache=True)[:, 1 - BLOCK :]  # fmt: skip
            ref._crop_to(draft_cache, start)
            ref_logits = reference.compute_logits(hidden, head)
            states = session._draft_states([last])
            our_logits = drafter.model.logits(states, drafter.head)
            found.logits_diff.append(float((ref_logits - our_logits.to(dtype)).abs().max()))
            ours, our_probs = session._pick(states, last, sampling)
            if isinstance(reference, ref.DFlash2DraftModel):
                tokens, candidates, q = reference.propose(hidden, block[:, 0], head, temperature)
                dense = None if q is None else torch.zeros_like(ref_logits, dtype=q.dtype)
                ref_probs = None if dense is None else dense.scatter_add(-1, candidates, q)
            elif temperature > 0:
                ref_probs = ref._sampling_probs(ref_logits, temperature)
                tokens = ref_probs.argmax(-1)
            else:
                tokens, ref_probs = ref_logits.argmax(-1), None
            if ref_probs is not None:
                assert our_probs is not None
                found.probs_diff.append(float((ref_probs[0] - our_probs.to(dtype)).abs().max()))
            found.paths.append(([int(t) for t in tokens[0]], [int(t) for t in ours]))
            # the target verifies the reference's block (greedy), both drafters learn the outcome
            verify = torch.cat([block[:, :1], tokens], dim=1)
            out = target(verify, position_ids=positions[:, start : start + BLOCK], past_key_values=target_cache,
                         use_cache=True, output_hidden_states=True)  # fmt: skip
            posterior = out.logits.argmax(-1)
            accepted = int((verify[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum())
            last = int(posterior[0, accepted])
            start += accepted + 1
            ref._crop_to(target_cache, start)
            features = ref.extract_context_feature(out.hidden_states, reference.target_layer_ids)[:, : accepted + 1]
            drafted = tuple(int(t) for t in tokens[0, :accepted])
            session.observe(Outcome(accepted, last, drafted, features[0]))
    session.close()
    return found


@pytest.fixture
def argmax_sampling(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Both selectors follow the likeliest candidate of their distributions, so that the
    distributions of one path can be compared (sampling would walk two different paths)."""
    monkeypatch.setattr(ref, "_sample_probs", lambda probs: probs.argmax(-1))
    monkeypatch.setattr("dflash2.drafters.dflash.sample", lambda probs, generator: probs.argmax(-1))
    yield


CASES = [
    pytest.param("llama", 1, [1, 4], False, id="llama-dflash"),
    pytest.param("qwen3", 1, None, False, id="qwen3-dflash-derived-layers"),
    pytest.param("llama", 2, None, True, id="llama-dflash2-derived-layers-sliding"),
    pytest.param("qwen3", 2, [0, 2, 5], True, id="qwen3-dflash2-sliding"),
]


@pytest.mark.parametrize(("arch", "version", "layer_ids", "sliding"), CASES)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_reference_drafters_draft_the_same_in_dflash2(
    tmp_path: Path,
    arch: str,
    version: int,
    layer_ids: list[int] | None,
    sliding: bool,
    temperature: float,
    argmax_sampling: None,
) -> None:
    target_dir = _target(tmp_path / "target", arch)
    target = dflash2.load(target_dir)
    hf = target_hf(target_dir)
    reference = reference_drafter(reference_config(hf, version, layer_ids, sliding))
    reference.save_pretrained(tmp_path / "drafter")
    reference = reference.double()
    model = dflash2.load(target_dir, drafter=tmp_path / "drafter")
    drafter = model.drafter
    assert isinstance(drafter, DFlashDrafter)
    expected_layers = tuple(layer_ids) if layer_ids else spread_layers(6, 2)
    assert drafter.capture_layers == expected_layers == tuple(reference.target_layer_ids)
    found = drive(reference, drafter, hf, list(target.tokenizer(SPEC_PROMPTS[2]).input_ids), temperature)
    assert max(found.logits_diff) <= TOLERANCE, found.logits_diff
    assert all(theirs == ours for theirs, ours in found.paths), found.paths
    if temperature > 0:
        assert len(found.probs_diff) == STEPS and max(found.probs_diff) <= TOLERANCE, found.probs_diff


def target_hf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_transformers_4_and_5_config_styles_give_the_same_drafter(tmp_path: Path) -> None:
    hf = random_model("llama", num_hidden_layers=6)
    specs = []
    for style in ("v4", "v5"):
        raw = reference_config(hf, 2, None, True, style).to_dict()
        if style == "v4":  # what transformers 4 writes: no rope_parameters at all
            raw.pop("rope_parameters", None)
            raw["rope_theta"] = 50000.0
        specs.append(DFlashSpec.from_config(raw))
    v4, v5 = specs
    assert v4.target_layer_ids == v5.target_layer_ids == spread_layers(6, 2)
    assert (v4.causal, v4.sliding_windows) == (v5.causal, v5.sliding_windows) == ((True, False), (6, None))
    from dflash2.runtime.spec import rope_frequencies

    for spec in specs:
        inv_freq, _ = rope_frequencies(spec.hf_config, spec.head_dim)
        assert torch.equal(inv_freq, rope_frequencies(v5.hf_config, 16)[0])
        assert float(inv_freq[1]) == pytest.approx(50000.0 ** (-2 / 16))


@pytest.mark.parametrize("version", [1, 2])
def test_dflash2_exports_load_in_the_reference(tmp_path: Path, version: int) -> None:
    """A drafter exported by ``dflash2.train.export`` loads in the reference with every weight
    and drafts the same."""
    from dflash2.train.trainer import export

    target_dir = _target(tmp_path / "target", "qwen3")
    hf = target_hf(target_dir)
    source = reference_drafter(reference_config(hf, version, [1, 4], version == 2), seed=5)
    source.save_pretrained(tmp_path / "source")
    loaded = dflash2.load(target_dir, drafter=tmp_path / "source").drafter
    assert isinstance(loaded, DFlashDrafter)
    raw = json.loads((tmp_path / "source" / "config.json").read_text())
    export(loaded.model, raw, tmp_path / "export", history=[])
    cls = ref.DFlash2DraftModel if version == 2 else ref.DFlashDraftModel
    reference, info = cls.from_pretrained(tmp_path / "export", output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["block_size"] == BLOCK and exported["num_target_layers"] == 6
    assert exported["rope_theta"] == 50000.0  # transformers 4 readers take the RoPE from here
    again = dflash2.load(target_dir, drafter=tmp_path / "export").drafter
    assert isinstance(again, DFlashDrafter)
    found = drive(reference.double().eval(), again, hf, list(range(5, 30)), 0.0)
    assert max(found.logits_diff) <= TOLERANCE
    assert all(theirs == ours for theirs, ours in found.paths)


def test_the_shipped_drafter_reads_the_same_everywhere() -> None:
    """Its config carries every field the readers look for, and the reference loads every weight."""
    from dflash2.demo_model import shipped_drafter

    shipped = shipped_drafter()
    assert shipped is not None
    raw = json.loads((shipped / "config.json").read_text())
    assert DFlashSpec.from_config(raw).portable_config(raw) == raw
    assert (raw["block_size"], raw["rope_theta"], raw["num_target_layers"]) == (8, 100000.0, 30)
    reference, info = ref.DFlashDraftModel.from_pretrained(shipped, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert reference.block_size == 8 and list(reference.target_layer_ids) == [1, 14, 27]
