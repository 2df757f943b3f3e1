"""``dflash2 check-drafter``: what a DFlash checkpoint reads, and whether it fits a target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from tiny import save_tiny

from dflash2.cli import main


def test_a_fitting_drafter(paths: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-drafter", str(paths["dflash2"]), "--target", str(paths["target"])]) == 0
    out = capsys.readouterr().out
    assert "DFlash2 (z-lab)" in out and "8 (drafts up to 7 tokens a step)" in out
    assert "[0, 1]" in out and "default, theta 10000" in out and "bidirectional, window 24" in out
    assert "ok: it fits the target." in out


def test_derived_layers_missing_weights_and_a_misfit(
    paths: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = shutil.copytree(paths["dflash1"], tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    del config["dflash_config"]["target_layer_ids"]
    config["num_target_layers"] = 6
    (broken / "config.json").write_text(json.dumps(config))
    weights = load_file(broken / "model.safetensors")
    del weights["layers.0.mlp.up_proj.weight"]
    weights["fc.weight"] = weights["fc.weight"][:, :10].contiguous()
    save_file(weights, broken / "model.safetensors")
    other = save_tiny(tmp_path / "other", "qwen3", hidden_size=32, num_hidden_layers=6)
    assert main(["check-drafter", str(broken), "--target", str(other)]) == 1
    out = capsys.readouterr().out
    assert "[1, 3] (derived from num_target_layers=6)" in out
    assert "1 weights missing, e.g. ['layers.0.mlp.up_proj.weight']" in out
    assert "fc.weight has shape [64, 10], the config implies [64, 128]" in out
    assert "hidden_size 64 != target's 32" in out


def test_not_a_dflash_drafter(paths: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-drafter", str(paths["target"])]) == 2
    assert "is not a DFlash drafter" in capsys.readouterr().err
