"""The prepared GPU training job: a new SmolLM2 DFlash drafter in one call of at most 10 minutes.

A development script (not installed). Run on the GPU machine after SmolLM2's GGUF arrived there
in parts (``transfer.py`` beside it; ``README.md`` here lists the calls)::

    PYTHONPATH=src:.venv/lib/python3.11/site-packages python scripts/gpu/train_job.py \\
        --parts /tmp/dflash2-gpu --out "$OUT"

It rebuilds the GGUF (sha256 checked), self-distils on the device (bf16, large generation
batches), trains with features computed on the fly (bf16 autocast, several sequences per
forward) until ``--minutes`` of the job are spent, and writes into ``--out`` the drafter in bf16
safetensors shards of at most 15 MiB (the device returns 8 files of 16 MiB at most) and
``gpu_train.json``: tokens generated, steps, minutes, and the first-position accuracy against
supervised tokens. ``--target`` runs it on any checkpoint instead (the tests run a tiny one on
the CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transfer import join  # scripts/gpu/transfer.py, beside this script

from dflash2.bench.harness import machine_info
from dflash2.train import TrainConfig, train_drafter

SHIPPED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def summary(run: Path, drafter: Path, seconds: float) -> dict[str, Any]:
    """What the run made: data, steps, time, and the accuracy curve against supervised tokens."""
    responses = [json.loads(line) for f in sorted((run / "data").glob("responses*.jsonl")) for line in f.open()]
    log = json.loads((drafter / "training_log.json").read_text())
    supervised, curve = 0.0, []
    for entry in log:
        supervised += entry["labels"][0]
        if entry["step"] % max(1, len(log) // 50) == 0 or entry is log[-1]:
            curve.append({"step": entry["step"], "tokens": supervised, "accuracy": entry["accuracy"][:4]})
    training_s = log[-1]["seconds"] if log else 0.0
    return {
        "prompts": len(responses),
        "tokens_generated": sum(len(r["response"]) for r in responses),
        "steps": log[-1]["step"] if log else 0,
        "training_minutes": training_s / 60,
        "job_minutes": seconds / 60,
        "generation_and_load_minutes": (seconds - training_s) / 60,
        "curve": curve,
        "files": sorted(p.name for p in drafter.iterdir()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu/train_job.py", description=__doc__.split("\n")[0])
    parser.add_argument("--parts", type=Path, default=Path("/tmp/dflash2-gpu"), help="where the GGUF's parts are")
    parser.add_argument("--target", default=None, help="a checkpoint instead of the GGUF rebuilt from --parts")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/dflash2-gpu/run"))
    parser.add_argument("--samples", type=int, default=12000, help="prompts of the default corpus to answer")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--generation-batch", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32, help="sequences per drafter forward")
    parser.add_argument("--num-layers", type=int, default=2, help="drafter layers (the shipped drafter has 2)")
    parser.add_argument("--steps", type=int, default=6000, help="the cosine schedule's length")
    parser.add_argument("--minutes", type=float, default=8.5, help="the whole job's budget; training stops then")
    parser.add_argument("--target-layer-ids", default=None, help="comma-separated (default: spread, 3 layers)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    began = time.monotonic()
    if args.target is None:
        target = str(join(args.parts, args.parts / SHIPPED_GGUF))
        print(f"rebuilt {target} from its parts (sha256 checked)", flush=True)
    else:
        target = args.target
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    config = TrainConfig(
        target=target,
        out=args.work,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        generation_batch=args.generation_batch,
        block_size=8,
        num_layers=args.num_layers,
        target_layer_ids=tuple(int(i) for i in args.target_layer_ids.split(",")) if args.target_layer_ids else None,
        steps=args.steps,
        accumulate=1,
        batch=args.batch,
        lr=1e-3,
        features="online",
        precision="bf16" if cuda else "fp32",
        export_dtype="bfloat16",
        max_shard_mib=15.0,
        checkpoint_every=max(100, args.steps // 10),
        device=args.device,
        max_minutes=args.minutes - 1.0 - (time.monotonic() - began) / 60,  # a minute kept for the export
    )
    drafter = train_drafter(config)
    report: dict[str, Any] = {"machine": machine_info(), "config": {k: str(v) for k, v in vars(config).items()}}
    report["cuda"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    report.update(summary(args.work, drafter, time.monotonic() - began))
    for file in drafter.iterdir():
        (args.out / file.name).write_bytes(file.read_bytes())
    (args.out / "gpu_train.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("curve", "config", "machine")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
