"""The GPU check: eager vs CUDA graphs, sync vs async, on random-weight models of realistic shape.

Nothing is downloaded: the models are random (``dflash2.testing``), so only timing and
exactness mean anything. Acceptance is fixed by the drafter: the target drafting for itself
accepts every token (the case with the most drafting to hide), a random DFlash drafter almost
none (its drafting cost is what overlap can hide), the n-gram drafter whatever the random text
repeats. One command, well inside the device's time limit, where CUDA is::

    PYTHONPATH=src python scripts/gpu/check.py --out "$OUT"

It runs the CUDA-only tests (``tests/test_cuda_graphs.py``), checks fp32 greedy exactness of
every drafter, eager and with graphs, against transformers on the device, measures 1, 2, 4 and 8
concurrent plain streams on the first shape (the batched path, eager and as packed graphs), then times each shape
in bf16: transformers ``generate``, dflash2 eager (``graphs="off"``) and with CUDA graphs, each
drafter sync and async; the first request after loading is timed apart (cold start). The JSON
is rewritten after every row, so a run cut short still reports what it measured. On a CPU it runs
the tiny shape with ``graphs="static"`` (what the tests do). ``--plot JSON`` draws the PNG from a
report (the device image may lack matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from dflash2.api import load
from dflash2.bench.concurrency import dflash2_level
from dflash2.bench.data import Prompt
from dflash2.bench.harness import Row, aggregate, machine_info
from dflash2.bench.runners import DFlash2Runner, RunResult, TransformersRunner
from dflash2.engine.draft_length import DraftLengthPolicy
from dflash2.engine.policy import OverlapPolicy
from dflash2.testing import PAD, save_random, save_random_dflash

# arch, then (hidden, intermediate, layers, heads, kv heads, head dim, vocab, tied embeddings)
SHAPES: dict[str, tuple[str, tuple[int, int, int, int, int, int, int, bool]]] = {
    "tinyllama-1.1b": ("llama", (2048, 5632, 22, 32, 4, 64, 32000, False)),
    "qwen3-0.6b": ("qwen3", (1024, 3072, 28, 16, 8, 128, 151936, True)),
    "tiny": ("llama", (64, 128, 2, 4, 2, 16, 260, False)),
}
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Speculative decoding drafts several tokens and verifies them in one forward pass. ",
]
DRAFTERS = ("ngram", "self", "dflash")
BUDGET_S = 420.0  # stop starting new rows after this long (the device allows 10 minutes a command)


def _target(directory: Path, shape: str, device: str, dtype: torch.dtype) -> Path:
    arch, (hidden, inter, layers, heads, kv, head_dim, vocab, tied) = SHAPES[shape]
    extra: dict[str, Any] = {"head_dim": head_dim} if arch == "qwen3" else {}
    return save_random(
        directory, arch, seed=0, std=0.02 if shape != "tiny" else 0.3, device=device, dtype=dtype,
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=4096, **extra,
    )  # fmt: skip


def _dflash(directory: Path, shape: str) -> Path:
    _, (hidden, inter, layers, heads, kv, head_dim, vocab, _) = SHAPES[shape]
    ids = (1, layers // 2, layers - 3) if layers > 3 else (0, 1)
    return save_random_dflash(
        directory, target_layers=layers, target_layer_ids=ids, block_size=8, std=0.02, vocab=vocab,
        mask_token_id=PAD, shape=(hidden, inter, heads, kv, head_dim, 1),
    )  # fmt: skip


def cuda_tests(root: Path) -> dict[str, Any]:
    """Run ``tests/test_cuda_graphs.py`` (where the repository's tests are) and keep its summary."""
    test_file = root / "tests" / "test_cuda_graphs.py"
    if not test_file.is_file():
        return {"skipped": f"{test_file} not found"}
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
        capture_output=True, text=True, cwd=root, env=env, check=False, timeout=240,
    )  # fmt: skip
    tail = (done.stdout + done.stderr).strip().splitlines()[-25:]
    return {"returncode": done.returncode, "seconds": round(time.perf_counter() - start, 1), "tail": tail}


