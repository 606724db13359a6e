"""Fast path (sim/fast/decode.py, and sim/fast/spec.py + sim/fast/specstep.py with speculative
decoding) is exact: runs with it on and off give the same run folder (summary, steps, requests)
to 1e-9 relative, over depths 1/2/3, the GC model (with and without a frozen heap), CUDA graphs
on and off, preemption-prone KV budgets, a full running set with a waiting queue, chunked
prefill, prefix sharing and a per-history-token scan; with drafts also over both n-gram
proposers, k 1..4, the seed switches, token-id acceptance (with the CPU proposer's draft hints)
and per-request accept rates, and behind a router. Also the recorder's bulk appends against
the per-call methods they stand for."""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import bubblesim.plan.fleet as fleet
import sim.run as simrun
from bubblesim.core.config import load_config
from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.runfmt import RunRecorder, codec
from bubblesim.core.shape import SHAPE_FIELDS, BatchShape
from bubblesim.core.trace import TokenLists, make_trace, write_trace
from bubblesim.plan.fleet import FleetSpec, simulate_fleet
from sim.loop import SimLoop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffcheck import assert_same_records, records_without_and_with_fast_forward  # noqa: E402


def _trace(tmp: Path, name: str, n: int, span_s: float, prompt: tuple[int, int],
           output: tuple[int, int], seed: int = 0, **cols: object) -> Path:  # fmt: skip
    rng = np.random.default_rng(seed)
    arrival = np.sort(rng.uniform(0, span_s, n))
    t = make_trace(arrival, rng.integers(*prompt, n), rng.integers(*output, n), **cols)
    return write_trace(t, tmp / f"{name}.parquet")


def _text(rng: np.random.Generator, n: int) -> list[int]:
    """Token ids that repeat (phrases from a small set), so n-gram drafts often match."""
    phrases = [rng.integers(0, 50, int(rng.integers(2, 6))).tolist() for _ in range(8)]
    out: list[int] = []
    while len(out) < n:
        out += phrases[int(rng.integers(0, 8))] if rng.random() < 0.8 else [int(rng.integers(50))]
    return out[:n]


