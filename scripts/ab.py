"""Interleaved A/B of two source trees on SmolLM2: does a change cost CPU speed, does it change output?

Each round runs every build once, in turn, each in a fresh process that imports dflash2 from that
build's ``src`` and uses only the public API; drift of the shared machine hits every build alike.
Outputs must be token-identical across builds. Example, against a checkout of an older commit::

    git worktree add /tmp/base <commit>
    python scripts/ab.py --build base=/tmp/base/src --build head=src --out bench/results/ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from dflash2.bench.harness import machine_info

# one build's pass: every configuration over the prompts, greedy; prints one JSON line
WORKER = r"""
import json, sys, time
import dflash2
from dflash2.bench.data import humaneval, mtbench
from dflash2.demo_model import shipped_drafter, smollm2_gguf

configs, limit, max_new = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
prompts = humaneval(limit) + mtbench(limit)
base = dflash2.load(smollm2_gguf(), device="cpu", prefix_cache=0)  # every run prefills its prompt
drafter = str(shipped_drafter())
out = {"dflash2": dflash2.__file__, "configs": {}}
for name, spec in configs.items():
    choice = {"none": None, "ngram": "ngram", "dflash": drafter, "hybrid": ["ngram", drafter]}[spec["drafter"]]
    model = base.with_drafter(choice, block_size=spec.get("block_size"))
    if spec.get("graphs"):
        model = dflash2.load(smollm2_gguf(), drafter=choice, device="cpu", block_size=spec.get("block_size"),
                             prefix_cache=0, graphs=dflash2.GraphConfig(mode=spec["graphs"], context=1024, slots=1))
    model.generate(prompts[0].prompt, max_new_tokens=16)  # warm
    runs = []
    for p in prompts:
        start = time.perf_counter()
        c = model.generate(p.prompt, max_new_tokens=max_new, pipeline=spec.get("pipeline", "async"))
        runs.append({"seconds": time.perf_counter() - start, "ids": list(c.token_ids)})
    out["configs"][name] = runs
print(json.dumps(out))
"""

CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {"drafter": "none"},
    "ngram": {"drafter": "ngram"},
    "dflash-b4": {"drafter": "dflash", "block_size": 4},
    "hybrid-b4": {"drafter": "hybrid", "block_size": 4},
}


def run_build(src: Path, configs: dict[str, dict[str, Any]], limit: int, max_new: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src.resolve()), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(configs), str(limit), str(max_new)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def summarize(passes: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """tokens/s per configuration and build (mean over rounds, and each round), and whether every
    output equals plain decoding's in the same build and the same configuration's in every build."""
    table: dict[str, Any] = {}
    builds = list(passes)
    configs = dict.fromkeys(c for b in builds for c in passes[b][0]["configs"])
    for config in configs:
        row: dict[str, Any] = {}
        outputs = []
        for build in builds:
            rounds = [p["configs"][config] for p in passes[build] if config in p["configs"]]
            if not rounds:
                continue
            rates = [sum(len(r["ids"]) for r in runs) / sum(r["seconds"] for r in runs) for runs in rounds]
            plain = [r["ids"] for r in passes[build][0]["configs"]["plain"]]
            ids = [r["ids"] for r in rounds[0]]
            outputs.append(ids)
            row[build] = {
                "tokens_per_second": round(sum(rates) / len(rates), 2),
                "rounds": [round(x, 2) for x in rates],
                "identical_to_plain": sum(a == b for a, b in zip(ids, plain, strict=True)),
                "prompts": len(ids),
            }
        row["identical_across_builds"] = all(o == outputs[0] for o in outputs)
        table[config] = row
    return table


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="interleaved A/B of source trees on SmolLM2 (CPU)")
    parser.add_argument("--build", action="append", required=True, help="NAME=PATH/TO/src (two or more)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--limit", type=int, default=2, help="prompts per dataset (HumanEval, MT-Bench)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--extra", action="append", default=[], help="NAME=JSON: a configuration, last build only")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    builds = dict(b.split("=", 1) for b in args.build)
    extra = {name: json.loads(spec) for name, spec in (e.split("=", 1) for e in args.extra)}
    last = list(builds)[-1]
    passes: dict[str, list[dict[str, Any]]] = {b: [] for b in builds}
    for round_ in range(args.rounds):
        for build, src in builds.items():
            configs = {**CONFIGS, **(extra if build == last else {})}
            passes[build].append(run_build(Path(src), configs, args.limit, args.max_new_tokens))
            print(f"round {round_ + 1}: {build} done", flush=True)
    report = {
        "machine": machine_info(),
        "builds": builds,
        "settings": {"rounds": args.rounds, "limit": args.limit, "max_new_tokens": args.max_new_tokens},
        "summary": summarize(passes),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary"], indent=2))
    return report


if __name__ == "__main__":
    main()
