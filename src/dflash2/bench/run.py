"""``dflash2 bench``: build the runners, run the matrix (or the ``--sweep``), write JSON, docs tables and plots."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dflash2.api import Model, load
from dflash2.bench.concurrency import (
    PEER,
    Level,
    dflash2_level,
    levels_as_dicts,
    levels_table,
    plot_levels,
    transformers_level,
)
from dflash2.bench.conversation import (
    TURNS,
    Turn,
    conversation_table,
    dflash2_conversation,
    llama_conversation,
)
from dflash2.bench.curve import (
    CurvePoint,
    acceptance_curve,
    curve_table,
    plot_curve,
)
from dflash2.bench.data import Prompt, load_dataset
from dflash2.bench.harness import Row, host, machine_info, run_matrix
from dflash2.bench.limits import memory_bandwidth_gbps, plain_decoding_limit, weight_bytes
from dflash2.bench.report import (
    markdown_table,
    plot_acceptance_histogram,
    plot_tokens_per_second,
    update_section,
    write_record,
)
from dflash2.bench.runners import DFlash2Runner, LlamaServerRunner, Runner, TransformersRunner
from dflash2.bench.sweep import (
    SWEEPS,
    WEIGHT_BITS,
    Point,
    block_size_table,
    drafted_sweep,
    drafter_weights_table,
    plot_block_size,
    plot_prompt_length,
    prompt_length_sweep,
    prompt_length_table,
)
from dflash2.engine.draft_length import DraftLengthPolicy
from dflash2.engine.policy import OverlapPolicy, Schedule
from dflash2.engine.prefix_cache import PrefixCache
from dflash2.runtime.loader import resolve_checkpoint
from dflash2.runtime.workers import release_thread_pool
from dflash2.tokenize import encode_prompt

PEERS = ("transformers", "transformers-prompt-lookup", "transformers-assisted")
# llama.cpp's server on the GGUF files themselves (--llama-cpp): plain, the --ar-drafter GGUF drafting, n-gram,
# and the --dflash-drafter as llama.cpp's converter wrote it (--llama-cpp-dflash)
LLAMA_CPP = ("llama.cpp", "llama.cpp-speculative", "llama.cpp-ngram", "llama.cpp-dflash")
DRAFTED = ("ngram", "ar", "dflash", "hybrid")  # hybrid: prompt lookup first, the DFlash (or AR) drafter otherwise
PIPELINE_NAMES = ("sync", "async")
# "-fixed": every step drafts as far as the block allows (no draft-length policy), as before it existed;
# "-chain": no side branches (the drafter's alternatives are never verified beside its draft)
VARIANTS: dict[str, Callable[[], DraftLengthPolicy]] = {
    "": DraftLengthPolicy,
    "-fixed": functools.partial(DraftLengthPolicy, mode="fixed"),
    "-chain": functools.partial(DraftLengthPolicy, branches="off"),
}
CONFIGS = (
    *PEERS,
    *LLAMA_CPP,
    "dflash2",
    *(f"dflash2-{d}-{p}{v}" for d in DRAFTED for p in PIPELINE_NAMES for v in VARIANTS),
)
DEFAULT_CONFIGS = ("transformers", "transformers-prompt-lookup", "dflash2", "dflash2-ngram-sync", "dflash2-ngram-async")


def _hf_model(path: Any, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    release_thread_pool()  # every configuration computes on dflash2's verify thread
    return model.eval()


def build_runners(
    model: Model,
    configs: list[str],
    drafters: dict[str, Any],
    block_sizes: dict[str, int | None],
    schedule: Schedule = "auto",
    drafter_weights: str = "auto",
    llama_cpp: Path | None = None,
    gguf: Path | None = None,
) -> list[Runner]:
    """One runner per configuration; drafter-backed ones share the target's weights. ``llama_cpp``:
    the folder of llama.cpp's binaries; its runners read the GGUF files ``gguf`` (the target) and
    ``drafters["ar"]`` (or ``drafters["llama.cpp-dflash"]``)."""
    runners: list[Runner] = []
    hf: Any = None
    with_drafter: dict[str, Model] = {}
    for name in configs:
        if name not in CONFIGS:
            raise SystemExit(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
        if name in LLAMA_CPP:
            drafter = drafters.get("llama.cpp-dflash" if name == "llama.cpp-dflash" else "ar")
            runners.append(_llama_cpp_runner(name, llama_cpp, gguf, drafter))
        elif name.startswith("transformers"):
            hf = hf if hf is not None else _hf_model(model.checkpoint, model.dtype)
            worker = model.workers.verify
            if name == "transformers":
                runners.append(TransformersRunner(hf, worker))
            elif name == "transformers-prompt-lookup":
                runners.append(TransformersRunner(hf, worker, name, prompt_lookup_num_tokens=10))
            else:
                if drafters.get("ar") is None:
                    raise SystemExit("transformers-assisted needs --ar-drafter (a small LM with the same tokenizer)")
                assistant = _hf_model(resolve_checkpoint(drafters["ar"]), model.dtype)
                runners.append(TransformersRunner(hf, worker, name, assistant_model=assistant))
        elif name == "dflash2":
            runners.append(DFlash2Runner(model, name))
        else:
            _, kind, pipeline, *variant = name.split("-")
            if drafters.get(kind) is None:
                raise SystemExit(f"{name} needs --{'dflash-drafter or --ar' if kind == 'hybrid' else kind}-drafter")
            key = "-".join([kind, *variant])
            if key not in with_drafter:
                with_drafter[key] = model.with_drafter(drafters[kind], block_sizes.get(kind), drafter_weights)
                with_drafter[key].policy = OverlapPolicy(schedule=schedule)
                if variant:
                    with_drafter[key].lengths = VARIANTS["-" + variant[0]]()
            runners.append(DFlash2Runner(with_drafter[key], name, pipeline=pipeline))
    for runner in runners:  # transformers runs the full-precision weights, not a quantized target's
        if isinstance(runner, TransformersRunner):
            runner.exact = model.target.weights == "same"
    return runners


def _llama_cpp_runner(name: str, folder: Path | None, target: Path | None, drafter: Any) -> LlamaServerRunner:
    """llama.cpp's server, drafting with its own defaults (a draft model: at most 3 tokens a step)."""
    if folder is None or not (folder / "llama-server").is_file():
        raise SystemExit(f"{name} needs --llama-cpp, the folder holding llama.cpp's llama-server")
    if target is None or target.suffix != ".gguf":
        raise SystemExit(f"{name} runs GGUF files: --model must be a .gguf file or an offline model name")
    extra: list[str] = []
    if name == "llama.cpp-speculative":
        if drafter is None or Path(str(drafter)).suffix != ".gguf":
            raise SystemExit(f"{name} needs --ar-drafter as a .gguf file or an offline model name")
        extra = ["--spec-type", "draft-simple", "-md", str(drafter)]
    elif name == "llama.cpp-ngram":
        extra = ["--spec-type", "ngram-simple"]
    elif name == "llama.cpp-dflash":
        if drafter is None or not Path(drafter).is_file():
            raise SystemExit(f"{name} needs --llama-cpp-dflash, the DFlash drafter as llama.cpp's converter wrote it")
        extra = ["--spec-type", "draft-dflash", "-md", str(drafter)]
    return LlamaServerRunner(folder / "llama-server", target, name, torch.get_num_threads(), extra)