def _ids_trace(tmp: Path, n: int, span_s: float, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(8, 200, n)
    output = rng.integers(1, 150, n)
    return write_trace(
        make_trace(
            np.sort(rng.uniform(0, span_s, n)), prompt, output,
            prompt_ids=TokenLists.from_lists([_text(rng, int(p)) for p in prompt]),
            output_ids=TokenLists.from_lists([_text(rng, int(o)) for o in output]),
        ),
        tmp / f"ids{seed}.parquet",
    )  # fmt: skip


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("ff")
    rng = np.random.default_rng(5)
    return {
        "ids": _ids_trace(tmp, 60, 2.0, 7),
        "rate": _trace(
            tmp,
            "rate",
            80,
            2.0,
            (20, 900),
            (1, 250),
            seed=6,
            accept_rate=rng.uniform(0, 1, 80).astype(np.float32),
        ),  # fmt: skip
        "light": _trace(tmp, "light", 120, 8.0, (20, 600), (1, 200)),
        "burst": _trace(tmp, "burst", 120, 1.0, (100, 1500), (1, 300), seed=1),
        "hist": _trace(
            tmp, "hist", 24, 2.0, (10, 200), (200, 900), seed=2, needs_history=rng.random(24) < 0.5
        ),
        "prefix": _trace(
            tmp,
            "prefix",
            80,
            3.0,
            (300, 700),
            (1, 120),
            seed=3,
            prefix_group=(shared := np.where(rng.random(80) < 0.7, 0, -1).astype(np.int32)),
            prefix_keys=np.array(["sys"], dtype=object),
            prefix_len=np.where(shared >= 0, 256, 0).astype(np.int32),
        ),
    }


_GEN = Path(__file__).resolve().parents[1] / "reports/fidelity/gen"
CASES = [
    ("light", ["model=llama3-8b"]),
    ("light", ["model=llama3-8b", "batches_in_flight=1"]),
    ("light", ["model=llama3-8b", "batches_in_flight=3", "cuda_graphs=false"]),
    ("light", ["model=llama3.2-1b", "gc_freeze=false"]),
    ("burst", ["model=llama3-8b", "num_kv_blocks=300"]),
    ("burst", ["model=llama3-8b", "num_kv_blocks=300", "batches_in_flight=3", "max_num_seqs=16"]),
    ("burst", ["model=tiny", "batches_in_flight=1", "num_kv_blocks=250", "gc_freeze=false"]),
    ("burst", ["model=llama3-8b", "max_num_batched_tokens=512", "max_num_seqs=8"]),
    ("hist", ["model=llama3-8b", "reverse_placeholder_scan=false", "batches_in_flight=3"]),
    ("prefix", ["model=llama3-8b", "num_kv_blocks=400"]),
    # speculative decoding: sim/fast/spec.py
    ("light", ["model=llama3-8b", "spec.method=ngram-gpu"]),
    ("light", ["model=llama3.2-1b", "spec.method=ngram-gpu", "spec.k=1", "batches_in_flight=1"]),
    ("burst", ["model=llama3-8b", "spec.method=ngram-gpu", "spec.k=4", "batches_in_flight=3",
               "num_kv_blocks=300"]),
    ("burst", ["model=tiny", "spec.method=ngram-cpu", "spec.k=2", "num_kv_blocks=250",
               "gc_freeze=false"]),
    ("burst", ["model=llama3-8b", "spec.method=ngram-gpu", "max_num_batched_tokens=512",
               "max_num_seqs=8"]),
    ("light", ["model=llama3-8b", "spec.method=ngram-gpu", "optimistic_spec_decode=false",
               "accepted_count_by_sum=false", "preallocated_backup_tokens=false"]),
    ("hist", ["model=llama3-8b", "spec.method=ngram-gpu", "spec.k=3", "batches_in_flight=3",
              "reverse_placeholder_scan=false", "cuda_graphs=false"]),
    ("prefix", ["model=llama3-8b", "spec.method=ngram-gpu", "spec.k=2", "num_kv_blocks=400"]),
    ("rate", ["model=llama3.2-1b", "spec.method=ngram-gpu", "spec.k=4", "seed=3"]),
    ("ids", ["model=llama3.2-1b", "spec.method=ngram-cpu", "spec.k=3"]),
    ("ids", ["model=llama3.2-1b", "spec.method=ngram-gpu", "spec.k=4", "batches_in_flight=3"]),
    # random sampling (sim.cost.sampling: GPU and host terms read only the cache key's fields)
    ("burst", ["model=llama3.2-1b", "sampling.temperature=0.8", "sampling.top_p=0.9",
               "num_kv_blocks=300"]),
    ("light", ["model=llama3-8b", "sampling.temperature=1", "sampling.top_k=20",
               "cuda_graphs=false"]),
    ("light", ["model=llama3.2-1b", "spec.method=ngram-gpu", "sampling.temperature=0.7",
               "sampling.top_k=40", "sampling.top_p=0.95"]),
    # committed profiles: the decode pass keyed for the batch size (tables, splines, the tail
    # and program keys, the history term: sim.cost.linear._keyed_model, sim.cost.table)
    ("burst", ["model=llama3-8b", f"profile={_GEN}/profile-h100-llama3-8b.json",
               "num_kv_blocks=300"]),
    ("hist", ["model=llama3.2-1b", "gpu=h200", f"profile={_GEN}/profile-h200-llama3.2-1b.json",
              "sampling.temperature=0.8", "sampling.top_p=0.9"]),
    ("light", ["model=llama3.2-1b", f"profile={_GEN}/profile-h100-llama3.2-1b.json",
               "spec.method=ngram-gpu", "spec.k=3"]),
]  # fmt: skip


def blocks_state(loop: SimLoop) -> tuple[object, ...]:
    """The KV cache's whole state: which blocks are free in which reuse order (allocation and
    release order show here), refcounts and the prefix-cache map; and the most requests that
    ran at once (bubblesim.plan reuses runs by it)."""
    bm = loop.sched.blocks
    free = bm.free
    order, b = [], free.head
    while b != -1:
        order.append(b)
        b = free.next[b]
    return (
        free.fresh,
        order,
        list(bm.refcount),
        list(bm.block_hash),
        sorted(bm.hash_to_block.items()),
        loop.peak_running,
    )


def run_folder(
    tmp: Path, trace: Path, sets: list[str], fast_forward: bool
) -> tuple[Path, int, tuple[object, ...]]:
    """simulate() with fast-forward on or off; returns the run folder, the steps it skipped and
    the final KV cache state."""
    loops: list[SimLoop] = []

    def make(*args: object, **kw: object) -> SimLoop:
        loop = SimLoop(*args, fast_forward=fast_forward, **kw)  # type: ignore[arg-type]
        loops.append(loop)
        return loop

    out = tmp / ("ff" if fast_forward else "step")
    orig = simrun.SimLoop
    simrun.SimLoop = make  # type: ignore[assignment,misc]
    try:
        simrun.simulate(load_config(None, sets), trace, out)
    finally:
        simrun.SimLoop = orig  # type: ignore[misc]
    ff = loops[0].ff
    return out, (ff.num_steps if ff is not None else 0), blocks_state(loops[0])


def assert_same(a: object, b: object, where: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12) or (math.isnan(a) and math.isnan(b)), (
            f"{where}: {a} != {b}"
        )
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_tables(pa_: Path, pb: Path) -> None:
    ta, tb = codec.read_table(pa_), codec.read_table(pb)  # decoded: floats compare as floats
    assert ta.column_names == tb.column_names and ta.num_rows == tb.num_rows, pa_.name
    for name in ta.column_names:
        x, y = ta.column(name).to_numpy(), tb.column(name).to_numpy()
        if x.dtype.kind == "f":
            np.testing.assert_allclose(x, y, rtol=1e-9, atol=1e-12, err_msg=f"{pa_.name}:{name}")
        else:
            assert np.array_equal(x, y), f"{pa_.name}:{name}"


@pytest.mark.parametrize(("trace", "sets"), CASES, ids=[" ".join(s) for _, s in CASES])
def test_fast_forward_is_exact(
    tmp_path: Path, traces: dict[str, Path], trace: str, sets: list[str]
) -> None:
    step_dir, _, step_blocks = run_folder(tmp_path, traces[trace], sets, fast_forward=False)
    ff_dir, skipped, ff_blocks = run_folder(tmp_path, traces[trace], sets, fast_forward=True)
    assert skipped > 0, "fast-forward never ran: the test would prove nothing"
    assert step_blocks == ff_blocks, "KV cache state"
    sa = json.loads((step_dir / "summary.json").read_text())
    sb = json.loads((ff_dir / "summary.json").read_text())
    for s in (sa, sb):
        s["sim"].pop("wall_s")
    assert_same(sa, sb, "summary")
    for name in ("steps.parquet", "requests.parquet", "gc.parquet"):
        assert_same_tables(step_dir / name, ff_dir / name)


def test_fast_forward_keeps_policy_invariants(traces: dict[str, Path]) -> None:
    """check_invariants after every step and every segment, on a preemption-prone budget."""
    loops: list[SimLoop] = []
    orig = simrun.SimLoop
    simrun.SimLoop = functools.partial(_keep, loops, check_invariants=True)  # type: ignore
    try:
        res = simrun.simulate(load_config(None, ["model=llama3-8b", "num_kv_blocks=300"]),
                              traces["burst"])  # fmt: skip
    finally:
        simrun.SimLoop = orig  # type: ignore[misc]
    assert loops[0].ff.num_steps > 0 and res.summary["extra"]["sim"]["preemptions"] > 0


def _keep(loops: list[SimLoop], *args: object, **kw: object) -> SimLoop:
    loop = SimLoop(*args, **kw)  # type: ignore[arg-type]
    loops.append(loop)
    return loop


# ---- the recorder's bulk appends ---------------------------------------------------------------
def _shape(i: int) -> BatchShape:
    return BatchShape(num_reqs=i % 5 + 1, decode_tokens=i % 5 + 1, kv_read_tokens=100 + i)


def _frozen_equal(a: RunRecorder, b: RunRecorder) -> None:
    fa, fb = a.freeze(), b.freeze()
    for name in fa.__dataclass_fields__:
        x, y = getattr(fa, name), getattr(fb, name)
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y, err_msg=name)
        else:
            assert x == y, name