def exactness(work: Path, device: str, modes: tuple[str, ...]) -> dict[str, str]:
    """fp32 greedy on this device: plain and each drafter, each graph mode, sync and async, vs transformers."""
    path = save_random(work / "exact", "llama", seed=3, std=0.3, max_position_embeddings=512)
    reference: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = reference.to(device).eval()
    drafters = {"plain": None, "ngram": "ngram", "self": path, "dflash": save_random_dflash(work / "exact-dflash")}
    expected: list[list[int]] = []
    results = {}
    for mode in modes:
        model = load(path, device=device, dtype="float32", graphs=mode, prefix_cache=0)  # type: ignore[arg-type]
        if not expected:
            with torch.inference_mode():
                for prompt in PROMPTS:
                    x = torch.tensor([model.tokenizer(prompt).input_ids], device=device)
                    out = reference.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False)
                    expected.append([int(t) for t in out[0, x.shape[1] :]])
        for name, drafter in drafters.items():
            drafted = model.with_drafter(drafter)
            drafted.policy = OverlapPolicy(schedule="overlap")
            drafted.lengths = DraftLengthPolicy(mode="fixed")  # every step a whole block: the most to check
            for pipeline in ("sync", "async"):
                same = sum(
                    list(drafted.generate(p, max_new_tokens=64, pipeline=pipeline).token_ids) == e
                    for p, e in zip(PROMPTS, expected, strict=True)
                )
                results[f"{name}-{pipeline}-{mode}"] = f"{same}/{len(PROMPTS)}"
    return results


class _Timer:
    """Rows of one shape, each a runner's timed pass after its cold first request and one warm pass."""

    def __init__(self, shape: str, max_new_tokens: int, deadline: float, save: Callable[[], None]) -> None:
        self.shape, self.max_new_tokens, self.deadline, self.save = shape, max_new_tokens, deadline, save
        self.rows: list[Row] = []
        self.cold: dict[str, dict[str, float]] = {}
        self.reference: list[list[int]] | None = None
        self.skipped: list[str] = []

    def __call__(self, runner: Any, ids: list[list[int]], load_s: float = 0.0) -> None:
        if time.perf_counter() > self.deadline:
            self.skipped.append(runner.name)
            return

        def one_pass() -> list[RunResult]:
            return [runner.run(p, i, self.max_new_tokens) for p, i in zip(PROMPTS, ids, strict=True)]

        first = runner.run(PROMPTS[0], ids[0], self.max_new_tokens)
        one_pass()
        results = one_pass()
        steady = results[0].seconds
        self.cold[runner.name] = {
            "load_s": round(load_s, 3),
            "first_request_s": round(first.seconds, 4),
            "steady_request_s": round(steady, 4),
            "first_over_steady": round(first.seconds / steady, 3) if steady else 0.0,
        }
        if self.reference is None:
            self.reference = [r.token_ids for r in results]
        checked = [(r, r.token_ids == e) for r, e in zip(results, self.reference, strict=True)]
        row = aggregate(runner, self.shape, checked)
        self.rows.append(row)
        steps = len(row.acceptance_lengths) or row.new_tokens
        print(
            f"{self.shape:>15} {row.config:>24}: {row.tokens_per_second:8.1f} tok/s  "
            f"{1000 * row.seconds / steps:6.2f} ms/step  tau {row.mean_acceptance_length or 1:.2f}  "
            f"overlap {row.overlap or 0:.0%}  bubble {row.bubble or 0:.0%}  first/steady "
            f"{self.cold[runner.name]['first_over_steady']:.2f}  identical {row.identical}/{row.prompts}",
            flush=True,
        )
        self.save()


def timing(work: Path, shape: str, device: str, dtype: torch.dtype, timer: _Timer, modes: tuple[str, ...]) -> None:
    """transformers, then dflash2 plain and each drafter: eager sync only, graphs sync and async.

    "identical" compares with transformers in the same dtype (the first row)."""
    target = _target(work / f"{shape}-target", shape, device, dtype)
    dflash = _dflash(work / f"{shape}-dflash", shape)
    hf: Any = AutoModelForCausalLM.from_pretrained(target, dtype=dtype)
    hf = hf.to(device).eval()
    for mode in modes:
        started = time.perf_counter()
        model = load(target, device=device, dtype=dtype, graphs=mode, prefix_cache=0)  # type: ignore[arg-type]
        loaded = time.perf_counter() - started
        ids = [model.tokenizer(p).input_ids for p in PROMPTS]
        if hf is not None:
            timer(TransformersRunner(hf, model.workers.verify), ids)
            hf = None
        timer(DFlash2Runner(model, f"plain-{mode}", pipeline="sync"), ids, loaded)
        if mode != "off":
            timer(DFlash2Runner(model, f"plain-{mode}-async", pipeline="async"), ids)
        for name in DRAFTERS:
            started = time.perf_counter()
            # the target drafts for itself in its own precision: every draft right
            choice = {"ngram": "ngram", "self": target, "dflash": dflash}[name]
            drafted = model.with_drafter(choice, drafter_weights="same")
            loaded = time.perf_counter() - started
            if name == "self":  # whole blocks: the case with the most drafting to hide (the policy would not draft)
                drafted.lengths = DraftLengthPolicy(mode="fixed")
            timer(DFlash2Runner(drafted, f"{name}-sync-{mode}", pipeline="sync"), ids, loaded)
            if mode != "off":
                timer(DFlash2Runner(drafted, f"{name}-async-{mode}", pipeline="async"), ids)


