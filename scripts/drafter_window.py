"""What a model drafter's window over a long new prompt buys: decoding time after the first token.

Six long prompts (about ``--tokens`` tokens of text each: Python standard-library source to
explain, test or annotate, and software licenses to summarize), each asked with a chat template.
The target's prefill comes from the prefix cache for every run after the first (so every
configuration decodes from the same state), while the drafter never resumes: it meets each prompt
as new, catching up on all of it (``window=None``) or on its window. Plain decoding runs first;
every configuration's tokens must equal its. Example::

    python scripts/drafter_window.py --drafter ar --windows none,128,256,512 --out bench/results/window.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
import textwrap
import time
from pathlib import Path
from typing import Any

import dflash2
from dflash2.bench.harness import machine_info
from dflash2.demo_model import qwen_coder_pair
from dflash2.drafters.autoregressive import AutoregressiveDrafter, AutoregressiveSession

LICENSES = Path("/usr/share/common-licenses")


def prompts(tokenizer: Any, tokens: int) -> list[str]:
    def part(text: str, start: int) -> str:
        return str(tokenizer.decode(tokenizer(text).input_ids[start : start + tokens]))

    return [
        "Here is some code:\n" + part(inspect.getsource(argparse), 9000) + "\nExplain what it does, step by step.",
        "Write unit tests for this module:\n" + part(inspect.getsource(shutil), 3000),
        "Add type hints and docstrings to this code:\n" + part(inspect.getsource(textwrap), 500),
        "Summarize the obligations this license puts on someone who distributes the program:\n"
        + part((LICENSES / "GPL-3").read_text(), 4000),
        "Here is a document:\n"
        + part((LICENSES / "Apache-2.0").read_text(), 200)
        + "\nWhat does section 4 require? Answer in a short list.",
        "Read this and list every defined term with a one-line definition:\n"
        + part((LICENSES / "MPL-2.0").read_text(), 0),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", choices=["ar", "hybrid"], default="ar", help="the 0.5B, or n-gram + 0.5B")
    parser.add_argument("--windows", default="none,128,256,512", help="comma-separated; 'none' reads the whole prompt")
    parser.add_argument("--tokens", type=int, default=1000, help="tokens of text in each prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    windows = [None if w == "none" else int(w) for w in args.windows.split(",")]
    AutoregressiveSession._resume = lambda self, state: None  # type: ignore[method-assign]  # every prompt is new
    target, small = qwen_coder_pair()
    plain = dflash2.load(target)
    spec = plain.with_drafter(["ngram", small] if args.drafter == "hybrid" else small)
    model_drafter = spec.drafter.model if args.drafter == "hybrid" else spec.drafter  # type: ignore[union-attr]
    assert isinstance(model_drafter, AutoregressiveDrafter)
    rows = []
    for i, text in enumerate(prompts(plain.tokenizer, args.tokens)):
        prompt = [{"role": "user", "content": text}]
        plain.generate(prompt, max_new_tokens=1)  # the target's prefill, kept for every run below
        row: dict[str, Any] = {"prompt": i}
        reference = None
        for window in ["plain", *windows]:
            if window != "plain":
                model_drafter.window = window  # type: ignore[assignment]
            start = time.perf_counter()
            out = (plain if window == "plain" else spec).generate(prompt, max_new_tokens=args.max_new_tokens)
            seconds = time.perf_counter() - start
            reference = out.token_ids if reference is None else reference
            row[str(window)] = {
                "decode_s": round(seconds - out.stats.time_to_first_token_s, 2),
                "new": len(out.token_ids),
                "tokens_per_forward": round(out.stats.mean_acceptance_length, 2),
                "draft_s": round(out.stats.draft_s, 2),
                "identical": out.token_ids == reference,
            }
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {"machine": machine_info(), "settings": vars(args) | {"out": str(args.out)}, "prompts": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
