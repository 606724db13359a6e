"""`replay shapes` samples run the engine's own step (replay.gpu.shapes_step), on CPU with the tiny
model: a synthetic step gives the tokens the engine's loop gives for the same requests, records
the phases and the GPU marks of a run's step, sets up new rows' slots inside the step and held
rows' outside it, and drives the spec decoder's verification with drafts; the engine methods the
sweep uses (launch_batch, hold_slot, release_slot, reset_requests, graph_bucket) leave a real
run unchanged.
"""

from __future__ import annotations

import helpers
import numpy as np
import pytest
import torch

from bubblesim.core.config import Config
from engine.engine import Engine
from engine.hooks import PHASE
from engine.inputs import SEQ_LENS
from engine.requests import RequestInput
from replay.analysis.shapes_grid import Batch, Entry
from replay.gpu.shapes_step import MarkHooks, StageError, stage
from replay.gpu.spintimer import SPIN_MARGIN, SPIN_PAD_MS, spin_size

pytestmark = pytest.mark.usefixtures("one_thread")


def make_cfg(**kw) -> Config:
    """The shared tiny CPU config with this file's token budget (128)."""
    return helpers.make_cfg(**{"max_num_batched_tokens": 128, **kw})


def sweep_engine(cfg: Config) -> tuple[Engine, MarkHooks]:
    eng = Engine(cfg)
    eng.hooks = marks = MarkHooks(eng.device)
    return eng, marks


PROMPTS = (37, 21, 50)  # none a multiple of the block size: a decode row keeps the same blocks


def test_synthetic_steps_give_the_engines_tokens():
    """A fresh-prefill batch, then a decode batch of the same requests (same keys, so the same
    synthetic prompts; the same block ids and slots, so the decode reads the prefill's KV and
    last sampled tokens): the tokens equal a normal run's first and second tokens."""
    cfg = make_cfg()
    with torch.no_grad():
        ref = Engine(cfg).run([RequestInput(f"r{i}", p, 2) for i, p in enumerate(PROMPTS)])
        eng, marks = sweep_engine(cfg)
        pre = stage(eng, Batch("prefill", tuple(Entry(0, p, True) for p in PROMPTS)))
        assert pre.new_rows == [0, 1, 2] and pre.bucket == 0 and not pre.wrapped
        pre.before()
        flight = pre.launch()
        first = eng.outputs.tokens(flight.ring, flight.num_gen).tolist()
        pre.after()
        assert all(st.slot < 0 for st in eng.states)  # new rows gave their slots back
        dec = stage(eng, Batch("decode", tuple(Entry(p, 1, False) for p in PROMPTS)))
        assert dec.new_rows == [] and [st.slot for st in eng.states] == [0, 1, 2]
        dec.before()
        flight = dec.launch()
        second = eng.outputs.tokens(flight.ring, flight.num_gen).tolist()
    assert first == [o.token_ids[0] for o in ref]
    assert second == [o.token_ids[1] for o in ref]
    assert marks.marks == 2 and marks.end_ns > marks.begin_ns > 0
    shape = dec.sched_batch.shape
    assert (shape.num_reqs, shape.decode_tokens, shape.new_reqs) == (3, 3, 0)
    assert shape.kv_read_tokens == sum(PROMPTS) + 3 and shape.context_tokens == sum(PROMPTS) + 3


def test_a_launch_records_a_run_steps_phases_and_repeats_cleanly():
    cfg = make_cfg()
    eng, marks = sweep_engine(cfg)
    batch = Batch("prefill+decode", (Entry(99, 1, False), Entry(40, 24, True, hit=True)))
    with torch.no_grad():
        st = stage(eng, batch)
        assert st.new_rows == [1]  # the prefix hit is a new request: its slot in the step
        shape = st.sched_batch.shape
        assert (shape.new_reqs, shape.prefill_tokens, shape.max_kv_tokens) == (1, 24, 100)
        for _ in range(3):
            st.before()
            st.launch()
            st.after()
    rows = eng.hooks.num_steps
    assert rows == 3 and marks.marks == 3
    ph = np.frombuffer(eng.hooks._phase, np.int64)[: rows * len(PHASE) * 2].reshape(rows, -1, 2)
    for name in ("prepare_inputs", "launch", "sample"):
        assert (ph[:, PHASE[name], 0] > 0).all(), name
    assert eng.inputs.d_rows[SEQ_LENS, :2].tolist() == [100, 64]
    # row 0 opens a block each step: its last block is sent again, after a first launch that
    # sent them all (the device block table holds the row's whole list)
    held = eng.states[0]
    assert st.crossing == [0] and eng.inputs.sent_blocks[held.slot] == 7
    assert eng.inputs.block_table[held.slot, :7].tolist() == held.req.block_ids
    # the held row keeps its slot, its output list holds no placeholder after a launch
    assert eng.states[0].slot >= 0 and eng.states[1].slot < 0
    assert len(eng.states[0].output) == st.base_outputs[0] == 1
    assert not eng.inflight


def test_rows_get_the_cache_and_share_it_when_it_is_short():
    cfg = make_cfg(num_kv_blocks=12, block_size=16)
    eng, _ = sweep_engine(cfg)
    st = stage(eng, Batch("decode", (Entry(99, 1, False), Entry(99, 1, False))))
    assert st.wrapped and st.kv_blocks == 14  # 7 + 7 blocks > 12: ids repeat
    ids = [st.sched_batch.entries[i].req.block_ids for i in range(2)]
    assert ids[1][:5] == [7, 8, 9, 10, 11] and ids[1][5:] == [0, 1]
    st = stage(eng, Batch("decode", (Entry(60, 1, False),) * 2))
    assert not st.wrapped and st.kv_blocks == 8
    eng.sched.check_invariants()
    with pytest.raises(StageError, match="KV blocks"):
        stage(eng, Batch("decode", (Entry(400, 1, False),)))


