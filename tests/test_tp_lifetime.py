"""Tensor-parallel engines created, closed and created again in one process (gloo, tiny
model): the same tokens each time, no worker process, shared-memory ring or process group left
behind; engines sharing one model (replay's repeats), one left unclosed until the group stops;
and the start-up/shutdown step deadlines (engine.tp.watchdog) turning a hang into one error
naming the step."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import make_cfg

from engine.engine import Engine
from engine.requests import RequestInput
from engine.tp import watchdog
from engine.tp.watchdog import StepTimeout, deadline
from engine.tp.workers import stop_all

pytestmark = pytest.mark.usefixtures("one_thread")

REQS = [RequestInput(f"r{i}", 5 + 13 * i, 4 + i) for i in range(5)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def tokens(eng: Engine) -> list[list[int]]:
    return [o.token_ids for o in eng.run(REQS, arrival="asap")]


def gone(pids: list[int], ring: str) -> bool:
    """No worker process and no shared-memory segment of the ring left."""
    return not any(alive(p) for p in pids) and not Path("/dev/shm", ring).exists()


@pytest.mark.slow
def test_tp2_engines_recreated_in_one_process_give_the_same_tokens_and_leave_nothing():
    before = set(multiprocessing.active_children())
    mixed = {"cuda_graphs": True, "cuda_graphs_mixed": True}  # CPU: the padded steps, eager
    for i, kw in enumerate([{}, mixed, {"batches_in_flight": 1}, {}]):
        ref = tokens(Engine(make_cfg(**kw)))
        eng = Engine(make_cfg(tensor_parallel_size=2, **kw))
        comm = eng.model.comm
        pids, ring = comm.workers.pids, comm.ring.name
        assert all(alive(p) for p in pids)
        assert tokens(eng) == ref, f"engine {i}"
        t0 = time.monotonic()
        eng.close()  # every rank tears down together: no worker waits to be terminated
        assert time.monotonic() - t0 < 5.0, f"engine {i}: close took {time.monotonic() - t0} s"
        assert gone(pids, ring), f"engine {i}"
        assert not dist.is_initialized()
        assert set(multiprocessing.active_children()) == before
        with pytest.raises(RuntimeError, match="was closed"):
            eng.run(REQS[:1], arrival="asap")


@pytest.mark.slow
def test_engines_sharing_a_model_and_one_left_open_stop_with_the_group():
    """replay's pattern: several engines on one model (the workers rebuild theirs each time),
    the last one never closed; stop_all drops its graphs, stops the workers, leaves the group;
    then a new tensor-parallel engine starts in the same process."""
    ref = tokens(Engine(make_cfg()))
    cfg = make_cfg(tensor_parallel_size=2)
    first = Engine(cfg)
    model = first.model
    pids, ring = model.comm.workers.pids, model.comm.ring.name
    assert tokens(first) == ref
    second = Engine(cfg, model=model)  # the workers drop the first engine's twin
    assert tokens(second) == ref
    third = Engine(cfg, model=model)
    assert tokens(third) == ref
    second.close()  # a shared model's engine: the workers stay
    assert all(alive(p) for p in pids)
    stop_all()  # `third` is still open: its graphs go with the group
    assert gone(pids, ring) and not dist.is_initialized()
    assert third.graphs is None and third.mixed is None
    with pytest.raises(RuntimeError, match="was closed"):
        third.run(REQS[:1], arrival="asap")
    again = Engine(cfg)
    try:
        assert tokens(again) == ref
    finally:
        again.close()
    assert not dist.is_initialized()


# ---- step deadlines ----------------------------------------------------------------------------


def test_a_step_in_time_passes_and_its_errors_are_its_own():
    with deadline("quick", 5.0):
        pass
    with pytest.raises(KeyError), deadline("fails", 5.0):
        raise KeyError("own error")


def test_a_late_step_is_one_error_naming_it():
    with pytest.raises(StepTimeout) as e, deadline("slow step", 0.1):
        time.sleep(0.4)
    msg = str(e.value)
    assert "'slow step'" in msg and "0.1 s" in msg and "\n" not in msg


def test_the_environment_caps_every_deadline(monkeypatch):
    monkeypatch.setenv(watchdog.CAP_ENV, "0.1")
    with pytest.raises(StepTimeout, match="within 0.1 s"), deadline("build", 900.0):
        time.sleep(0.4)


def test_on_expiry_unblocks_a_waiting_step_which_then_names_the_step():
    peer_gone = threading.Event()

    def blocked_call() -> None:  # a collective that fails once its peer is killed
        if not peer_gone.wait(30):
            raise AssertionError("never unblocked")
        raise ConnectionError("peer closed the connection")

    t0 = time.monotonic()
    with pytest.raises(StepTimeout, match="'collective'"), deadline("collective", 0.2,
                                                                  peer_gone.set):  # fmt: skip
        blocked_call()
    assert time.monotonic() - t0 < 5


def test_a_worker_gone_during_a_step_ends_it_early_with_one_error():
    t0 = time.monotonic()
    with (
        pytest.raises(StepTimeout, match="'engine build' .*: a worker rank exited"),
        deadline("engine build", 60.0, alive=lambda: time.monotonic() - t0 < 0.3),
    ):
        time.sleep(2.5)  # the step returns, but its peer left during it
    assert time.monotonic() - t0 < 10


STUCK = """
import sys, threading
sys.path.insert(0, {root!r})
from engine.tp import watchdog
watchdog.GRACE_S = 0.3
with watchdog.deadline("rank 0: destroy the process groups", 0.2):
    threading.Event().wait()  # a native call that never returns
print("not reached")
"""


def test_a_step_blocked_for_good_ends_the_process_with_its_name(tmp_path: Path):
    root = str(Path(__file__).resolve().parents[1])
    script = tmp_path / "stuck.py"
    script.write_text(STUCK.format(root=root))
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert res.returncode == watchdog.EXIT_CODE, res.stderr[-2000:]
    assert "not reached" not in res.stdout
    assert "'rank 0: destroy the process groups'" in res.stderr
    assert time.monotonic() - t0 < 30