def test_bulk_steps_match_per_call() -> None:
    a, b = RunRecorder(chunk_steps=8), RunRecorder(chunk_steps=8)
    shapes = [_shape(i) for i in range(20)]
    times = {p: ([i + 0.1 * j for i in range(20)], [i + 0.1 * j + 0.05 for i in range(20)])
             for j, p in enumerate(CPU_PHASES[:-1])}  # fmt: skip
    for s in shapes[:3]:
        a.add_step(s)
        b.add_step(s)
    rows = [tuple(getattr(s, f) for f in SHAPE_FIELDS) for s in shapes[3:]]
    first = b.add_steps(rows, {p: (t0[3:], t1[3:]) for p, (t0, t1) in times.items()})
    assert first == 3
    for i, s in enumerate(shapes[3:], start=3):
        a.add_step(s)
        for p, (t0, t1) in times.items():
            a.phase(i, p, t0[i], t1[i])
    for i in range(3):
        for p, (t0, t1) in times.items():
            a.phase(i, p, t0[i], t1[i])
            b.phase(i, p, t0[i], t1[i])
    po = [i + 0.9 for i in range(20)]
    for i in range(20):
        a.phase(i, "process_outputs", po[i], po[i] + 0.01)
        a.gpu(i, i + 0.5, i + 0.8)
    b.phases(0, "process_outputs", po, [t + 0.01 for t in po])
    b.gpus(0, [i + 0.5 for i in range(20)], [i + 0.8 for i in range(20)])
    a.sync(4, 1.0, 2.0)
    a.sync(7, 3.0, 3.5)
    b.syncs([4, 7], [1.0, 3.0], [2.0, 3.5])
    _frozen_equal(a, b)
    with pytest.raises(ValueError, match="twice"):
        b.phases(2, "process_outputs", [1.0], [2.0])
    with pytest.raises(ValueError, match="twice"):
        b.gpus(5, [1.0], [2.0])
    with pytest.raises(IndexError):
        b.gpus(19, [1.0, 2.0], [1.5, 2.5])
    with pytest.raises(ValueError, match="unknown CPU phase"):
        b.phases(0, "nap", [1.0], [2.0])


