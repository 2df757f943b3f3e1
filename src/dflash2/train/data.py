"""Self-distilled sequences and their target features, cached on disk so training can resume.

``out/data/responses.jsonl`` holds one generated response per prompt (appended batch by batch);
``out/data/features/NNNNN.safetensors`` holds each sequence's ids, the target features of
``target_layer_ids`` (fp16) and the target's argmax after every position (``greedy``), all
teacher-forced over prompt + response. Finished parts are skipped on the next run; each cached
response carries a hash of its prompt, so a cache is never paired with other prompts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from dflash2.api import Model
from dflash2.config import SamplingConfig
from dflash2.errors import DFlash2Error, InvalidOptionError, OutputDirectoryError
from dflash2.tokenize import encode_prompt
from dflash2.train.corpus import Prompt
from dflash2.train.generate import generate_batch


@dataclass(frozen=True)
class TrainingSequence:
    """One training sequence: ``ids`` [N], the response starts at ``prompt_len``; ``features`` [N, F];
    ``greedy`` [N] the target's argmax after each position (its greedy choice given ``ids[: i + 1]``)."""

    ids: torch.Tensor
    prompt_len: int
    features: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # empty: computed when used
    greedy: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    # on-policy refinement: the anchors where the refined drafter's blocks were rejected
    errors: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))


@contextlib.contextmanager
def writing(what: str, where: Path) -> Iterator[None]:
    """A failed write of ``what`` under ``where`` (a full disk, a read-only folder; safetensors
    reports its own as ``SafetensorError``) as an ``OutputDirectoryError`` saying what to do."""
    try:
        yield
    except (OSError, SafetensorError) as err:
        if isinstance(err, DFlash2Error):
            raise
        raise OutputDirectoryError(
            f"could not write {what} under {where}: {err}. Free space there (or train with --out on a disk "
            "with room) and run the same command again: it resumes from what was written."
        ) from err


