"""``dflash2 bench``: build the runners, run the matrix, write JSON, docs table and plots."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from dflash2.api import Model, load
from dflash2.bench.data import Prompt, load_dataset
from dflash2.bench.harness import Row, machine_info, run_matrix
from dflash2.bench.report import (
    markdown_table,
    plot_acceptance_histogram,
    plot_tokens_per_second,
    update_section,
    write_json,
)
from dflash2.bench.runners import DFlash2Runner, Runner, TransformersRunner
from dflash2.runtime.loader import resolve_checkpoint
from dflash2.tokenize import encode_prompt

PEERS = ("transformers", "transformers-prompt-lookup", "transformers-assisted")
DRAFTED = ("ngram", "ar", "dflash")
PIPELINE_NAMES = ("sync",)
CONFIGS = (*PEERS, "dflash2", *(f"dflash2-{d}-{p}" for d in DRAFTED for p in PIPELINE_NAMES))
DEFAULT_CONFIGS = ("transformers", "transformers-prompt-lookup", "dflash2", "dflash2-ngram-sync")


def memory_bandwidth_gbps(megabytes: int = 512, repeats: int = 5) -> float:
    """Read bandwidth seen by torch: the best of a few full passes over a large tensor."""
    x = torch.ones(megabytes * (1 << 20) // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def weight_bytes(model: Model) -> int:
    seen: set[int] = set()
    total = 0
    for p in model.target.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _hf_model(path: Any, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


def build_runners(
    model: Model, configs: list[str], drafters: dict[str, Any], block_sizes: dict[str, int | None]
) -> list[Runner]:
    """One runner per configuration; drafter-backed ones share the target's weights."""
    runners: list[Runner] = []
    hf: Any = None
    with_drafter: dict[str, Model] = {}
    for name in configs:
        if name not in CONFIGS:
            raise SystemExit(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
        if name.startswith("transformers"):
            hf = hf if hf is not None else _hf_model(model.checkpoint, model.dtype)
            if name == "transformers":
                runners.append(TransformersRunner(hf))
            elif name == "transformers-prompt-lookup":
                runners.append(TransformersRunner(hf, name, prompt_lookup_num_tokens=10))
            else:
                if drafters.get("ar") is None:
                    raise SystemExit("transformers-assisted needs --ar-drafter (a small LM with the same tokenizer)")
                assistant = _hf_model(resolve_checkpoint(drafters["ar"]), model.dtype)
                runners.append(TransformersRunner(hf, name, assistant_model=assistant))
        elif name == "dflash2":
            runners.append(DFlash2Runner(model, name))
        else:
            _, kind, pipeline = name.split("-")
            if drafters.get(kind) is None:
                raise SystemExit(f"{name} needs --{kind}-drafter")
            if kind not in with_drafter:
                with_drafter[kind] = model.with_drafter(drafters[kind], block_sizes.get(kind))
            runners.append(DFlash2Runner(with_drafter[kind], name, pipeline=pipeline))
    return runners


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="target (default: the offline SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--datasets", default="humaneval,mtbench")
    parser.add_argument("--limit", type=int, default=20, help="prompts per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"any of {', '.join(CONFIGS)}")
    parser.add_argument("--ar-drafter", default=None, help="small causal LM with the target's tokenizer")
    parser.add_argument("--dflash-drafter", default=None, help="DFlash / DFlash2 drafter (z-lab format)")
    parser.add_argument("--ngram-block-size", type=int, default=None)
    parser.add_argument("--ar-block-size", type=int, default=None)
    parser.add_argument("--dflash-block-size", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads for every configuration")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--section", default="matrix", help="name of the docs section to (re)write")
    parser.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> list[Row]:
    if args.threads:
        torch.set_num_threads(args.threads)
    source: Any = args.model
    if source is None:
        from dflash2.demo_model import smollm2_gguf

        source = smollm2_gguf()
    model = load(source, device="cpu")
    prompts: list[Prompt] = [p for d in args.datasets.split(",") for p in load_dataset(d.strip(), args.limit)]
    drafters = {"ngram": "ngram", "ar": args.ar_drafter, "dflash": args.dflash_drafter}
    block_sizes = {"ngram": args.ngram_block_size, "ar": args.ar_block_size, "dflash": args.dflash_block_size}
    runners = build_runners(model, [c.strip() for c in args.configs.split(",")], drafters, block_sizes)
    rows = run_matrix(
        runners,
        prompts,
        encode=lambda prompt: encode_prompt(model.tokenizer, prompt),
        max_new_tokens=args.max_new_tokens,
        reference="transformers",
        progress=not args.no_progress,
    )
    machine = machine_info()
    bandwidth = memory_bandwidth_gbps()
    weights = weight_bytes(model)
    settings = {
        "model": str(source),
        "datasets": args.datasets,
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "configs": args.configs,
        "memory_bandwidth_gbps": bandwidth,
        "weight_bytes": weights,
        "plain_decoding_limit_tokens_per_second": bandwidth * 1e9 / weights,
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path = write_json(args.out / f"{args.section}-{stamp}.json", machine, settings, rows)
    image_dir = args.doc.parent / "images"
    bars = plot_tokens_per_second(rows, image_dir / f"{args.section}-tokens-per-second.png")
    hist = plot_acceptance_histogram(rows, image_dir / f"{args.section}-acceptance.png")
    table = markdown_table(rows)
    body = [
        f"Measured {machine['date']} on {machine['cpu']} ({machine['threads']} threads), torch {machine['torch']}, "
        f"transformers {machine['transformers']}, commit `{machine['commit']}`. Model: `{Path(str(source)).name}`; "
        f"{args.limit} prompts per dataset, {args.max_new_tokens} new tokens, greedy, warm-up excluded.",
        "",
        "Command: `dflash2 bench " + " ".join(_cli_args(args)) + "`",
        "",
        table,
        "",
        f"Memory bandwidth measured in the same run: {bandwidth:.1f} GB/s; fp32 weights {weights / 1e6:.0f} MB, "
        f"so plain decoding cannot exceed about {settings['plain_decoding_limit_tokens_per_second']:.0f} tokens/s.",
        "",
        f"![tokens per second](images/{bars.name})",
    ]
    if hist is not None:
        body += ["", f"![acceptance lengths](images/{hist.name})"]
    body += ["", f"Raw results: `{json_path}`."]
    update_section(args.doc, args.section, "\n".join(body))
    print(table)
    return rows


def _cli_args(args: argparse.Namespace) -> list[str]:
    out = [
        f"--datasets {args.datasets}",
        f"--limit {args.limit}",
        f"--max-new-tokens {args.max_new_tokens}",
        f"--configs {args.configs}",
    ]
    if args.model:
        out.insert(0, f"--model {args.model}")
    if args.threads:
        out.append(f"--threads {args.threads}")
    for kind in ("ar", "dflash"):
        if getattr(args, f"{kind}_drafter"):
            out.append(f"--{kind}-drafter {getattr(args, f'{kind}_drafter')}")
    for kind in ("ngram", "ar", "dflash"):
        if getattr(args, f"{kind}_block_size"):
            out.append(f"--{kind}-block-size {getattr(args, f'{kind}_block_size')}")
    if args.section != "matrix":
        out.append(f"--section {args.section}")
    return out
