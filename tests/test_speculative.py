"""The speculative engine with every drafter: exactness, acceptance invariants, finishing, errors."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import EOS, PAD, SPEC_PROMPTS, VOCAB, full_blocks

import dflash2
from dflash2.drafters import Draft, DraftContext, HybridDrafter, NGramDrafter, Outcome
from dflash2.drafters.dflash import grouped_dynamic_convolve

PROMPTS = SPEC_PROMPTS
PIPELINES = ["sync", "async"]


DRAFTERS = ["ngram", "self", "random", "dflash1", "dflash2", "hybrid-random", "hybrid-dflash2"]


def drafter_arg(name: str, paths: dict[str, Path]) -> Any:
    if name.startswith("hybrid-"):  # a lookup that matches often, so that both drafters take turns
        return [NGramDrafter(min_ngram=1, max_ngram=2), drafter_arg(name.removeprefix("hybrid-"), paths)]
    return {"ngram": "ngram", "self": paths["target"], "random": paths["random"]}.get(name) or paths[name]


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_identical_to_transformers(
    name: str, pipeline: str, paths: dict[str, Path], references: dict[str, list[int]]
) -> None:
    model = dflash2.load(paths["target"], drafter=drafter_arg(name, paths))
    for prompt in PROMPTS:
        completion = model.generate(prompt, max_new_tokens=48, pipeline=pipeline)
        assert list(completion.token_ids) == references[prompt][: len(completion.token_ids)]
        assert len(completion.token_ids) == len(references[prompt])


def test_self_draft_accepts_every_token(paths: dict[str, Path]) -> None:
    model = dflash2.load(paths["target"], drafter=paths["target"], block_size=5, drafter_weights="same")
    stats = full_blocks(model).generate(PROMPTS[1], max_new_tokens=41).stats
    # 1 token from the prefill, then 8 full blocks of 5 (4 drafts + the bonus)
    assert stats.acceptance_lengths == (5,) * 8
    assert stats.mean_acceptance_length == 5.0


def record_proposals(monkeypatch: Any) -> list[int]:
    """Every token the autoregressive drafter's sessions propose from now on, in a list kept current."""
    from dflash2.drafters.autoregressive import AutoregressiveSession

    proposed: list[int] = []
    propose = AutoregressiveSession.propose

    def recording(session: AutoregressiveSession, max_tokens: int) -> Draft:
        draft = propose(session, max_tokens)
        proposed.extend(draft.tokens.tolist())
        return draft

    monkeypatch.setattr(AutoregressiveSession, "propose", recording)
    return proposed


@pytest.mark.parametrize("weights", ["same", "int4"])
def test_a_drafting_vocabulary_drafts_only_its_tokens(
    weights: str, paths: dict[str, Path], references: dict[str, list[int]], tmp_path: Path, monkeypatch: Any
) -> None:
    """The target drafting for itself over even token ids only: drafts of those alone, output unchanged."""
    limited = tmp_path / "even"
    shutil.copytree(paths["target"], limited)
    even = list(range(0, VOCAB, 2))
    (limited / "draft_vocab.json").write_text(json.dumps({"token_ids": even[::-1]}))  # any order
    proposed = record_proposals(monkeypatch)
    model = full_blocks(dflash2.load(paths["target"], drafter=limited, drafter_weights=weights))
    assert model.drafter.vocab.tolist() == even  # type: ignore[union-attr]
    for pipeline in PIPELINES:
        for prompt in PROMPTS:
            assert list(model.generate(prompt, max_new_tokens=48, pipeline=pipeline).token_ids) == references[prompt]
    assert proposed and all(t % 2 == 0 for t in proposed)
    if weights == "same":  # the target's own choice wherever it is even: every such draft accepted
        stats = model.generate(PROMPTS[1], max_new_tokens=48, pipeline="sync").stats
        assert stats.mean_acceptance_length > 1.0


