"""What a product of 1 to 16 rows costs in each of torch's CPU weight kernels, on Qwen2.5-1.5B's shapes.

A verify block of k drafted tokens multiplies k + 1 rows by every weight; speculation pays where
that costs little more than one row. Per kernel: fp32 with dflash2's oneDNN-packed weight (the
default target), int4 and int8 weight-only (``weights=``, bfloat16 activations), and oneDNN's
int8 x int8 product with a fixed activation scale (which would keep a row's bits in any block:
each row is quantized alone and integer sums are exact). Random weights; median of 20 runs, 2 threads.
Example::

    python scripts/kernel_rows.py --out bench/results/kernel-rows.json
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dflash2.bench.harness import machine_info
from dflash2.runtime.linear import Linear
from dflash2.runtime.quant import QuantLinear

SHAPES = {"gate_up": (17920, 1536), "down": (1536, 8960)}  # Qwen2.5-1.5B's MLP: most of its bytes
ROWS = (1, 2, 4, 8, 16)
X_SCALE = 4 / 127  # the activations below are standard normal


def median_ms(fn: Callable[[], object], runs: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[runs // 2]


def kernels(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    n, k = weight.shape
    fp32 = Linear(k, n)
    fp32.weight.data.copy_(weight)
    fp32.pack()
    int4, int8 = QuantLinear(weight, None, "int4"), QuantLinear(weight, None, "int8")
    scale = weight.abs().amax(1) / 127
    packed = torch.ops.onednn.qlinear_prepack(torch.round(weight / scale[:, None]).to(torch.int8), None)
    zeros = torch.zeros(n, dtype=torch.long)

    def int8_int8(x: torch.Tensor) -> torch.Tensor:  # a fixed activation scale: each row quantized alone
        q = (torch.round(x / X_SCALE) + 128).clamp_(0, 255).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(
            q, X_SCALE, 128, packed, scale, zeros, None, 1.0, 0, torch.float32, "none", [], ""
        )

    return {"fp32 (packed)": fp32, "int4": int4, "int8": int8, "int8 x int8 (oneDNN)": int8_int8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    results: dict[str, dict[str, dict[int, float]]] = {}
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            for kernel, fn in kernels(torch.randn(n, k) * 0.02).items():
                times = {rows: median_ms(functools.partial(fn, torch.randn(rows, k))) for rows in ROWS}
                results.setdefault(kernel, {})[name] = times
                print(name, kernel, {r: round(t, 2) for r, t in times.items()}, flush=True)
    print("\n| kernel | " + " | ".join(f"{r} rows" for r in ROWS) + " | 8 rows / 1 row |")
    print("|---|" + "---:|" * (len(ROWS) + 1))
    for kernel, shapes in results.items():
        total = {r: sum(times[r] for times in shapes.values()) for r in ROWS}
        cells = " | ".join(f"{total[r]:.2f}" for r in ROWS)
        print(f"| {kernel} | {cells} | {total[8] / total[1]:.2f}× |")
    args.out.write_text(json.dumps({"machine": machine_info(), "shapes": SHAPES, "ms": results}, indent=2))


if __name__ == "__main__":
    main()