@pytest.mark.parametrize("method", ["ngram-gpu", "ngram-cpu"])
def test_verification_rows_carry_their_drafts(method):
    cfg = make_cfg().replace(**{"spec.method": method, "spec.k": 3})
    eng, marks = sweep_engine(cfg)
    assert eng.sd is not None
    rows = (Entry(80, 4, False, 3), Entry(50, 2, False, 1), Entry(0, 20, True))
    with torch.no_grad():
        st = stage(eng, Batch("verify", rows))
        assert [e.num_drafts for e in st.sched_batch.entries] == [3, 1, 0]
        assert st.sched_batch.shape.draft_tokens == 4 and st.bucket == 0
        for _ in range(3):
            st.before()
            flight = st.launch()
            st.after()
    counts = eng.sd.counts.counts(flight.ring, flight.num_gen)
    if method == "ngram-gpu":  # held rows' device token lists grow by one launch, not three
        slot = eng.states[0].slot
        known = 81  # 80 prompt tokens + 1 output
        assert known < int(eng.sd.gpu_proposer.num_tokens[slot]) <= known + 4
    assert list(counts[:2]) >= [1, 1] and counts[0] <= 4 and counts[1] <= 2
    if method == "ngram-cpu":  # the drafts went in as input ids
        ids = eng.inputs.h_toks[flight.ring][:27].numpy()
        assert ids[1:4].tolist() == st.cpu_drafts[0] and ids[5] == st.cpu_drafts[1][0]
    assert marks.marks == 3


def test_the_loop_is_unchanged_by_the_sweeps_engine_methods():
    """`step` through launch_batch gives the same record as before; graph_bucket is the rule
    _prepare uses; reset_requests leaves an engine that runs a trace again, same tokens."""
    cfg = make_cfg()
    eng = Engine(cfg)
    inputs = [RequestInput(f"r{i}", 10 + 7 * i, 5) for i in range(5)]
    with torch.no_grad():
        a = [o.token_ids for o in eng.run(inputs)]
        eng.reset_requests()
        assert eng.states == [] and not eng.sched.has_unfinished
        i = eng.add_request(RequestInput("held", 9, 2))
        eng.hold_slot(i)
        assert eng.states[i].slot == 0 and eng.slots.free[0] == 1
        eng.release_slot(i)
        assert eng.states[i].slot < 0 and eng.slots.free[0] == 0
        eng.reset_requests()
        b = [o.token_ids for o in eng.run(inputs)]
    assert a == b and all(len(t) == 5 for t in a)
    trace = eng.trace
    assert (trace.gpu_ns[:, 1] >= trace.gpu_ns[:, 0]).all() and trace.num_steps >= 5
    assert eng.graph_bucket(trace.shapes[-1]) == 0  # no graphs on CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sample_equals_a_run_steps_clean_interval():
    """A run at depth 2 of 16 requests decoding after a 1000-token prompt, against a sweep
    sample of the same batch (16 decode rows at the run's middle context) in the same engine:
    the sample holds what the run's clean intervals hold (input copy, finishing, graph with
    sampling, token copy), within 10 %. Clean as replay.analysis.steps says: the GPU began the step
    after the host had ended `sample` (llama3.2-1b, random weights: its decode pass outlasts
    the host's step, so most steps are)."""
    from replay.gpu.shapes import Timer

    cfg = Config(
        model="llama3.2-1b",
        device="cuda",
        max_num_seqs=16,
        max_num_batched_tokens=2048,
        max_model_len=2048,
        batches_in_flight=2,
        gc_freeze=False,
    )
    eng = Engine(cfg)
    with torch.no_grad():
        eng.run([RequestInput(f"r{i}", 1000, 65) for i in range(16)])
        tr = eng.trace
        sample_end = tr.phase_ns[:, PHASE["sample"], 1]
        rows = [
            i
            for i, s in enumerate(tr.shapes)
            if s.num_reqs == 16 and s.num_prefill_reqs == 0 and tr.gpu_ns[i, 0] >= sample_end[i]
        ]
        run_ms = float(np.median((tr.gpu_ns[rows, 1] - tr.gpu_ns[rows, 0]) / 1e6))
        eng.hooks = marks = MarkHooks(eng.device)
        st = stage(eng, Batch("decode", (Entry(1031, 1, False),) * 16))
        assert st.bucket == 16
        timer = Timer.create(True)
        timer.launch(st, marks)
        timer.note_issue("graph", timer.launch(st, marks))
        got = [timer.sample(st, marks, "graph")[0] for _ in range(7)]
    ms = float(np.median([s.gpu_ms for s in got if s is not None]))
    assert len(rows) >= 20 and abs(ms / run_ms - 1) < 0.10, (ms, run_ms, len(rows))


def test_one_long_issue_does_not_size_the_next_shapes_spins() -> None:
    """The first try's spin outlasts the path's largest recent issue, capped by the primed
    shape's own: after a seconds-long issue, a 60 ms shape spins ~90 ms, not seconds."""
    assert spin_size(4600.0, 60.0) == SPIN_MARGIN * 60.0 + SPIN_PAD_MS
    assert spin_size(50.0, 4600.0) == SPIN_MARGIN * 50.0 + SPIN_PAD_MS  # a compile: history
    assert spin_size(50.0, None) == SPIN_MARGIN * 50.0 + SPIN_PAD_MS
