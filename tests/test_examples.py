"""Every example in examples/ runs offline on SmolLM2 with short settings and prints what it promises."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import dflash2

ROOT = Path(__file__).parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# what each script must print (beyond running cleanly); scripts not listed must print something
PRINTS = {
    "quickstart.py": ["tokens/s"],
    "concurrent_streams.py": ["streams on average"],
    "chat.py": [],  # driven below: no input, it ends at once
    "rag.py": ["retrieved: drafters.md", "answer: ", "speedup", "outputs identical"],
    "agent.py": [
        "tool call: calculator(",
        "answer (with the calculator): ",
        "answer (without tools): ",
        "cancelled the essay after",
    ],
    "openai_client.py": ["tokens per target forward]"],
}


def _env(tokens: int = 24) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "DFLASH2_EXAMPLE_TOKENS": str(tokens)}


@pytest.mark.smollm2
@pytest.mark.timeout(400)
@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script: Path, smollm2: dflash2.Model) -> None:
    # the `smollm2` fixture has converted the GGUF into the test cache the scripts will read
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_env(),
                            stdin=subprocess.DEVNULL, timeout=360)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "DIFFERENT" not in result.stdout
    expected = PRINTS.get(script.name)
    assert expected is not None, f"add what {script.name} must print to PRINTS"
    for text in expected:
        assert text in result.stdout, (text, result.stdout[-2000:])
    assert result.stdout.strip()


@pytest.mark.smollm2
@pytest.mark.timeout(300)
def test_chat_remembers_and_ctrl_c_stops_only_the_answer(smollm2: dflash2.Model) -> None:
    chat = subprocess.Popen([sys.executable, str(ROOT / "examples" / "chat.py")], env=_env(400), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert chat.stdin is not None and chat.stdout is not None
    out: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [out.put(c) for c in iter(lambda: chat.stdout.read(1), "")], daemon=True).start()
    seen = ""

    def wait_for(text: str, after: int = 0, timeout: float = 120) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while text not in seen[after:]:
            assert time.monotonic() < deadline, (text, seen[-1000:])
            with contextlib.suppress(queue.Empty):
                seen += out.get(timeout=1)

    try:
        wait_for("you> ")
        chat.stdin.write("Write a long story about a dragon.\n")
        chat.stdin.flush()
        wait_for("bot> ")
        start = len(seen)
        while len(seen) < start + 20:  # some of the answer is out
            seen += out.get(timeout=120)
        chat.send_signal(signal.SIGINT)
        wait_for("[stopped]", start)
        wait_for("(1 turns remembered)", start)
        chat.stdin.write("Say hello.\n")
        chat.stdin.flush()
        wait_for("(2 turns remembered)", start)
        chat.stdin.close()
        assert chat.wait(timeout=60) == 0, chat.stderr.read() if chat.stderr else ""
    finally:
        chat.kill()


@pytest.mark.smollm2
@pytest.mark.timeout(400)
def test_notebook_runs(smollm2: dflash2.Model) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(ROOT / "examples" / "notebook.ipynb", as_version=4)
    os.environ["DFLASH2_EXAMPLE_TOKENS"] = "24"  # the kernel inherits it
    try:
        nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    finally:
        del os.environ["DFLASH2_EXAMPLE_TOKENS"]
    code = [c for c in notebook.cells if c.cell_type == "code"]
    streamed = "".join(o.get("text", "") for o in code[1].outputs)
    assert "tokens per target forward" in streamed
    plot = code[2].outputs
    assert any("image/png" in o.get("data", {}) for o in plot) and "plotted" in "".join(o.get("text", "") for o in plot)


@pytest.mark.smollm2
def test_demo_command_prints_text_and_speedup(smollm2: dflash2.Model) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "dflash2.cli", "demo", "--model", "smollm2", "--max-new-tokens", "24"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "speedup" in result.stdout and "outputs identical" in result.stdout, result.stdout[-1000:]
    assert "DIFFERENT" not in result.stdout
