"""What the prefix cache costs a request that finds nothing in it: cold requests, store on and off.

Every request is new (a different HumanEval or MT-Bench prompt each time, so the store never
hits), so the only difference between the two models is the work of storing each finished
request's state. The two run interleaved, prompt by prompt, for ``--rounds`` rounds; the figure is
the ratio of their summed times. Outputs must be identical. Example::

    python scripts/cold_requests.py --model smollm2-135m --drafter self-int4 --out bench/results/cold.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import dflash2
from dflash2.bench.data import humaneval, mtbench
from dflash2.bench.harness import machine_info
from dflash2.demo_model import model_source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="an offline model's short name or a path")
    parser.add_argument("--drafter", default=None, help="a drafter as load() takes it; 'self-int4': the target in int4")
    parser.add_argument("--limit", type=int, default=4, help="prompts of each dataset")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    target = model_source(args.model)
    drafter: Any = target if args.drafter == "self-int4" else model_source(args.drafter) if args.drafter else None
    weights = "int4" if args.drafter == "self-int4" else "auto"
    models = {
        "off": dflash2.load(target, drafter=drafter, drafter_weights=weights, prefix_cache=0),
        "on": dflash2.load(target, drafter=drafter, drafter_weights=weights),
    }
    prompts = [p.prompt for p in humaneval(args.limit) + mtbench(args.limit)]
    for model in models.values():  # warm-up, then a store with nothing of these prompts in it
        model.generate("Warm up.", max_new_tokens=8)
        model.prefixes.clear()
    seconds = {name: 0.0 for name in models}
    texts: dict[str, list[str]] = {name: [] for name in models}
    for r in range(args.rounds):
        for prompt in prompts:
            for name, model in models.items() if r % 2 == 0 else reversed(models.items()):
                model.prefixes.clear()  # a round's prompt was stored by the round before
                start = time.perf_counter()
                completion = model.generate(prompt, max_new_tokens=args.max_new_tokens)
                seconds[name] += time.perf_counter() - start
                texts[name].append(completion.text)
    result = {
        "machine": machine_info(),
        "settings": vars(args) | {"out": str(args.out)},
        "seconds": seconds,
        "ratio_on_off": seconds["on"] / seconds["off"],
        "identical": texts["on"] == texts["off"],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