def test_a_large_vocabulary_drafts_its_frequent_tokens_and_the_texts_own(tmp_path: Path, monkeypatch: Any) -> None:
    """A small LM drafter of a large vocabulary (a tied LM head) drafts by default over the
    lowest ids and the tokens of the request's text: here the first 64 of 260 ids, so that most of
    the text's tokens lie outside them; the target drafting for itself, the output unchanged."""
    from dflash2.drafters import vocabulary
    from dflash2.testing import save_random

    monkeypatch.setattr(vocabulary, "LARGE_VOCAB", VOCAB)
    monkeypatch.setattr(vocabulary, "FREQUENT_IDS", 64)
    target = save_random(tmp_path / "tied", "llama", seed=5, tie_word_embeddings=True)
    proposed = record_proposals(monkeypatch)
    plain = dflash2.load(target)
    model = full_blocks(dflash2.load(target, drafter=target, drafter_weights="same"))
    drafter = model.drafter
    assert drafter is not None and drafter.context
    special = set(plain.tokenizer.all_special_ids)
    assert drafter.vocab.tolist() == sorted({*range(64), *special})
    for pipeline in PIPELINES:
        for prompt in PROMPTS:
            want = plain.generate(prompt, max_new_tokens=40).token_ids
            proposed.clear()
            assert model.generate(prompt, max_new_tokens=40, pipeline=pipeline).token_ids == want
            text = {*plain.tokenizer(prompt).input_ids, *want}
            assert proposed and all(t < 64 or t in special or t in text for t in proposed)
            assert any(t >= 64 and t not in special for t in proposed)  # drafted from the text
    stats = model.generate(PROMPTS[1], max_new_tokens=40, pipeline="sync").stats
    assert stats.mean_acceptance_length > 1.0  # its own choices, wherever they were draftable


def test_the_embedding_table_stands_in_for_the_lm_head_only_where_they_agree(tmp_path: Path) -> None:
    from dflash2.drafters.vocabulary import embedding_head
    from dflash2.runtime.loader import load_decoder
    from dflash2.testing import save_random

    tied = load_decoder(
        save_random(tmp_path / "tied", seed=1, tie_word_embeddings=True), torch.float32, torch.device("cpu")
    )
    assert embedding_head(tied) is tied.embed_tokens.weight
    untied = load_decoder(save_random(tmp_path / "untied", seed=1), torch.float32, torch.device("cpu"))
    assert embedding_head(untied) is None  # two unrelated random tables
    with torch.no_grad():  # a tied head stored twice, quantized apart: near copies
        untied.lm_head.weight.copy_(untied.embed_tokens.weight * (1 + 0.05 * torch.randn_like(untied.lm_head.weight)))
    assert embedding_head(untied) is untied.embed_tokens.weight


def test_random_drafter_accepts_almost_nothing(paths: dict[str, Path]) -> None:
    model = dflash2.load(paths["target"], drafter=paths["random"])
    stats = model.generate(PROMPTS[1], max_new_tokens=40).stats
    assert stats.mean_acceptance_length < 1.3
    assert stats.steps >= 30


@dataclass
class ScriptedDrafter:
    """Proposes the true continuation but corrupts it so step i keeps exactly script[i] tokens."""

    truth: list[int]
    script: list[int]
    block_size: int = 6
    name: str = "scripted"
    capture_layers: tuple[int, ...] = ()
    sessions: list[Any] = field(default_factory=list)

    def start(self, context: DraftContext) -> Any:
        session = ScriptedSession(self)
        self.sessions.append(session)
        return session