def concurrency(
    work: Path, shape: str, device: str, dtype: torch.dtype, max_new_tokens: int, modes: tuple[str, ...]
) -> list[dict[str, Any]]:
    """Aggregate tokens/s of 1, 2, 4 and 8 concurrent plain streams, eager (one packed forward per
    step) and in each static mode (one packed static step: a CUDA graph per batch bucket on CUDA);
    "identical" compares with the eager model's streams alone."""
    target = _target(work / f"{shape}-target", shape, device, dtype)
    prompts = [Prompt("gpu", str(i), PROMPTS[i % len(PROMPTS)]) for i in range(8)]
    references: dict[str, tuple[int, ...]] = {}
    levels = []
    for mode in modes:
        model = load(target, device=device, dtype=dtype, graphs=mode, prefix_cache=0)  # type: ignore[arg-type]
        if not references:
            references = {p.id: model.generate(p.prompt, max_new_tokens=max_new_tokens).token_ids for p in prompts}
        for streams in (1, 2, 4, 8):
            level = dflash2_level(
                model, f"plain-{mode}", prompts, streams, max_new_tokens, references, {"pipeline": "sync"}
            )
            levels.append({**asdict(level), "tokens_per_second": level.tokens_per_second})
            print(f"{shape:>15} {mode:>6} {streams} streams: {level.tokens_per_second:8.1f} tok/s  identical "
                  f"{level.identical}/{level.prompts}", flush=True)  # fmt: skip
    return levels


def plot(report: dict[str, Any], path: Path) -> Path:
    """tokens/s of every row, one group of bars per shape."""
    from dflash2.bench.report import plot_tokens_per_second

    rows = [Row(**r) for r in report["timing"]]
    return plot_tokens_per_second(rows, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="eager vs CUDA graphs, sync vs async; exactness in fp32")
    parser.add_argument("--out", type=Path, help="directory for gpu-check.json (and gpu-check.png)")
    parser.add_argument("--shapes", default=None, help="comma-separated; default: the two real shapes on CUDA")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds after which no new row starts")
    parser.add_argument("--no-tests", action="store_true", help="skip tests/test_cuda_graphs.py")
    parser.add_argument("--plot", type=Path, help="only draw the PNG of this report (beside it)")
    args = parser.parse_args(argv)
    if args.plot is not None:
        drawn: dict[str, Any] = json.loads(args.plot.read_text())
        print(plot(drawn, args.plot.with_suffix(".png")))
        return drawn
    if args.out is None:
        parser.error("--out is required")
    begun = time.perf_counter()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    modes = ("off", "cuda") if cuda else ("off", "static")
    shapes = args.shapes.split(",") if args.shapes else (["tinyllama-1.1b", "qwen3-0.6b"] if cuda else ["tiny"])
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"machine": machine_info(), "dtype": str(dtype), "shapes": shapes, "modes": list(modes)}
    timers: list[_Timer] = []

    def save() -> None:
        report["timing"] = [asdict(r) for t in timers for r in t.rows]
        report["cold_start"] = {t.shape: t.cold for t in timers}
        report["skipped"] = {t.shape: t.skipped for t in timers if t.skipped}
        report["seconds"] = round(time.perf_counter() - begun, 1)
        (args.out / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")

    if cuda and not args.no_tests:
        report["cuda_tests"] = cuda_tests(Path(__file__).resolve().parents[2])
        print("cuda tests:", report["cuda_tests"].get("tail", [""])[-1:], flush=True)
        save()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        report["exactness_fp32"] = exactness(work, device, modes)
        print("exactness (fp32):", report["exactness_fp32"], flush=True)
        save()
        report["concurrency"] = concurrency(work, shapes[0], device, dtype, args.max_new_tokens, modes)
        save()
        for shape in shapes:
            timers.append(_Timer(shape, args.max_new_tokens, begun + args.budget, save))
            timing(work, shape, device, dtype, timers[-1], modes)
            if cuda:
                torch.cuda.empty_cache()
    save()
    try:
        plot(report, args.out / "gpu-check.png")
    except ImportError:
        print("no matplotlib here: draw the PNG later with --plot", flush=True)
    return report


if __name__ == "__main__":
    main()