def read_records(path: Path, repair: bool = False) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` (none where it is missing). A last line an interrupted write cut
    short is skipped, and with ``repair`` cut off the file, so that appending starts on a new line."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if repair and end < len(data):
        with path.open("r+b") as f:
            f.truncate(end)
    return [json.loads(line) for line in data[:end].decode().splitlines() if line.strip()]


def generate_responses(
    model: Model,
    prompts: Sequence[Prompt],
    path: Path,
    max_new_tokens: int,
    max_prompt_tokens: int,
    temperature: float,
    greedy_share: float,
    batch: int,
    seed: int,
    progress: bool = True,
    part: tuple[int, int] = (0, 1),
) -> dict[int, tuple[list[int], list[int]]]:
    """(prompt ids, response ids) by prompt index; cached in ``path`` and resumed from it.

    Greedy answers are the texts greedy decoding meets; sampled ones widen the contexts. Each
    batch is greedy with probability ``greedy_share`` (seeded by its first prompt's index).
    ``part = (rank, world)``: this process answers the prompts ``rank, rank + world, ...`` into
    ``path``; answers already in ``path`` or beside it (``responses*.jsonl``: other processes')
    count as done, so the result holds every prompt answered so far by anyone."""
    encoded = [encode_prompt(model.tokenizer, p)[-max_prompt_tokens:] for p in prompts]
    keys = [prompt_key(e) for e in encoded]
    done: dict[int, list[int]] = {}
    for cached in sorted(path.parent.glob(f"{path.name.split('.')[0]}*{path.suffix}")):
        for record in read_records(cached, repair=cached == path):  # only this process appends to ``path``
            index = int(record["index"])
            if index >= len(encoded):
                continue
            if record.get("prompt", keys[index]) != keys[index]:
                raise InvalidOptionError(
                    f"{cached} holds responses to other prompts (prompt {index} differs); "
                    "train with a new --out, or delete that file to answer these prompts."
                )
            done[index] = [int(t) for t in record["response"]]
    rank, world = part
    todo = sorted((i for i in range(rank, len(encoded), world) if i not in done), key=lambda i: len(encoded[i]))
    mine = len(range(rank, len(encoded), world))
    bar = tqdm(total=mine, initial=mine - len(todo), disable=not progress, desc="self-distil", unit="prompt")
    with writing("the self-distilled responses", path.parent):  # on close too: a full disk fails the last flush
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as sink:
            for start in range(0, len(todo), batch):
                chunk = todo[start : start + batch]
                greedy = random.Random(seed * 1_000_003 + chunk[0]).random() < greedy_share
                sampling = SamplingConfig(temperature=0.0 if greedy else temperature, seed=seed + start)
                responses = generate_batch(
                    model.target, [encoded[i] for i in chunk], max_new_tokens, sampling, model.eos_token_ids
                )
                for i, response in zip(chunk, responses, strict=True):
                    done[i] = response
                    sink.write(json.dumps({"index": i, "prompt": keys[i], "response": response}) + "\n")
                sink.flush()
                bar.update(len(chunk))
    bar.close()
    return {i: (encoded[i], done[i]) for i in sorted(done)}


@torch.inference_mode()
def cache_features(
    model: Model,
    pairs: Mapping[int, tuple[list[int], list[int]]],
    layer_ids: Sequence[int],
    directory: Path,
    progress: bool = True,
) -> list[Path]:
    """Teacher-forced target features of every sequence, one file each (named by its index);
    files that already hold their sequence are kept, others (re)computed."""
    files = []
    with writing("the target's features", directory):  # the unlinks too: a read-only folder refuses them
        directory.mkdir(parents=True, exist_ok=True)
        for index, (prompt, response) in tqdm(pairs.items(), disable=not progress, desc="features", unit="seq"):
            file = directory / f"{index:05d}.safetensors"
            files.append(file)
            if len(response) < 2:  # nothing to learn from; a stale file of another sequence goes
                file.unlink(missing_ok=True)
                continue
            if _holds(file, prompt + response):
                continue
            ids = torch.tensor(prompt + response)
            [seq] = with_features(model, [TrainingSequence(ids, len(prompt))], layer_ids)
            tensors = {"ids": ids, "prompt_len": torch.tensor([len(prompt)]), "greedy": seq.greedy.cpu()}
            save_file({**tensors, "features": seq.features.to(torch.float16).cpu().contiguous()}, str(file))
    return [f for f in files if f.is_file()]


@torch.no_grad()  # not inference mode: the features enter the drafter's autograd graph
def with_features(
    model: Model, sequences: Sequence[TrainingSequence], layer_ids: Sequence[int]
) -> list[TrainingSequence]:
    """``sequences`` with their teacher-forced target features and argmax, in one right-padded
    forward on the target's device (causal attention: the padding changes nothing before it)."""
    width = max(seq.ids.shape[0] for seq in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : seq.ids.shape[0]] = seq.ids
    cache = model.target.new_cache(width, batch=len(sequences))
    out = model.target(ids.to(model.device), cache, logits="all", capture=tuple(layer_ids))
    assert out.hidden is not None and out.logits is not None
    greedy = out.logits.argmax(-1)
    return [
        replace(seq, features=out.hidden[row, : seq.ids.shape[0]], greedy=greedy[row, : seq.ids.shape[0]])
        for row, seq in enumerate(sequences)
    ]


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """A short hash of a prompt's token ids, stored beside its cached response."""
    return hashlib.sha256(json.dumps(list(prompt_ids)).encode()).hexdigest()[:16]


def _holds(file: Path, ids: list[int]) -> bool:
    """Whether ``file`` is a finished feature file of exactly the sequence ``ids`` (not one an
    interrupted write cut short)."""
    if not file.is_file():
        return False
    try:
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
            return "greedy" in names and f.get_tensor("ids").tolist() == ids
    except (SafetensorError, OSError):
        return False


def load_sequences(files: Sequence[Path]) -> list[TrainingSequence]:
    out = []
    for file in files:
        t = load_file(str(file))
        out.append(TrainingSequence(t["ids"], int(t["prompt_len"][0]), t["features"], t["greedy"]))
    return out