@pytest.mark.parametrize("limit", [1 << 20, 7])  # 7: the ITL sketch folds mid-way
def test_bulk_tokens_match_per_call(limit: int) -> None:
    a, b = RunRecorder(itl_exact_limit=limit), RunRecorder(itl_exact_limit=limit)
    for r in (a, b):
        for i in range(6):
            r.add_request(i, 0.0)
        r.tokens(0, 0.5)
        r.tokens(1, 0.7, 3, 2)
    times = [1.0, 1.25, 1.75, 1.8, 2.5]
    ranges = [(0, 5), (1, 4), (2, 3), (0, 0), (3, 5), (0, 5)]
    for i, t in enumerate(times):  # per call: time order, request order within a time
        for r, (i0, i1) in enumerate(ranges):
            if i0 <= i < i1:
                a.tokens(r, t)
    b.tokens_ranges(list(range(6)), [x for x, _ in ranges], [y for _, y in ranges], times)
    for t in (3.0, 3.5):
        for r in (0, 2, 4):
            a.tokens(r, t)
    b.tokens_each([0, 2, 4], [3.0, 3.5])
    _frozen_equal(a, b)
    with pytest.raises(ValueError, match="before the last"):
        b.tokens_each([0], [0.1])
    with pytest.raises(ValueError, match="ascending"):
        b.tokens_ranges([5], [0], [2], [9.0, 8.0])


