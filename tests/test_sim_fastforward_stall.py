"""The decode fast path beside a stalled prompt (sim/fast/decode.py, _Stall): a running request
in its prompt chunks whose next chunk finds too few KV blocks waits while the others decode;
segments run beside it and the run is the step loop's to the bit (records, KV cache state and
the policy's invariants after every step and segment)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import sim.run as simrun
from bubblesim.core.config import load_config
from bubblesim.core.trace import make_trace, write_trace
from sim.fast.decode import FastForward, _Run
from sim.loop import SimLoop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffcheck import assert_same_records, records_and_loops  # noqa: E402


def _long_prompts(tmp: Path, seed: int, prefix: bool = False) -> Path:
    """40 requests in one second, a third with prompts of 1.5-4k tokens (chunked at a 1,024
    token budget, so a recompute or a late chunk waits for blocks in a 400-block cache)."""
    rng = np.random.default_rng(seed)
    n = 40
    long = rng.random(n) < 0.3
    prompt = np.where(long, rng.integers(1500, 4000, n), rng.integers(20, 300, n))
    cols: dict[str, object] = {}
    if prefix:
        group = np.where(rng.random(n) < 0.5, 0, -1).astype(np.int32)
        cols = {
            "prefix_group": group,
            "prefix_keys": np.array(["sys"], dtype=object),
            "prefix_len": np.where(group >= 0, np.minimum(prompt, 256), 0).astype(np.int32),
        }
    t = make_trace(np.sort(rng.uniform(0, 1.0, n)), prompt, rng.integers(50, 400, n), **cols)
    return write_trace(t, tmp / f"long{seed}{'p' if prefix else ''}.parquet")


@pytest.fixture
def stalled_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The iterations of each segment that ran beside a stalled prompt."""
    runs: list[int] = []
    orig = FastForward._simulate

    def spy(self: FastForward, old: list, members: list, stalled: object) -> _Run:
        run = orig(self, old, members, stalled)  # type: ignore[arg-type]
        if stalled is not None:
            runs.append(run.n)
        return run

    monkeypatch.setattr(FastForward, "_simulate", spy)
    return runs


BASE = ["model=llama3-8b", "num_kv_blocks=400", "max_num_batched_tokens=1024"]
CASES = [
    (0, False, BASE),
    (1, False, [*BASE, "batches_in_flight=3"]),
    (2, True, BASE),  # prefix caching: the stalled chunk's blocks are not hashed
    (3, False, [*BASE, "block_size=32", "max_num_seqs=8"]),
]


@pytest.mark.parametrize(("seed", "prefix", "sets"), CASES, ids=[str(c[0]) for c in CASES])
def test_segments_beside_a_stalled_prompt_are_exact(
    tmp_path: Path, stalled_runs: list[int], seed: int, prefix: bool, sets: list[str]
) -> None:
    a, b, loops = records_and_loops(sets, _long_prompts(tmp_path, seed, prefix))
    assert_same_records(a, b, str(sets))
    assert sum(stalled_runs) > 100, "no segment ran beside a stalled prompt: proves nothing"
    step, ff = loops
    assert step.sched.num_preemptions == ff.sched.num_preemptions > 0


def test_no_stall_without_batches_in_flight(tmp_path: Path, stalled_runs: list[int]) -> None:
    """Synchronous steps (depth 1): the other running requests hold no batch at a schedule, so
    a stalled chunk preempts one of them: the fast path leaves those steps to the loop."""
    sets = [*BASE, "batches_in_flight=1"]
    a, b, _ = records_and_loops(sets, _long_prompts(tmp_path, 0))
    assert_same_records(a, b, str(sets))
    assert not stalled_runs


def test_stalls_keep_policy_invariants(
    tmp_path: Path, stalled_runs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """check_invariants after every step and every segment."""
    loops: list[SimLoop] = []

    def keep(*args: object, **kw: object) -> SimLoop:
        loops.append(SimLoop(*args, check_invariants=True, **kw))  # type: ignore[arg-type]
        return loops[-1]

    monkeypatch.setattr(simrun, "SimLoop", keep)
    simrun.simulate(load_config(None, BASE), _long_prompts(tmp_path, 1))
    assert sum(stalled_runs) > 100 and loops[0].sched.num_preemptions > 0
