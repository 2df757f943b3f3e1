"""The official ``openai`` client streaming from ``dflash2 serve``.

Point ``DFLASH2_BASE_URL`` at a running server (``dflash2 serve <model>`` prints its URL); without
it, this script starts one on a free local port with the offline SmolLM2-135M-Instruct and the
shipped drafter, and stops it at the end. Needs the ``serve`` extra and ``pip install openai``.

Run: python examples/openai_client.py
"""

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from openai import OpenAI

from dflash2.demo_model import shipped_drafter, smollm2_gguf

MAX_TOKENS = int(os.environ.get("DFLASH2_EXAMPLE_TOKENS", "64"))


@contextmanager
def local_server() -> Iterator[str]:
    """``dflash2 serve`` on a free port of 127.0.0.1; yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    drafters = ["--drafter", "ngram"] + (["--drafter", str(shipped_drafter())] if shipped_drafter() else [])
    command = [sys.executable, "-m", "dflash2.cli", "serve", str(smollm2_gguf()), *drafters,
               "--name", "smollm2", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    server = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                httpx.get(url + "/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if server.poll() is not None:
                    raise SystemExit("dflash2 serve did not start") from None
                time.sleep(0.3)
        yield url + "/v1"
    finally:
        server.terminate()
        server.wait(timeout=30)


def chat(base_url: str) -> None:
    client = OpenAI(base_url=base_url, api_key="not-needed")
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a haiku about fast inference."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for event in stream:
        if event.choices:
            print(event.choices[0].delta.content or "", end="", flush=True)
        elif event.usage is not None:  # the last event: usage, and the stream's statistics
            stats = (event.model_extra or {}).get("dflash2", {})
            print(f"\n[{event.usage.completion_tokens} tokens, prompt {event.usage.prompt_tokens}; "
                  f"{stats.get('mean_acceptance_length', 0):.2f} tokens per target forward]")  # fmt: skip


if __name__ == "__main__":
    if url := os.environ.get("DFLASH2_BASE_URL"):
        chat(url)
    else:
        with local_server() as url:
            chat(url)