@pytest.mark.parametrize("limit", [1 << 20, 9])  # 9: the ITL sketch folds mid-way
def test_bulk_emissions_match_per_call(limit: int) -> None:
    """tokens_many / accepted_many (speculative emissions of several tokens) against tokens /
    accepted called one by one: equal columns, quantiles and sketch state."""
    rng = np.random.default_rng(limit)
    a, b = RunRecorder(itl_exact_limit=limit), RunRecorder(itl_exact_limit=limit)
    for r in (a, b):
        for i in range(8):
            r.add_request(i, 0.0)
        for _ in range(6):
            r.add_step(_shape(0))
        r.tokens(3, 0.2, 2, 1)  # tokens before the bulk call
    calls, t = [], 1.0
    for _ in range(40):
        t += float(rng.choice([0.0, rng.random()]))
        for i in rng.choice(8, int(rng.integers(1, 8)), replace=False).tolist():
            n = int(rng.integers(1, 5))
            calls.append((i, t, n, int(rng.integers(0, n))))
    for c in calls:
        a.tokens(*c)
    b.tokens_many(*zip(*calls))  # type: ignore[arg-type]
    for i, n in enumerate([0, 3, 1, 0]):
        a.accepted(2 + i, n)
    b.accepted_many(2, [0, 3, 1, 0])
    _frozen_equal(a, b)
    with pytest.raises(ValueError, match="before the last"):
        b.tokens_many([3], [0.1], [1], [0])
    with pytest.raises(ValueError, match="n must be"):
        b.tokens_many([3], [9.0], [0], [0])
    with pytest.raises(IndexError):
        b.accepted_many(5, [1, 1])


@pytest.mark.parametrize("seed", range(8))
def test_fast_forward_is_exact_on_random_configs(tmp_path: Path, seed: int) -> None:
    """Random small traces and configs (depth, KV budget, batch limits, block size, chunking,
    prefix sharing, history flags, GC thresholds): the recordings are equal to the bit."""
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(10, 60))
    prompt = rng.integers(1, int(rng.choice([60, 600, 1500])), n)
    cols: dict[str, object] = {"needs_history": rng.random(n) < 0.4}
    if rng.random() < 0.5:
        group = np.where(rng.random(n) < 0.6, 0, -1).astype(np.int32)
        cols["prefix_group"] = group
        cols["prefix_keys"] = np.array(["p"], dtype=object)
        cols["prefix_len"] = np.where(group >= 0, np.minimum(prompt, 300), 0).astype(np.int32)
    trace = write_trace(
        make_trace(np.sort(rng.uniform(0, float(rng.choice([0.2, 2, 10])), n)), prompt,
                   rng.integers(1, int(rng.choice([10, 200, 500])), n), **cols),
        tmp_path / "r.parquet",
    )  # fmt: skip
    sets = [
        f"model={rng.choice(['llama3-8b', 'llama3.2-1b', 'tiny'])}",
        f"batches_in_flight={rng.integers(1, 4)}",
        f"num_kv_blocks={rng.choice([120, 400, 3000])}",
        f"max_num_seqs={rng.choice([2, 8, 64])}",
        f"max_num_batched_tokens={rng.choice([256, 2048, 8192])}",
        f"block_size={rng.choice([8, 16, 32])}",
        f"gc.threshold0={rng.choice([50, 700])}",
        f"gc_freeze={rng.choice(['true', 'false'])}",
        f"reverse_placeholder_scan={rng.choice(['true', 'false'])}",
    ]
    try:
        recs = records_without_and_with_fast_forward(sets, trace)
    except Exception as e:  # a request that cannot fit this config: nothing to compare
        assert "TraceError" in type(e).__name__, e
        return
    assert_same_records(*recs, str(sets))


