"""The ``dflash2`` command: ``demo``, ``generate`` and ``bench``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import anyio

from dflash2.api import Model, load
from dflash2.errors import DFlash2Error
from dflash2.stream import Completion

DEMO_QUESTION = "Write a Python function that returns the n-th Fibonacci number, with a short explanation."


async def _print_stream(model: Model, prompt: Any, **options: Any) -> Completion:
    async with model.stream(prompt, **options) as stream:
        async for token in stream:
            print(token.text, end="", flush=True)
    print()
    return stream.completion


def _summary(label: str, completion: Completion) -> str:
    s = completion.stats
    return (
        f"[{label}] {s.new_tokens} tokens in {s.time_to_first_token_s + s.decode_s:.2f} s: "
        f"{s.tokens_per_second:.1f} tokens/s, {s.mean_acceptance_length:.2f} tokens per target forward, "
        f"finish={completion.finish_reason}"
    )


def cmd_demo(args: argparse.Namespace) -> None:
    from dflash2.demo_model import smollm2_gguf

    print(f"Loading SmolLM2-135M-Instruct from {smollm2_gguf().name} (converted once, then cached) ...")
    model = load(smollm2_gguf(), device=args.device)
    messages = [{"role": "user", "content": args.question}]
    print(f"\n>>> {args.question}\n")
    completion = anyio.run(lambda: _print_stream(model, messages, max_new_tokens=args.max_new_tokens))
    print("\n" + _summary("dflash2", completion))


def cmd_generate(args: argparse.Namespace) -> None:
    model = load(args.model, device=args.device, dtype=args.dtype)
    prompt: Any = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    options = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop or (),
    }
    completion = anyio.run(lambda: _print_stream(model, prompt, **options))
    print(_summary("dflash2", completion), file=sys.stderr)


def cmd_bench(args: argparse.Namespace) -> None:
    from dflash2.bench.run import main as bench_main

    bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash2", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="stream an answer from the offline SmolLM2-135M-Instruct")
    demo.add_argument("--question", default=DEMO_QUESTION)
    demo.add_argument("--max-new-tokens", type=int, default=128)
    demo.add_argument("--device", default="auto")
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="stream a completion from any supported model")
    gen.add_argument("model", help="hub id, local directory or .gguf file")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--dtype", default="auto")
    gen.set_defaults(func=cmd_generate)

    from dflash2.bench.run import add_arguments

    bench = sub.add_parser("bench", help="benchmark dflash2 against its peers (writes docs/benchmarks.md)")
    add_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except DFlash2Error as err:
        print(f"dflash2: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
