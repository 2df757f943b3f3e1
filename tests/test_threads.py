"""The verify thread's core count: the ``threads`` option and the measured choice under contention."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import SPEC_PROMPTS

import dflash2
from dflash2 import InvalidOptionError
from dflash2.cli import build_parser
from dflash2.runtime import threads as thread_module
from dflash2.runtime.threads import ThreadPolicy, available_cores
from dflash2.runtime.workers import Worker, one_thread


class _Machine:
    """A workload whose seconds depend on the thread count the policy set: a stand-in machine
    with a clock of its own, which only its workload advances (``clocked`` gives it to the
    policy), so that no timing of this host decides a choice."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds = seconds
        self.threads = 0
        self.now = 0.0

    def set_threads(self, count: int) -> None:
        self.threads = count

    def perf_counter(self) -> float:
        return self.now

    def __call__(self) -> None:
        self.now += self.seconds[self.threads]


@pytest.fixture
def clocked(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[int, float]], _Machine]:
    """A stand-in machine whose clock the thread policy reads."""

    def make(seconds: dict[int, float]) -> _Machine:
        machine = _Machine(seconds)
        monkeypatch.setattr(thread_module, "time", machine)
        return machine

    return make


def _policy(machine: _Machine, limit: int = 2, **options: Any) -> ThreadPolicy:
    return ThreadPolicy(limit, every_s=0.0, workload=machine, **options)


def test_all_cores_while_they_are_faster_fewer_while_they_are_not(clocked: Callable[..., _Machine]) -> None:
    machine = clocked({1: 0.004, 2: 0.002})
    policy = _policy(machine)
    assert policy.measure(machine.set_threads) == 2 and machine.threads == 2
    machine.seconds = {1: 0.002, 2: 0.008}  # another process took a core
    assert policy.measure(machine.set_threads) == 1 and machine.threads == 1
    machine.seconds = {1: 0.004, 2: 0.002}  # it ended
    assert policy.measure(machine.set_threads) == 2 and machine.threads == 2


def test_a_count_changes_only_when_clearly_faster(clocked: Callable[..., _Machine]) -> None:
    machine = clocked({1: 0.0050, 2: 0.0052})
    policy = _policy(machine, margin=0.2)
    assert policy.measure(machine.set_threads) == 2


def test_the_choice_moves_one_core_at_a_time_and_stays_within_the_limit(clocked: Callable[..., _Machine]) -> None:
    machine = clocked({count: 0.001 * abs(count - 2) + 0.001 for count in range(1, 9)})  # 2 is best
    policy = _policy(machine, limit=8)
    assert [policy.measure(machine.set_threads) for _ in range(8)] == [7, 6, 5, 4, 3, 2, 2, 2]


def test_measurements_wait_their_interval_and_never_run_for_one_core(clocked: Callable[..., _Machine]) -> None:
    machine = clocked({1: 0.0, 2: 0.0})
    policy = ThreadPolicy(2, every_s=60.0, workload=machine)
    now = machine.perf_counter()
    assert policy.due(now)
    policy.measure(machine.set_threads)
    assert not policy.due(machine.perf_counter())
    machine.now += 60.0
    assert policy.due(machine.perf_counter())
    assert not ThreadPolicy(1).due(now)


def test_the_verify_worker_runs_jobs_at_the_measured_count() -> None:
    if torch.get_num_threads() < 2:
        pytest.skip("one core: nothing to choose")

    def slower_on_two() -> None:  # what a busy neighbour on the second core does
        time.sleep(0.004 if torch.get_num_threads() > 1 else 0.001)

    worker = Worker("verify", torch.device("cpu"), policy=ThreadPolicy(2, every_s=0.0, workload=slower_on_two))
    try:
        assert worker.call(torch.get_num_threads) == 1
        assert worker.threads_now == 1
    finally:
        worker.close()


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "all"])
def test_bad_threads_fail_before_loading(threads: Any) -> None:
    with pytest.raises(InvalidOptionError, match="threads must be"):
        dflash2.load("/nonexistent/model", threads=threads)


def test_the_cli_takes_a_thread_count(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["serve", "m"]).threads == "auto"
    assert parser.parse_args(["serve", "m", "--threads", "2"]).threads == 2
    assert parser.parse_args(["generate", "m", "p", "--threads", "1"]).threads == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--threads", "many"])
    assert "expected 'auto' or a number of threads, not 'many'" in capsys.readouterr().err


def test_a_fixed_thread_count_runs_every_step_on_it(paths: dict[str, Path], references: dict[str, list[int]]) -> None:
    model = dflash2.load(paths["target"], threads=1).with_drafter("ngram")
    assert model.workers.verify.threads_now == 1 and model.workers.verify.policy is None
    assert model.workers.verify.call(torch.get_num_threads) == 1
    prompt = SPEC_PROMPTS[0]
    assert list(model.generate(prompt, max_new_tokens=48).token_ids) == references[prompt]
    auto = dflash2.load(paths["target"])
    assert auto.workers is not model.workers and auto.workers.verify.policy is not None
    assert auto.workers.verify.policy.limit == min(torch.get_num_threads(), available_cores())


def test_the_draft_worker_computes_on_one_thread_after_torch_set_num_threads() -> None:
    """torch gives a new thread the count of ``torch.set_num_threads`` at its first use; a worker
    sets its own after that (the tests' conftest calls ``torch.set_num_threads``)."""
    if torch.get_num_threads() < 2:
        pytest.skip("one core: nothing to choose")
    worker = Worker("draft", torch.device("cpu"), 1)
    try:
        assert worker.call(torch.get_num_threads) == 1
    finally:
        worker.close()


def test_one_thread_holds_on_a_thread_torch_has_not_computed_on_yet() -> None:
    """A caller's thread may meet torch first inside ``one_thread``; torch's own first-use setting
    must not replace the single thread there."""
    if torch.get_num_threads() < 2:
        pytest.skip("one core: nothing to choose")
    seen: list[int] = []

    def fresh_thread() -> None:
        with one_thread():
            torch.ones(1 << 20).sum()  # a parallel region
            seen.append(torch.get_num_threads())
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=fresh_thread)
    thread.start()
    thread.join()
    assert seen == [1, torch.get_num_threads()]