class ScriptedSession:
    def __init__(self, drafter: ScriptedDrafter) -> None:
        self.d = drafter
        self.position = 1  # the prefill produced truth[0]
        self.step = 0
        self.observed: list[Outcome] = []

    def propose(self, max_tokens: int) -> Draft:
        k = min(self.d.block_size - 1, max_tokens)
        keep = self.d.script[self.step % len(self.d.script)]
        tokens = list(self.d.truth[self.position : self.position + k])
        if keep < len(tokens):
            tokens[keep] = (tokens[keep] + 1) % 256
        return Draft(torch.tensor(tokens, dtype=torch.long))

    def observe(self, outcome: Outcome) -> None:
        self.observed.append(outcome)
        self.position += outcome.accepted + 1
        self.step += 1

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_scripted_acceptance_lengths(paths: dict[str, Path], references: dict[str, list[int]], pipeline: str) -> None:
    truth = references[PROMPTS[0]]
    script = [3, 0, 5, 2, 1, 4]
    drafter = ScriptedDrafter(truth, script)
    model = full_blocks(dflash2.load(paths["target"], drafter=drafter))
    completion = model.generate(PROMPTS[0], max_new_tokens=27, pipeline=pipeline)
    assert list(completion.token_ids) == truth[:27]
    assert completion.stats.acceptance_lengths[:6] == tuple(a + 1 for a in script)
    session = drafter.sessions[-1]
    assert [o.accepted for o in session.observed[:6]] == script
    assert session.closed


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_max_new_tokens_inside_an_accepted_block(
    paths: dict[str, Path], references: dict[str, list[int]], pipeline: str
) -> None:
    truth = references[PROMPTS[0]]
    model = full_blocks(dflash2.load(paths["target"], drafter=ScriptedDrafter(truth, [5])))
    for n in (2, 4, 7, 9):
        completion = model.generate(PROMPTS[0], max_new_tokens=n, pipeline=pipeline)
        assert list(completion.token_ids) == truth[:n]
        assert completion.finish_reason == "length"


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_eos_inside_an_accepted_block(paths: dict[str, Path], references: dict[str, list[int]], pipeline: str) -> None:
    truth = references[PROMPTS[0]]
    model = full_blocks(dflash2.load(paths["target"], drafter=ScriptedDrafter(truth, [5])))
    eos = truth[8]  # lands in the middle of the second block (tokens 6..11)
    model.eos_token_ids = frozenset({eos})
    completion = model.generate(PROMPTS[0], max_new_tokens=40, pipeline=pipeline)
    assert completion.finish_reason == "stop"
    assert list(completion.token_ids) == truth[: truth.index(eos) + 1]


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_stop_string_inside_an_accepted_block(paths: dict[str, Path], pipeline: str) -> None:
    plain = dflash2.load(paths["target"])
    free = plain.generate(PROMPTS[2], max_new_tokens=40)
    stop = free.text[9:11]
    truth = list(free.token_ids)
    model = full_blocks(dflash2.load(paths["target"], drafter=ScriptedDrafter(truth, [5])))
    completion = model.generate(PROMPTS[2], max_new_tokens=40, stop=[stop], pipeline=pipeline)
    assert completion.text == free.text[: free.text.index(stop)]
    assert completion.finish_reason == "stop"
    assert max(completion.stats.acceptance_lengths) == 6


def test_second_request_equals_the_first(paths: dict[str, Path]) -> None:
    for name in DRAFTERS:
        model = dflash2.load(paths["target"], drafter=drafter_arg(name, paths))
        first = model.generate(PROMPTS[0], max_new_tokens=30)
        model.generate(PROMPTS[2], max_new_tokens=17)
        assert model.generate(PROMPTS[0], max_new_tokens=30).token_ids == first.token_ids, name


def test_ngram_drafter_on_other_families(paths: dict[str, Path]) -> None:
    plain = dflash2.load(paths["qwen3"]).generate(PROMPTS[0], max_new_tokens=40)
    spec = dflash2.load(paths["qwen3"], drafter="ngram").generate(PROMPTS[0], max_new_tokens=40)
    assert spec.token_ids == plain.token_ids


# ---------------------------------------------------------------- n-gram lookup
def _context(prompt: list[int], first: int) -> DraftContext:
    from dflash2.config import SamplingConfig

    return DraftContext(prompt, first, None, SamplingConfig(), None, 100)


def test_ngram_proposes_the_continuation_of_the_latest_match() -> None:
    session = NGramDrafter(block_size=5, max_ngram=2).start(_context([1, 2, 3, 4, 9, 1, 2, 7, 7, 1], 2))
    # suffix (1, 2) occurred at 0 and 5; the latest earlier one continues with 7, 7, 1, 2
    assert session.propose(10).tokens.tolist() == [7, 7, 1, 2]
    assert session.propose(2).tokens.tolist() == [7, 7]


def test_ngram_without_a_match_proposes_nothing() -> None:
    session = NGramDrafter().start(_context([1, 2, 3], 4))
    assert len(session.propose(8)) == 0


def test_ngram_block_adapts_to_the_hit_rate() -> None:
    drafter = NGramDrafter(block_size=9, max_ngram=1)
    session = drafter.start(_context([5, 6, 5, 6, 5, 6, 5, 6, 5, 6, 5, 6, 5], 6))
    assert len(session.propose(20)) == 8
    session.observe(Outcome(accepted=0, next_token=1))
    assert len(session.propose(20)) <= 4  # halved after a miss


