"""How far a target in quantized weights stays from the same model in its loaded precision.

For each mode of ``load(weights=...)``: the greedy continuations of ``--limit`` HumanEval and
``--limit`` MT-Bench prompts beside the loaded precision's (prompts identical, mean common prefix,
share of equal positions), the perplexity of text no prompt holds (standard-library source files,
teacher-forced) beside its, and plain decoding's speed. Example::

    python scripts/weights_agreement.py --model qwen2.5-coder-1.5b --out bench/results/weights-agreement.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

import dflash2
from dflash2.bench.data import humaneval, mtbench
from dflash2.bench.harness import machine_info
from dflash2.demo_model import model_source
from dflash2.tokenize import common_prefix

TEXTS = ("fractions", "textwrap", "shlex")  # standard-library modules whose source is the held-out text


def perplexity(model: dflash2.Model, tokens: int) -> float:
    """exp of the mean next-token loss over the first ``tokens`` tokens of each module's source."""
    losses: list[float] = []
    for name in TEXTS:
        ids = model.tokenizer(inspect.getsource(__import__(name))).input_ids[:tokens]
        with torch.inference_mode():
            logits = model.target(torch.tensor([ids]), model.target.new_cache(len(ids))).logits
        assert logits is not None
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), torch.tensor(ids[1:]), reduction="none")
        losses += loss.tolist()
    return math.exp(sum(losses) / len(losses))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="an offline model's short name or a path")
    parser.add_argument("--modes", default="bf16,int8,int4")
    parser.add_argument("--limit", type=int, default=10, help="prompts of each dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--text-tokens", type=int, default=1024, help="tokens of each held-out text")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    source = model_source(args.model)
    prompts = [p.prompt for p in humaneval(args.limit) + mtbench(args.limit)]
    results: dict[str, Any] = {}
    reference: list[tuple[int, ...]] = []
    for mode in ["same", *args.modes.split(",")]:
        model = dflash2.load(source, weights=mode)
        model.generate("Warm up.", max_new_tokens=8)
        outputs, seconds = [], 0.0
        for prompt in prompts:
            start = time.perf_counter()
            outputs.append(model.generate(prompt, max_new_tokens=args.max_new_tokens).token_ids)
            seconds += time.perf_counter() - start
        reference = reference or outputs
        prefixes = [common_prefix(a, b) for a, b in zip(outputs, reference, strict=True)]
        equal = sum(sum(x == y for x, y in zip(a, b, strict=False)) for a, b in zip(outputs, reference, strict=True))
        results[mode] = {
            "identical": sum(a == b for a, b in zip(outputs, reference, strict=True)),
            "prompts": len(prompts),
            "mean_common_prefix": sum(prefixes) / len(prefixes),
            "equal_positions": equal / sum(len(b) for b in reference),
            "perplexity": perplexity(model, args.text_tokens),
            "tokens_per_second": sum(len(o) for o in outputs) / seconds,
        }
        print(mode, json.dumps(results[mode]), flush=True)
        del model
    record = {"machine": machine_info(), "settings": vars(args) | {"out": str(args.out)}, "modes": results}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
