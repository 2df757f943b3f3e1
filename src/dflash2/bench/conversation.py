"""A multi-turn agent conversation: what the prefix cache saves on each turn.

An agent loop resends its whole history every turn: a system prompt describing its tools, the
user's requests, the tool results it was given, its own earlier answers. ``conversation.json``
holds such a conversation (8 turns, written for this benchmark, not taken from an evaluation
set). Each configuration runs it from the start, answering every turn itself (greedy) and
appending its own answer to the history, as a client does; per turn it records the prompt's
tokens, how many came from the cache, the time to the first token and the turn's whole time;
with the cache also the time of the target's forward over the turn's new tokens alone (the least
a turn's first token can cost). dflash2 with and without its prefix cache must write the same
conversation token for token; llama.cpp's server, with and without its prompt cache
(``cache_prompt``), runs the GGUF's own weights and so its own answers."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash2.api import Model
from dflash2.bench.report import fmt, table
from dflash2.bench.runners import LlamaServerRunner
from dflash2.tokenize import encode_prompt

_DATA = json.loads((Path(__file__).parent / "conversation.json").read_text())
SYSTEM: str = _DATA["system"]  # the agent's tools
TURNS: list[str] = _DATA["turns"]  # the user's requests and the tool results, in order


@dataclass
class Turn:
    config: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    new_tokens: int
    time_to_first_token_s: float
    seconds: float
    text: str
    new_prefill_s: float | None = None  # the target's forward over the uncached prompt tokens alone


def prefill_seconds(model: Model, ids: Sequence[int], cached: int) -> float:
    """Seconds of ``model``'s target forward over ``ids[cached:]`` after the first ``cached`` ids
    (prefilled untimed), on the thread generation computes on."""
    target = model.target

    def forward() -> float:
        with torch.inference_mode():
            cache = target.new_cache(len(ids))
            if cached:
                target(torch.tensor(ids[:cached], device=target.device)[None], cache, logits="none")
            start = time.perf_counter()
            logits = target(torch.tensor(ids[cached:], device=target.device)[None], cache, logits="last").logits
            assert logits is not None
            float(logits[0, -1, 0])  # read back: the time includes the device's
            return time.perf_counter() - start

    return model.workers.verify.call(forward)


def _messages(history: list[dict[str, str]], user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": user}]


def dflash2_conversation(
    model: Model, name: str, max_new_tokens: int, turns: Sequence[str] = TURNS, new_prefill: bool = False
) -> list[Turn]:
    """``model`` answers every turn in turn (greedy), its answers joining the history; with
    ``new_prefill`` each turn also times :func:`prefill_seconds` over its uncached tokens."""
    history: list[dict[str, str]] = []
    out: list[Turn] = []
    for i, user in enumerate(turns, start=1):
        messages = _messages(history, user)
        start = time.perf_counter()
        completion = model.generate(messages, max_new_tokens=max_new_tokens)
        seconds = time.perf_counter() - start
        s = completion.stats
        ids = encode_prompt(model.tokenizer, messages) if new_prefill else None
        alone = prefill_seconds(model, ids, s.cached_tokens) if ids is not None else None
        out.append(Turn(name, i, s.prompt_tokens, s.cached_tokens, s.new_tokens, s.time_to_first_token_s,
                        seconds, completion.text, alone))  # fmt: skip
        history += [{"role": "user", "content": user}, {"role": "assistant", "content": completion.text}]
    return out


def llama_conversation(
    runner: LlamaServerRunner, model: Model, name: str, max_new_tokens: int, cache: bool, turns: Sequence[str] = TURNS
) -> list[Turn]:
    """llama.cpp's server answers every turn (its own weights, so its own answers), its prompt
    cache on or off; the prompt goes as the same chat template's token ids."""
    history: list[dict[str, str]] = []
    out: list[Turn] = []
    for i, user in enumerate(turns, start=1):
        ids = encode_prompt(model.tokenizer, _messages(history, user))
        result, timings = runner.complete(ids, max_new_tokens, cache_prompt=cache)
        text = str(model.tokenizer.decode(result.token_ids, skip_special_tokens=True))
        cached = int(timings.get("cache_n", 0))
        out.append(Turn(name, i, len(ids), cached, len(result.token_ids), result.time_to_first_token_s or 0.0,
                        result.seconds, text))  # fmt: skip
        history += [{"role": "user", "content": user}, {"role": "assistant", "content": text}]
    return out


def conversation_table(turns: Sequence[Turn]) -> str:
    """One row per configuration and turn: the run without its cache beside the run with it
    (configurations named ``X`` and ``X + ...``)."""
    runs: dict[str, dict[bool, dict[int, Turn]]] = {}
    for t in turns:
        base, _, cache = t.config.partition(" + ")
        runs.setdefault(base, {}).setdefault(bool(cache), {})[t.turn] = t
    rows = []
    for base, pair in runs.items():
        cold, warm = pair.get(False, {}), pair.get(True, {})
        for i in sorted(cold.keys() | warm.keys()):
            c, w = cold.get(i), warm.get(i)
            shown = w or c
            assert shown is not None
            alone = fmt(w.new_prefill_s if w else None, ".3f")
            rows.append([base, i, shown.prompt_tokens, w.cached_tokens if w else "–",
                         _pair(c, w, "time_to_first_token_s", 3), alone, _pair(c, w, "seconds", 2)])  # fmt: skip
    columns = ["configuration", ">turn", ">prompt tokens", ">from the cache"]
    columns += [">time to first token, without / with the cache (s)", ">forward over the uncached tokens alone (s)"]
    return table([*columns, ">turn, without / with (s)"], rows)


def _pair(cold: Turn | None, warm: Turn | None, name: str, digits: int) -> str:
    return " / ".join(f"{getattr(t, name):.{digits}f}" if t is not None else "–" for t in (cold, warm))