@pytest.mark.parametrize("seed", range(10))
def test_spec_fast_forward_is_exact_on_random_configs(tmp_path: Path, seed: int) -> None:
    """Speculative decoding on random small traces and configs (proposer, k, depth, seed
    switches, KV budget, batch limits, block size, GC; acceptance from a default rate, a
    per-request rate or token ids): the recordings are equal to the bit."""
    rng = np.random.default_rng(200 + seed)
    kind = ["rate", "default", "ids"][seed % 3]
    if kind == "ids":
        trace = _ids_trace(tmp_path, int(rng.integers(10, 50)), float(rng.choice([0.5, 3])), seed)
    else:
        n = int(rng.integers(10, 60))
        cols: dict[str, object] = {"needs_history": rng.random(n) < 0.4}
        if kind == "rate":
            cols["accept_rate"] = rng.uniform(0, 1, n).astype(np.float32)
        trace = write_trace(
            make_trace(np.sort(rng.uniform(0, float(rng.choice([0.2, 2, 10])), n)),
                       rng.integers(1, int(rng.choice([60, 600, 1500])), n),
                       rng.integers(1, int(rng.choice([10, 200, 500])), n), **cols),
            tmp_path / "r.parquet",
        )  # fmt: skip
    sets = [
        f"model={rng.choice(['llama3-8b', 'llama3.2-1b', 'tiny'])}",
        f"spec.method={rng.choice(['ngram-gpu', 'ngram-cpu'])}",
        f"spec.k={rng.integers(1, 5)}",
        f"seed={rng.integers(0, 3)}",
        f"batches_in_flight={rng.integers(1, 4)}",
        f"num_kv_blocks={rng.choice([120, 400, 3000])}",
        f"max_num_seqs={rng.choice([2, 8, 64])}",
        f"max_num_batched_tokens={rng.choice([256, 2048, 8192])}",
        f"block_size={rng.choice([8, 16, 32])}",
        f"gc.threshold0={rng.choice([50, 700])}",
        f"gc_freeze={rng.choice(['true', 'false'])}",
        f"optimistic_spec_decode={rng.choice(['true', 'false'])}",
        f"accepted_count_by_sum={rng.choice(['true', 'false'])}",
        f"preallocated_backup_tokens={rng.choice(['true', 'false'])}",
        f"cuda_graphs={rng.choice(['true', 'false'])}",
    ]
    loops: list[SimLoop] = []
    try:
        recs = records_without_and_with_fast_forward(sets, trace, functools.partial(_keep, loops))
    except Exception as e:  # a request that cannot fit this config: nothing to compare
        assert "TraceError" in type(e).__name__, e
        return
    assert_same_records(*recs, str(sets))
    assert blocks_state(loops[0]) == blocks_state(loops[1]), sets


