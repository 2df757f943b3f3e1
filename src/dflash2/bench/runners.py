"""One runner per configuration in the matrix; each turns prompt ids into new ids, timed."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from dflash2.api import Model
from dflash2.runtime.workers import Worker


@dataclass
class RunResult:
    token_ids: list[int]
    seconds: float
    time_to_first_token_s: float | None = None
    acceptance_lengths: list[int] = field(default_factory=list)
    overlap: float | None = None
    bubble: float | None = None
    draft_s: float = 0.0
    verify_s: float = 0.0
    predraft_hits: int = 0
    drafted_tokens: int = 0


class Runner(Protocol):
    name: str
    group: str  # "peer" or "ours"
    exact: bool  # whether its tokens should equal the reference's (False: it runs other weights)

    def run(self, prompt: Any, prompt_ids: list[int], max_new_tokens: int) -> RunResult: ...


class TransformersRunner:
    """``transformers.generate``, greedy; optional prompt lookup or an assistant model.

    It runs on ``worker``, the thread dflash2 computes on, so that both see the same threads.
    """

    group = "peer"
    exact = True

    def __init__(self, model: Any, worker: Worker, name: str = "transformers", **generate_kwargs: Any) -> None:
        self.model = model
        self.worker = worker
        self.name = name
        self.kwargs = generate_kwargs

    def _generate(self, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        pad = self.model.config.pad_token_id
        out: torch.Tensor = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad if pad is not None else 0,
            **self.kwargs,
        )
        return out

    def run(self, prompt: Any, prompt_ids: list[int], max_new_tokens: int) -> RunResult:
        ids = torch.tensor([prompt_ids], device=self.model.device)
        start = time.perf_counter()
        out = self.worker.call(lambda: self._generate(ids, max_new_tokens))
        seconds = time.perf_counter() - start
        return RunResult([int(t) for t in out[0, len(prompt_ids) :]], seconds)


class DFlash2Runner:
    """``Model.generate`` with fixed options (drafter and pipeline are the model's / options')."""

    group = "ours"
    exact = True

    def __init__(self, model: Model, name: str, **options: Any) -> None:
        self.model = model
        self.name = name
        self.options = options

    def run(self, prompt: Any, prompt_ids: list[int], max_new_tokens: int) -> RunResult:
        start = time.perf_counter()
        completion = self.model.generate(prompt, max_new_tokens=max_new_tokens, **self.options)
        seconds = time.perf_counter() - start
        s = completion.stats
        return RunResult(
            list(completion.token_ids),
            seconds,
            time_to_first_token_s=s.time_to_first_token_s,
            acceptance_lengths=list(s.acceptance_lengths),
            overlap=s.overlap,
            bubble=s.bubble,
            draft_s=s.draft_s,
            verify_s=s.verify_s,
            predraft_hits=s.predraft_hits,
            drafted_tokens=s.drafted_tokens,
        )


class LlamaServerRunner:
    """llama.cpp's ``llama-server`` on a GGUF file, fed the same prompt token ids, greedy.

    It runs the file's own quantized weights, so its tokens are not expected to equal the fp32
    model's (the matrix reports how many do). The server runs with ``threads`` threads while
    dflash2 waits, one request at a time, the prompt cache off (each prompt is prefilled anew,
    as in every other runner). ``extra`` adds server flags: a draft model, an n-gram mode.
    """

    group = "peer"
    exact = False  # the GGUF's own quantized weights, not the dequantized fp32 model

    def __init__(self, binary: Path, gguf: Path, name: str, threads: int, extra: Sequence[str] = ()) -> None:
        self.name = name
        self._port = _free_port()
        command = [
            str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self._port), "-t", str(threads),
            "-tb", str(threads), "-c", "4096", "-np", "1", "--no-webui", *extra,
        ]  # fmt: skip
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server, closed by close()
        # a build's shared libraries sit beside its binaries
        libraries = os.pathsep.join(filter(None, [str(binary.parent), os.environ.get("LD_LIBRARY_PATH")]))
        env = {**os.environ, "LD_LIBRARY_PATH": libraries}
        self._server = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=600)
        try:
            payload = json.dumps(body).encode() if body is not None else None
            connection.request(method, path, payload, {"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, json.loads(response.read() or b"null")
        finally:
            connection.close()

    def _wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._server.poll() is not None:
                self._log.seek(0)
                tail = self._log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"llama-server exited with {self._server.returncode}:\n{tail}")
            try:
                if self._request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"llama-server did not become ready in {timeout_s:.0f} s")

    def run(self, prompt: Any, prompt_ids: list[int], max_new_tokens: int) -> RunResult:
        return self.complete(prompt_ids, max_new_tokens)[0]

    def complete(
        self, prompt_ids: list[int], max_new_tokens: int, cache_prompt: bool = False
    ) -> tuple[RunResult, dict[str, Any]]:
        """One greedy completion; with the server's timings (``cache_n``: prompt tokens it reused)."""
        body = {
            "prompt": prompt_ids, "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1, "seed": 0,
            "cache_prompt": cache_prompt, "return_tokens": True, "stream": False,
        }  # fmt: skip
        start = time.perf_counter()
        status, out = self._request("POST", "/completion", body)
        seconds = time.perf_counter() - start
        if status != 200:
            raise RuntimeError(f"llama-server answered {status}: {out}")
        timings = out.get("timings", {})
        drafted, accepted = timings.get("draft_n"), timings.get("draft_n_accepted")
        tokens = [int(t) for t in out.get("tokens", [])]
        lengths: list[int] = []
        if drafted and tokens:  # the server counts accepted drafts: spread the tokens over its forwards
            steps = max(1, len(tokens) - int(accepted or 0))
            share, extra = divmod(len(tokens), steps)
            lengths = [share + 1] * extra + [share] * (steps - extra)
        result = RunResult(tokens, seconds, time_to_first_token_s=timings.get("prompt_ms", 0.0) / 1e3,
                           acceptance_lengths=lengths)  # fmt: skip
        return result, timings

    def close(self) -> None:
        if self._server.poll() is None:
            self._server.terminate()
            try:
                self._server.wait(30)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
        self._log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
