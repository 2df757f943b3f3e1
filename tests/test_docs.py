"""The docs site builds with ``mkdocs build --strict`` and documents every public name."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import dflash2
from dflash2.errors import DFlash2Error

ROOT = Path(__file__).parents[1]


@pytest.mark.timeout(300)
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocstrings")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    for name in dflash2.__all__:
        if not name.startswith("__"):
            assert name in reference, f"{name} is missing from the API reference"


def test_every_public_name_has_a_docstring() -> None:
    for name in dflash2.__all__:
        if name.startswith("__"):
            continue
        assert inspect.getdoc(getattr(dflash2, name)), f"dflash2.{name} has no docstring"


def test_troubleshooting_names_every_error() -> None:
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    errors = {cls.__name__ for cls in vars(dflash2).values() if isinstance(cls, type) and issubclass(cls, DFlash2Error)}
    errors.discard("DFlash2Error")
    for name in errors:
        assert f"`{name}`" in page, f"{name} is not in docs/troubleshooting.md"
