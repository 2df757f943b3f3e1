"""The GPU check: sync vs async on a random-weight model of realistic shape, in one short run.

Nothing is downloaded: the models are random (``bench.synthetic``), so only timing and
exactness mean anything. Acceptance is fixed by the drafter: the target drafting for itself
accepts every token (the case with the most drafting to hide), a random DFlash drafter almost
none (its drafting cost is what overlap can hide), the n-gram drafter whatever the random text
repeats. Run it where CUDA is, writing JSON to a directory::

    PYTHONPATH=src python -m dflash2.bench.gpu --out "$OUT"

On a CPU it runs the tiny shape (what the tests do).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from dflash2.api import Model, load
from dflash2.bench.harness import Row, aggregate, machine_info, rows_as_dicts
from dflash2.bench.runners import DFlash2Runner, RunResult
from dflash2.bench.synthetic import PAD, save_random, save_random_dflash
from dflash2.engine.policy import OverlapPolicy, Schedule

# (hidden, intermediate, layers, heads, kv heads, vocab): TinyLlama-1.1B's shape, and a tiny one
SHAPES = {"1b": (2048, 5632, 22, 32, 4, 32000), "tiny": (64, 128, 2, 4, 2, 260)}
WARMUP_PASSES = 2  # untimed passes over PROMPTS before each configuration's timed one
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Speculative decoding drafts several tokens and verifies them in one forward pass. ",
]


def _target(directory: Path, shape: str, device: str, dtype: torch.dtype) -> Path:
    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    return save_random(
        directory, "llama", seed=0, std=0.02 if shape != "tiny" else 0.3, device=device, dtype=dtype,
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=4096,
    )  # fmt: skip


def _dflash(directory: Path, shape: str) -> Path:
    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    ids = (1, layers // 2, layers - 3) if layers > 3 else (0, 1)
    dims = (hidden, inter, heads, kv, hidden // heads, 1)
    return save_random_dflash(
        directory, target_layers=layers, target_layer_ids=ids, block_size=8, std=0.02, vocab=vocab,
        mask_token_id=PAD, shape=dims,
    )  # fmt: skip


def exactness(work: Path, device: str) -> dict[str, str]:
    """fp32 greedy on this device: dflash2 (plain and each drafter, sync and async) against transformers."""
    path = save_random(work / "exact", "llama", seed=3, std=0.3, max_position_embeddings=512)
    reference: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = reference.to(device).eval()
    model = load(path, device=device, dtype="float32")
    prompts = [model.tokenizer(p).input_ids for p in PROMPTS]
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            out = reference.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False)
            expected.append([int(t) for t in out[0, len(ids) :]])
    results = {}
    drafters = {"plain": None, "ngram": "ngram", "self": path, "dflash": save_random_dflash(work / "exact-dflash")}
    for name, drafter in drafters.items():
        drafted = model.with_drafter(drafter)
        drafted.policy = OverlapPolicy(schedule="overlap")
        for pipeline in ("sync", "async"):
            same = sum(
                list(drafted.generate(p, max_new_tokens=64, pipeline=pipeline).token_ids) == e
                for p, e in zip(PROMPTS, expected, strict=True)
            )
            results[f"{name}-{pipeline}"] = f"{same}/{len(PROMPTS)}"
    return results


def _runs(model: Model, config: str, max_new_tokens: int, **options: Any) -> tuple[DFlash2Runner, list[RunResult]]:
    """Every prompt once, timed, after ``WARMUP_PASSES`` untimed passes over all of them.

    On the H200 lent here the first pass of a new drafter or schedule ran 3-9x slower than the
    next (2026-12-04), so a short warm-up made whichever configuration ran first look slow."""
    runner = DFlash2Runner(model, config, **options)
    ids = [model.tokenizer(p).input_ids for p in PROMPTS]

    def one_pass() -> list[RunResult]:
        return [runner.run(p, i, max_new_tokens) for p, i in zip(PROMPTS, ids, strict=True)]

    for _ in range(WARMUP_PASSES):
        warm = one_pass()
        tokens = sum(len(r.token_ids) for r in warm)
        print(f"{config:>20} warm-up: {tokens / sum(r.seconds for r in warm):7.1f} tok/s", flush=True)
    return runner, one_pass()


def timing(work: Path, shape: str, device: str, dtype: torch.dtype, max_new_tokens: int) -> list[Row]:
    """Plain, then each drafter sync and async; "identical" compares with plain in the same dtype."""
    target = _target(work / "target", shape, device, dtype)
    model = load(target, device=device, dtype=dtype)
    drafters: dict[str, Any] = {"ngram": "ngram", "self": target, "dflash": _dflash(work / "dflash", shape)}
    runner, plain = _runs(model, "plain", max_new_tokens)
    reference = [r.token_ids for r in plain]
    rows = [aggregate(runner, "gpu-check", [(r, True) for r in plain])]
    _print(rows[0])

    def timed(drafted: Model, config: str, **options: Any) -> None:
        runner, results = _runs(drafted, config, max_new_tokens, **options)
        checked = [(r, r.token_ids == e) for r, e in zip(results, reference, strict=True)]
        rows.append(aggregate(runner, "gpu-check", checked))
        _print(rows[-1])

    for name, drafter in drafters.items():
        drafted = model.with_drafter(drafter)
        timed(drafted, f"{name}-sync", pipeline="sync")
        schedules: tuple[Schedule, ...] = ("auto", "overlap") if name != "ngram" else ("auto",)
        for schedule in schedules:
            drafted.policy = OverlapPolicy(schedule=schedule)
            timed(drafted, f"{name}-async-{schedule}", pipeline="async")
    return rows


def _print(r: Row) -> None:
    print(
        f"{r.config:>20}: {r.tokens_per_second:7.1f} tok/s  tau {r.mean_acceptance_length or 1:.2f}  "
        f"overlap {r.overlap or 0:.0%}  bubble {r.bubble or 0:.0%}  "
        f"pre-draft hit rate {r.predraft_hit_rate or 0:.0%}  identical to plain {r.identical}/{r.prompts}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="sync vs async on a random-weight model; exactness in fp32")
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu-check.json")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: 1b on CUDA, tiny on CPU")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape = args.shape or ("1b" if cuda else "tiny")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        exact = exactness(work, device)
        rows = timing(work, shape, device, dtype, args.max_new_tokens)
    report: dict[str, Any] = {
        "machine": machine_info(),
        "shape": shape,
        "dtype": str(dtype),
        "exactness_fp32": exact,
        "timing": rows_as_dicts(rows),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    print("exactness (fp32):", exact)
    return report


if __name__ == "__main__":
    main()