@pytest.mark.parametrize("method", ["ngram-gpu", "ngram-cpu"])
def test_spec_steps_behind_a_router_are_exact(tmp_path: Path, method: str) -> None:
    """Replicas fed by a router take no segments; their spec steps are fused (sim/fast/specstep.py)
    and give the step-by-step run."""
    rng = np.random.default_rng(9)
    trace = make_trace(np.sort(rng.uniform(0, 3, 90)), rng.integers(20, 900, 90),
                       rng.integers(1, 200, 90))  # fmt: skip
    cfg = load_config(None, [f"spec.method={method}", "num_kv_blocks=600", "gc_freeze=false"])
    spec = FleetSpec(cfg, 2, "least-outstanding")
    loops: list[SimLoop] = []
    out = []
    for ff in (False, True):
        orig = fleet.SimLoop
        fleet.SimLoop = functools.partial(_keep, loops, fast_forward=ff)  # type: ignore[misc]
        try:
            res = simulate_fleet(spec, trace)
        finally:
            fleet.SimLoop = orig  # type: ignore[misc]
        res.pop("sim")
        out.append(res)
    assert out[0] == out[1]
    fused = [lp.spec_steps.num_fast for lp in loops if lp.spec_steps is not None]
    assert fused and sum(fused) > 0


@pytest.mark.parametrize("method", ["none", "ngram-gpu", "ngram-cpu"])
def test_fast_forward_stops_early_where_the_step_loop_does(method: str) -> None:
    """A plan's SLO watch looks after every step; a segment ends at the first step that
    completes at its next check, so an early-stopped run stops at the same step with the same
    partial results, and one that is not stopped is unchanged."""
    from bubblesim.plan.spec import parse_slos

    rng = np.random.default_rng(11)
    n = 300
    trace = make_trace(np.sort(rng.uniform(0, 30, n)), rng.integers(50, 2000, n),
                       rng.integers(20, 400, n))  # fmt: skip
    cfg = load_config(None, [f"spec.method={method}", "gpu=a100", "max_num_seqs=16"])
    for slos in (["ttft_p99_s=0.5"], ["ttft_p99_s=1000"]):
        out = []
        for ff in (False, True):
            orig = fleet.SimLoop
            fleet.SimLoop = functools.partial(SimLoop, fast_forward=ff)  # type: ignore[misc]
            try:
                res = simulate_fleet(FleetSpec(cfg, 1, "round-robin"), trace, parse_slos(slos))
            finally:
                fleet.SimLoop = orig  # type: ignore[misc]
            res["sim"].pop("wall_s")
            out.append(res)
        assert out[0] == out[1], slos
        assert (out[0]["stopped"] is None) == (slos == ["ttft_p99_s=1000"])


@pytest.mark.parametrize("k", [3, 1])
def test_spec_fast_forward_is_exact_with_the_penalties_terms(
    tmp_path: Path, traces: dict[str, Path], k: int
) -> None:
    """Verify steps with history rows: the GPU term per history row and the host work in
    `sample` (sim.cost.model: both read history_tokens, which varies step to step)."""
    prof = {
        "version": 1,
        "history_host": {"spec_sample_ms": 1.1},
        "gpu_pass": {"history": {"ms": 0.05, "ms_per_row": 0.002, "verify_ms": 0.1,
                                 "verify_ms_per_row": 0.024}},
    }  # fmt: skip
    path = tmp_path / "pen.json"
    path.write_text(json.dumps(prof))
    sets = ["model=llama3-8b", "spec.method=ngram-gpu", f"spec.k={k}", f"profile={path}"]
    step_dir, _, step_blocks = run_folder(tmp_path, traces["hist"], sets, fast_forward=False)
    ff_dir, skipped, ff_blocks = run_folder(tmp_path, traces["hist"], sets, fast_forward=True)
    assert skipped > 0 and step_blocks == ff_blocks
    for name in ("steps.parquet", "requests.parquet", "gc.parquet"):
        assert_same_tables(step_dir / name, ff_dir / name)
    t = codec.read_table(step_dir / "steps.parquet")
    col = {n: t.column(n).to_numpy(zero_copy_only=False) for n in t.column_names}
    sample = col["sample_end_s"] - col["sample_start_s"]
    hist = (col["history_tokens"] > 0) & (col["draft_tokens"] > 0)
    assert hist.any() and (~hist).any()
    assert np.median(sample[hist]) > np.median(sample[~hist]) + 0.9e-3  # the host's 1.1 ms