def _model_path(source: str | None) -> Any:
    """A target or drafter argument: an offline model's short name becomes its GGUF file."""
    from dflash2.demo_model import model_source

    return model_source(source) if source is not None else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="target: a hub id, a path, or an offline model's name (default: smollm2-135m)"
    )
    parser.add_argument("--datasets", default="humaneval,mtbench")
    parser.add_argument("--limit", type=int, default=20, help="prompts per dataset (with --sweep: per point)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"any of {', '.join(CONFIGS)}")
    parser.add_argument("--ar-drafter", default=None, help="small causal LM with the target's tokenizer (or a name)")
    parser.add_argument(
        "--drafter-weights", default="auto", help="precision of model drafters: auto, same, bf16, int8, int4"
    )
    parser.add_argument(
        "--weights", default="same", help="the target's weights in dflash2's rows: same, bf16, int8, int4 (matrix only)"
    )
    parser.add_argument("--llama-cpp", type=Path, default=None, help="folder of llama.cpp's binaries (llama-server)")
    parser.add_argument("--dflash-drafter", default=None, help="DFlash / DFlash2 drafter (z-lab format)")
    parser.add_argument(
        "--llama-cpp-dflash", type=Path, default=None,
        help="that drafter as a GGUF by llama.cpp's convert_hf_to_gguf.py --target-model-dir (llama.cpp-dflash)",
    )  # fmt: skip
    parser.add_argument("--ngram-block-size", type=int, default=None)
    parser.add_argument("--ar-block-size", type=int, default=None)
    parser.add_argument("--dflash-block-size", type=int, default=None)
    parser.add_argument(
        "--schedule", default="auto", choices=["auto", "overlap", "serial"], help="async pipeline schedule"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads for every configuration")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--section", default=None, help="docs section to (re)write (default: matrix, or sweep)")
    parser.add_argument("--no-progress", action="store_true")
    sweep = parser.add_argument_group("cost-growth sweep (runs instead of the matrix; --configs is ignored)")
    sweep.add_argument("--sweep", default=None, help=f"comma list of {', '.join(SWEEPS)}")
    sweep.add_argument(
        "--sweep-config", default="dflash2-ngram-sync", help="drafted configuration to sweep (dflash2-KIND-PIPELINE)"
    )
    sweep.add_argument("--prompt-lengths", default="128,256,512,1024,2048", help="prompt tokens per point")
    sweep.add_argument("--block-sizes", default="4,8,12,16", help="block sizes of the --sweep-config drafter")
    sweep.add_argument(
        "--drafter-weights-list", default="same,bf16,int8,int4", help="precisions of the --sweep-config model drafter"
    )
    parser.add_argument(
        "--training-curve", type=Path, default=None, help="a train-drafter run dir: acceptance of each kept checkpoint"
    )
    talk = parser.add_argument_group("multi-turn agent conversation (runs instead of the matrix)")
    talk.add_argument(
        "--conversation", default=None, help="dflash2 configurations to run the 8-turn conversation with, e.g. "
        "dflash2,dflash2-ar-sync: each with and without its prefix cache (and llama.cpp with --llama-cpp)",
    )  # fmt: skip
    talk.add_argument("--prefix-cache", type=int, default=4096, help="prefix cache tokens of the cached runs")
    concurrent = parser.add_argument_group("concurrency sweep (runs instead of the matrix)")
    concurrent.add_argument("--concurrency", default=None, help="numbers of concurrent streams, e.g. 1,2,4,8")
    concurrent.add_argument(
        "--concurrency-configs", default="dflash2,dflash2-hybrid-async", help="dflash2 configurations to run at once"
    )


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(args: argparse.Namespace) -> list[Row]:
    configs = [c.strip() for c in args.configs.split(",")]
    special = args.sweep or args.training_curve or args.concurrency or args.conversation
    # fp32 rows must equal transformers'; a quantized target's, dflash2's plain decoding in its weights
    reference = "transformers" if args.weights == "same" else "dflash2"
    if special and args.weights != "same":
        raise SystemExit("--weights applies to the matrix (rows checked against dflash2's plain decoding)")
    if not special and reference not in configs:
        raise SystemExit(f"every row is checked against {reference} plain greedy: add '{reference}' to --configs")
    if args.threads:
        torch.set_num_threads(args.threads)
    source: Any = _model_path(args.model or "smollm2-135m")
    # every prompt prefilled anew, as in every peer
    model = load(source, device="cpu", weights=args.weights, prefix_cache=0)
    drafters = {"ngram": "ngram", "ar": _model_path(args.ar_drafter), "dflash": args.dflash_drafter}
    drafters["llama.cpp-dflash"] = args.llama_cpp_dflash
    # the hybrid: prompt lookup first, then the DFlash drafter (or else the small LM)
    model_drafter, model_kind = (drafters["dflash"], "dflash") if args.dflash_drafter else (drafters["ar"], "ar")
    drafters["hybrid"] = ["ngram", model_drafter] if model_drafter else None
    block_sizes = {"ngram": args.ngram_block_size, "ar": args.ar_block_size, "dflash": args.dflash_block_size}
    block_sizes["hybrid"] = block_sizes[model_kind]
    if args.sweep:
        return [p.row for p in sweep_main(args, model, source, drafters, block_sizes)]
    if args.concurrency:
        concurrency_main(args, model, source, drafters, block_sizes)
        return []
    if args.conversation:
        conversation_main(args, model, source, drafters, block_sizes)
        return []
    if args.training_curve is not None:
        curve_main(args, model, source)
        return []
    prompts = _prompts(args)
    gguf = Path(str(source)) if str(source).endswith(".gguf") else None
    runners = build_runners(
        model, configs, drafters, block_sizes, args.schedule, args.drafter_weights, args.llama_cpp, gguf
    )
    try:
        rows = run_matrix(
            runners,
            prompts,
            encode=lambda prompt: encode_prompt(model.tokenizer, prompt),
            max_new_tokens=args.max_new_tokens,
            reference=reference,
            progress=not args.no_progress,
        )
    finally:
        for runner in runners:
            if isinstance(runner, LlamaServerRunner):
                runner.close()
    settings = _settings(args, source, model, configs=args.configs, schedule=args.schedule)
    section = args.section or "matrix"
    bars = plot_tokens_per_second(rows, _image(args, f"{section}-tokens-per-second"))
    hist = plot_acceptance_histogram(rows, _image(args, f"{section}-acceptance"))
    parts = [
        markdown_table(rows, reference),
        _limit_sentence(model, settings),
        f"![tokens per second](images/{bars.name})",
    ]
    parts += [f"![acceptance lengths](images/{hist.name})"] if hist is not None else []
    _publish(args, section, source, settings, "rows", rows, parts)
    return rows


def sweep_main(
    args: argparse.Namespace,
    model: Model,
    source: Any,
    drafters: dict[str, Any],
    block_sizes: dict[str, int | None],
) -> list[Point]:
    """``--sweep``: transformers, plain dflash2 and ``--sweep-config`` vs prompt length; that drafter vs block size."""
    sweeps = [s.strip() for s in args.sweep.split(",")]
    if unknown := [s for s in sweeps if s not in SWEEPS]:
        raise SystemExit(f"unknown sweep {', '.join(unknown)}; choose from {', '.join(SWEEPS)}")
    config = args.sweep_config
    if config not in CONFIGS or not config.startswith("dflash2-"):
        raise SystemExit(f"--sweep-config must be a drafted configuration (dflash2-KIND-PIPELINE), not {config!r}")
    _, kind, pipeline = config.split("-")
    reference, plain, drafted = build_runners(
        model, ["transformers", "dflash2", config], drafters, block_sizes, drafter_weights=args.drafter_weights
    )
    assert isinstance(drafted, DFlash2Runner) and drafted.model.drafter is not None
    progress = not args.no_progress
    lengths = _ints(args.prompt_lengths)
    fits = [n for n in lengths if n + args.max_new_tokens <= model.max_context]
    by_length: list[Point] = []
    if "prompt-length" in sweeps and fits:
        texts = [str(p.prompt) for p in load_dataset("humaneval")]
        runners = [reference, plain, drafted]
        by_length = prompt_length_sweep(
            runners, model.tokenizer, texts, fits, args.limit, args.max_new_tokens, progress=progress
        )
    prompts = _prompts(args)
    by_block: list[Point] = []
    if "block-size" in sweeps:
        sizes = _ints(args.block_sizes)
        variants: list[tuple[int, Runner]] = []
        for size in sizes:  # whole blocks of each size: the sweep's question
            sized = model.with_drafter(drafters[kind], size, args.drafter_weights)
            sized.lengths = DraftLengthPolicy(mode="fixed")
            variants.append((size, DFlash2Runner(sized, f"{config}@{size}", pipeline=pipeline)))
        # beside them the draft-length policy, free to draft up to the largest block
        chosen = model.with_drafter(drafters[kind], max(sizes), args.drafter_weights)
        variants.append((max(sizes), DFlash2Runner(chosen, f"{config}@{max(sizes)}-auto", pipeline=pipeline)))
        by_block = drafted_sweep(
            "block-size", reference, variants, model.tokenizer, prompts, args.max_new_tokens, progress
        )
    by_weights: list[Point] = []
    if "drafter-weights" in sweeps:
        formats = [f.strip() for f in args.drafter_weights_list.split(",")]
        weighted: list[tuple[int, Runner]] = []
        for fmt in formats:
            drafter = model.with_drafter(drafters[kind], block_sizes.get(kind), fmt)
            weighted.append((WEIGHT_BITS[fmt], DFlash2Runner(drafter, f"{config}@{fmt}", pipeline=pipeline)))
        by_weights = drafted_sweep(
            "drafter-weights", reference, weighted, model.tokenizer, prompts, args.max_new_tokens, progress
        )

    settings = _settings(
        args, source, model, sweeps=sweeps, sweep_config=config, drafter_block_size=drafted.model.drafter.block_size,
        prompt_lengths=fits, skipped_prompt_lengths=[n for n in lengths if n not in fits],
        max_context=model.max_context, block_sizes=_ints(args.block_sizes),
    )  # fmt: skip
    section = args.section or "sweep"
    parts: list[str] = []
    if "prompt-length" in sweeps:
        parts += [
            "### Speed vs prompt length",
            f"HumanEval prompt text, repeated and cut to each length (raw completion); `{config}` drafts blocks "
            f"of {drafted.model.drafter.block_size}.",
        ]
        if settings["skipped_prompt_lengths"]:
            parts.append(
                f"Skipped {settings['skipped_prompt_lengths']}: prompt plus {args.max_new_tokens} new tokens "
                f"exceeds the model's context of {model.max_context}."
            )
        if by_length:
            limit = settings["plain_decoding_limit_tokens_per_second"]
            plot = plot_prompt_length(by_length, limit, _image(args, f"{section}-prompt-length"))
            parts += [prompt_length_table(by_length), _limit_sentence(model, settings)]
            parts.append(f"![tokens per second vs prompt length](images/{plot.name})")
    if by_block:
        plot = plot_block_size(by_block, _image(args, f"{section}-block-size"))
        parts += [
            "### Block size",
            f"`{config}` drafting whole blocks of each size, and (`-auto`) as far as the draft-length policy "
            f"chooses, on {args.datasets}; speedup is against transformers on the same prompts.",
            block_size_table(by_block),
            f"![tokens per second and acceptance vs block size](images/{plot.name})",
        ]
    if by_weights:
        parts += [
            "### Drafter weights",
            f"`{config}` with its model drafter's weights in each precision (draft lengths chosen by the policy), "
            f"on {args.datasets}.",
            drafter_weights_table(by_weights),
        ]
    points = by_length + by_block + by_weights
    amount = f"{args.limit} prompts per point, {args.max_new_tokens} new tokens"
    _publish(args, section, source, settings, "points", [p.as_dict() for p in points], parts, amount)
    return points


def concurrency_main(
    args: argparse.Namespace, model: Model, source: Any, drafters: dict[str, Any], block_sizes: dict[str, int | None]
) -> list[Level]:
    """``--concurrency``: aggregate and per-stream speed at each number of concurrent streams."""
    configs = [c.strip() for c in args.concurrency_configs.split(",")]
    if bad := [c for c in configs if c not in CONFIGS or not c.startswith("dflash2")]:
        raise SystemExit(f"--concurrency-configs takes dflash2 configurations, not {', '.join(bad)}")
    streams = _ints(args.concurrency)
    runners = build_runners(model, configs, drafters, block_sizes, args.schedule, args.drafter_weights)
    hf = _hf_model(model.checkpoint, model.dtype)
    levels: list[Level] = []
    for dataset in (d.strip() for d in args.datasets.split(",")):
        prompts = load_dataset(dataset, args.limit)
        references = {p.id: model.generate(p.prompt, max_new_tokens=args.max_new_tokens).token_ids for p in prompts}
        for n in streams:
            levels.append(transformers_level(hf, model, prompts, n, args.max_new_tokens, references))
            for runner in runners:
                assert isinstance(runner, DFlash2Runner)
                level = dflash2_level(
                    runner.model, runner.name, prompts, n, args.max_new_tokens, references, runner.options
                )
                levels.append(level)
                if not args.no_progress:
                    print(f"{dataset} {runner.name} x{n}: {level.tokens_per_second:.1f} tok/s", flush=True)
    levels.sort(key=lambda lv: (lv.dataset, lv.config != PEER, lv.config, lv.streams))
    settings = _settings(args, source, None, streams=streams, configs=configs, max_batch=model.batcher.max_batch)
    section = args.section or "concurrency"
    plot = plot_levels(levels, _image(args, section))
    note = ". Identical = the same tokens as the prompt generated alone by dflash2's plain greedy decoding."
    parts = [levels_table(levels), f"![aggregate tokens per second vs concurrent streams](images/{plot.name})"]
    _publish(args, section, source, settings, "levels", levels_as_dicts(levels), parts, note=note)
    return levels


def conversation_main(
    args: argparse.Namespace, model: Model, source: Any, drafters: dict[str, Any], block_sizes: dict[str, int | None]
) -> list[Turn]:
    """``--conversation``: the 8-turn agent conversation, with and without the prefix cache."""
    configs = [c.strip() for c in args.conversation.split(",")]
    runners = build_runners(model, configs, drafters, block_sizes, args.schedule, args.drafter_weights)
    turns: list[Turn] = []
    identical: dict[str, bool] = {}
    for runner in runners:
        assert isinstance(runner, DFlash2Runner)
        cold = runner.model.with_drafter(runner.model.drafter)  # the same drafter object: same state and policy
        cold.lengths, cold.policy = runner.model.lengths, runner.model.policy
        warm = runner.model.with_drafter(runner.model.drafter)
        warm.lengths, warm.policy = runner.model.lengths, runner.model.policy
        warm.prefixes = PrefixCache(args.prefix_cache)
        dflash2_conversation(warm, "warm-up", 8, TURNS[:2])  # kernels and threads, then a fresh cache
        warm.prefixes = PrefixCache(args.prefix_cache)
        with_cache = dflash2_conversation(warm, f"{runner.name} + prefix cache", args.max_new_tokens, new_prefill=True)
        without = dflash2_conversation(cold, runner.name, args.max_new_tokens)
        identical[runner.name] = [t.text for t in with_cache] == [t.text for t in without]
        turns += without + with_cache
        if not args.no_progress:
            print(f"{runner.name}: turn 8 time to first token {without[-1].time_to_first_token_s:.3f} s without "
                  f"the cache, {with_cache[-1].time_to_first_token_s:.3f} s with it", flush=True)  # fmt: skip
    gguf = Path(str(source)) if str(source).endswith(".gguf") else None
    if args.llama_cpp is not None and gguf is not None:
        runner_ = _llama_cpp_runner("llama.cpp", args.llama_cpp, gguf, None)
        try:
            llama_conversation(runner_, model, "warm-up", 8, False, TURNS[:1])
            turns += llama_conversation(runner_, model, "llama.cpp", args.max_new_tokens, cache=False)
            turns += llama_conversation(runner_, model, "llama.cpp + prompt cache", args.max_new_tokens, cache=True)
        finally:
            runner_.close()
    settings = _settings(
        args, source, None, configs=configs, prefix_cache=args.prefix_cache, identical_with_and_without_cache=identical
    )
    same = ", ".join(f"{name}: {'identical' if ok else 'NOT IDENTICAL'}" for name, ok in identical.items())
    note = f". Every turn's text with the prefix cache against without it ({same})."
    amount = f"8 turns, up to {args.max_new_tokens} new tokens each"
    parts = [conversation_table(turns)]
    _publish(args, args.section or "conversation", source, settings, "turns", turns, parts, amount, note)
    return turns


def curve_main(args: argparse.Namespace, model: Model, source: Any) -> list[CurvePoint]:
    """``--training-curve RUN``: tokens per target forward of each kept checkpoint of a training run."""
    prompts = _prompts(args)
    references = {
        i: model.generate(p.prompt, max_new_tokens=args.max_new_tokens).token_ids for i, p in enumerate(prompts)
    }
    section = args.section or "training-curve"
    points = acceptance_curve(model, args.training_curve, prompts, args.max_new_tokens, references)
    plot = plot_curve(points, _image(args, section))
    settings = _settings(args, source, None, run=str(args.training_curve))
    note = (". Greedy; identical = the same tokens as dflash2's plain decoding (itself identical to transformers "
            "in the matrix above).")  # fmt: skip
    parts = [curve_table(points), f"![acceptance vs training](images/{plot.name})"]
    _publish(args, section, source, settings, "points", points, parts, note=note)
    return points


def _settings(args: argparse.Namespace, source: Any, model: Model | None, **more: Any) -> dict[str, Any]:
    """What a record was run with: the model, its prompts and ``more``; with ``model``, the memory
    bandwidth measured now, the weights' bytes and so plain decoding's limit."""
    settings = {"model": str(source), "datasets": args.datasets, "limit": args.limit}
    settings |= {"max_new_tokens": args.max_new_tokens, **more}
    if model is not None:
        bandwidth, weights = memory_bandwidth_gbps(), weight_bytes(model)
        settings |= {"memory_bandwidth_gbps": bandwidth, "weight_bytes": weights}
        settings["plain_decoding_limit_tokens_per_second"] = plain_decoding_limit(bandwidth, weights)
    return settings


def _prompts(args: argparse.Namespace) -> list[Prompt]:
    return [p for d in args.datasets.split(",") for p in load_dataset(d.strip(), args.limit)]


def _image(args: argparse.Namespace, name: str) -> Path:
    return args.doc.parent / "images" / f"{name}.png"


def _publish(
    args: argparse.Namespace,
    section: str,
    source: Any,
    settings: dict[str, Any],
    key: str,
    items: Sequence[Any],
    parts: list[str],
    amount: str = "",
    note: str = "",
) -> None:
    """Write the JSON record (the machine, ``settings``, ``items`` under ``key``) and (re)write ``section``
    of ``args.doc``: where and how it was measured, the command, ``parts`` (paragraphs, tables, images),
    the record's path; print its tables."""
    machine = machine_info()
    json_path = write_record(args.out, section, machine, settings, key, items)
    amount = amount or f"{args.limit} prompts per dataset, {args.max_new_tokens} new tokens"
    command = f"Command: `{_command(args)}`{note}"
    body = "\n\n".join([_measured(machine, source, amount), command, *parts, f"Raw results: `{json_path}`."])
    update_section(args.doc, section, body)
    print("\n".join(line for line in body.splitlines() if line.startswith("|")))


def _measured(machine: dict[str, Any], source: Any, amount: str) -> str:
    return (
        f"Measured {machine['date']} on {host(machine)}, torch {machine['torch']}, "
        f"transformers {machine['transformers']}, commit `{machine['commit']}`. Model: `{Path(str(source)).name}`; "
        f"{amount}, greedy, warm-up excluded."
    )


def _limit_sentence(model: Model, settings: dict[str, Any]) -> str:
    dtype = str(model.dtype).removeprefix("torch.") if model.target.weights == "same" else model.target.weights
    bandwidth, weights = settings["memory_bandwidth_gbps"], settings["weight_bytes"]
    return (
        f"Memory bandwidth measured in the same run: {bandwidth:.1f} GB/s; {dtype} weights {weights / 1e6:.0f} MB, "
        f"so plain decoding cannot exceed about {settings['plain_decoding_limit_tokens_per_second']:.0f} tokens/s."
    )


SHOWN = ("model", "datasets", "limit", "max_new_tokens")  # in every command, even at their defaults
PLACEHOLDERS = {"llama_cpp": "LLAMA_CPP_BIN", "llama_cpp_dflash": "DFLASH_GGUF"}  # paths of this machine


def _command(args: argparse.Namespace) -> str:
    """The ``dflash2 bench`` command line that repeats this run (llama.cpp's files left as placeholders)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    words = ["dflash2 bench"]
    for key, default in vars(parser.parse_args([])).items():
        value = getattr(args, key)
        if key == "no_progress" or value is None or (value == default and key not in SHOWN):
            continue
        words.append(f"--{key.replace('_', '-')} {PLACEHOLDERS.get(key, value)}")
    return " ".join(words)