def test_hybrid_drafts_from_the_lookup_when_the_text_repeats(paths: dict[str, Path]) -> None:
    model = dflash2.load(paths["target"], drafter=["ngram", paths["dflash2"]])
    drafter = model.drafter
    assert isinstance(drafter, HybridDrafter) and drafter.capture_layers == (0, 1)
    tokens = [5, 6, 7, 8, 9, 5, 6, 7]  # then 8: "6 7 8" repeats, so the lookup continues with 9, 5, 6
    features = torch.zeros(len(tokens), 2 * 64)
    context = DraftContext(tokens, 8, features, dflash2.config.SamplingConfig(), None, 64)
    with torch.inference_mode():
        session = drafter.start(context)
        assert session.propose(3).tokens.tolist() == [9, 5, 6]
        session.observe(Outcome(1, 42, (9,), features[:2]))  # 42 was never seen: the model drafts
        assert len(session.propose(3)) == 3 and session.can_predraft()
    with pytest.raises(dflash2.DrafterError, match="lookup first"):
        dflash2.load(paths["target"], drafter=["ngram", "ngram"])


def test_ngram_options_are_validated() -> None:
    with pytest.raises(dflash2.InvalidOptionError, match="max_ngram"):
        NGramDrafter(min_ngram=3, max_ngram=2)
    with pytest.raises(dflash2.InvalidOptionError, match="block_size"):
        NGramDrafter(block_size=1)


# ---------------------------------------------------------------- DFlash specifics
@pytest.mark.parametrize("version", [1, 2])
def test_dflash_checkpoint_loads_and_drafts(paths: dict[str, Path], version: int) -> None:
    model = dflash2.load(paths["target"], drafter=paths[f"dflash{version}"])
    drafter = model.drafter
    assert drafter is not None and drafter.block_size == 8 and drafter.capture_layers == (0, 1)
    stats = model.generate(PROMPTS[1], max_new_tokens=20).stats
    assert stats.draft_s > 0 and stats.steps > 0


def test_grouped_dynamic_convolution_matches_its_definition() -> None:
    g = torch.Generator().manual_seed(0)
    b, t, d, k, group = 2, 5, 8, 3, 4
    x = torch.randn(b, t, d, generator=g)
    dynamic = torch.randn(b, t, k, d // group, generator=g)
    base = torch.randn(k, d, generator=g)
    expected = torch.zeros(b, t, d)
    for pos in range(t):
        for offset in range(k):
            if pos - offset < 0:
                continue
            per_channel = base[offset] + dynamic[:, pos, offset].repeat_interleave(group, dim=-1)
            expected[:, pos] += per_channel * x[:, pos - offset]
    got = grouped_dynamic_convolve(x, dynamic, base, group)
    assert torch.allclose(got, expected, atol=1e-5)


def test_dflash_drafter_that_does_not_fit_the_target(paths: dict[str, Path], tmp_path: Path) -> None:
    bad = shutil.copytree(paths["dflash1"], tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 7]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(dflash2.DrafterError, match="target_layer_ids"):
        dflash2.load(paths["target"], drafter=bad)


def test_dflash_mask_token_must_exist(paths: dict[str, Path], tmp_path: Path) -> None:
    bad = shutil.copytree(paths["dflash1"], tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = 10_000
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(dflash2.DrafterError, match="mask_token_id"):
        dflash2.load(paths["target"], drafter=bad)
    assert PAD < 260


# ---------------------------------------------------------------- drafter errors
def test_drafter_with_another_tokenizer(paths: dict[str, Path], tmp_path: Path) -> None:
    other = shutil.copytree(paths["random"], tmp_path / "other")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["zz"], vocab["a"] = vocab.pop("a"), 10_000
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(dflash2.TokenizerMismatchError, match="tokenizer"):
        dflash2.load(paths["target"], drafter=other)


def test_bad_drafter_arguments(paths: dict[str, Path]) -> None:
    with pytest.raises(dflash2.DrafterError, match="drafter must be"):
        dflash2.load(paths["target"], drafter=3.5)
    with pytest.raises(dflash2.ModelNotFoundError):
        dflash2.load(paths["target"], drafter="./no/such/drafter")
    with pytest.raises(dflash2.InvalidOptionError, match="block_size"):
        dflash2.load(paths["target"], drafter="ngram", block_size=1)
    assert EOS != PAD
