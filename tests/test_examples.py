"""Every script in examples/ runs and prints something sensible."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import dflash2

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.py"))


@pytest.mark.smollm2
@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script: Path, smollm2: dflash2.Model) -> None:
    # the `smollm2` fixture has converted the GGUF into the test cache the scripts will read
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip()


@pytest.mark.smollm2
def test_demo_command_prints_text_and_speedup(smollm2: dflash2.Model) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "dflash2.cli", "demo", "--max-new-tokens", "24"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "speedup" in result.stdout and "outputs identical" in result.stdout, result.stdout[-1000:]
    assert "DIFFERENT" not in result.stdout
