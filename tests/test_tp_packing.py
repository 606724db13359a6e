"""The tensor-parallel step message (engine.Engine._broadcast): a step's sizes, new slots'
sampler state and its host input arrays ride in ONE shared-memory ring slot, and a worker that
uploads them (Engine.serve_step) holds device inputs identical to rank 0's; a step whose arrays
do not fit a slot falls back to the device broadcast, and both kinds of steps mix freely."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import make_cfg

from engine.engine import Engine
from engine.requests import RequestInput
from engine.tp.comm import HEADER_LEN, OP_STEP, Comm
from engine.tp.ring import PAYLOAD_BYTES, HeaderRing, part_offsets

pytestmark = pytest.mark.usefixtures("one_thread")

# sampled with a repetition penalty: a mirror without a new slot's history picks other tokens
PENALTIES = (("temperature", 0.8), ("top_k", 50), ("repetition_penalty", 4.0))


def requests(n: int = 8) -> list[RequestInput]:
    """Prompts of 3..120 tokens (chunked at 64 a step, beside other requests' decodes); every
    third request needs its history (new slots' payload in the same message)."""
    rng = np.random.default_rng(5)
    return [
        RequestInput(
            f"r{i}", int(rng.integers(3, 120)), int(rng.integers(4, 14)), needs_history=i % 3 == 0
        )
        for i in range(n)
    ]


def test_part_offsets_align_each_part_to_8_bytes():
    assert part_offsets([]) == [0]
    assert part_offsets([24, 12, 4, 0, 8]) == [0, 24, 40, 48, 48, 56]


@pytest.fixture
def one_rank_group():
    """A one-rank gloo default group: Comm's host group exists; the step uses only the ring."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_mixed_step_is_one_ring_message_and_the_mirror_rebuilds_identical_inputs(
    one_rank_group,
):
    """Rank 0 (a one-GPU engine given a Comm) and a mirror engine of the same config reading
    its ring as worker rank 1 (`serve_step`, the whole model on both): after every step the
    mirror's uploaded inputs, block table, gathered table rows, input ids and sampled tokens
    equal rank 0's, each step took exactly one ring message, and steps held prefill chunks
    beside decodes, new block-table entries and new slots' histories."""
    cpu = torch.device("cpu")
    ring = HeaderRing.create(1, HEADER_LEN)
    reader = HeaderRing.attach(ring.name, 1, HEADER_LEN, 0, spin_s=0.0002)
    cfg = make_cfg(PENALTIES)
    eng, mirror = Engine(cfg), Engine(cfg)
    eng.tp, mirror.tp = Comm(0, 2, cpu, ring), Comm(1, 2, cpu, reader)
    launch = eng.launch_batch
    seen = {"mixed": 0, "pairs": 0, "inits": 0, "steps": 0}

    def launch_and_mirror(batch, row):
        flight = launch(batch, row)
        seen["steps"] += 1
        assert ring.last == seen["steps"]  # one ring message per step
        h = mirror.tp.recv_header()
        assert int(h[0]) == OP_STEP and int(h[15]) == 1  # the host arrays rode in the slot
        seen["inits"] += int(h[13])
        mirror.serve_step(h)
        a, b = eng.inputs, mirror.inputs
        k, nb, t, g, n = (int(x) for x in (h[1], h[2], h[7], h[4], h[10]))
        m = a.rows_len + a.token_fields * t
        assert torch.equal(a.d_buf[:m], b.d_buf[:m])
        assert torch.equal(a.d_pairs[: 2 * n], b.d_pairs[: 2 * n])
        assert torch.equal(a.block_table, b.block_table)
        assert torch.equal(a.batch_tables[:nb], b.batch_tables[:nb])
        assert torch.equal(a.input_ids[:t], b.input_ids[:t])
        assert torch.equal(eng.outputs.device_tokens[k, :g], mirror.outputs.device_tokens[k, :g])
        prefill = any(e.is_prefill for e in batch.entries)
        seen["mixed"] += prefill and any(not e.is_prefill for e in batch.entries)
        seen["pairs"] += n > 0
        return flight

    eng.launch_batch = launch_and_mirror  # type: ignore[method-assign]
    try:
        eng.run(requests(), arrival="asap")
    finally:
        eng.tp = mirror.tp = None
        reader.close()
        ring.close()
    assert seen["mixed"] and seen["pairs"] and seen["inits"], seen


def test_send_header_refuses_arrays_that_do_not_fit_a_slot(one_rank_group):
    ring = HeaderRing.create(1, HEADER_LEN)
    try:
        comm = Comm(0, 2, torch.device("cpu"), ring)
        big = np.zeros(PAYLOAD_BYTES // 4 + 1, np.int32)
        assert not comm.fits_ring(None, big) and comm.fits_ring(None, big[:-1])
        assert not comm.fits_ring(np.zeros(1, np.int64), big[:-1])
        with pytest.raises(ValueError, match="do not fit a ring slot"):
            comm.send_header(OP_STEP, arrays=(big,))
        assert ring.last == 0  # nothing half-written
    finally:
        ring.close()


@pytest.mark.slow
def test_tp2_with_steps_alternating_ring_and_device_broadcast_equals_tp1():
    """Rank 0 sends every other step's inputs by the device broadcast (as a step too large for
    a slot does): the workers follow each header's flag, and the tokens equal TP 1's."""
    reqs = requests()
    ref = Engine(make_cfg(PENALTIES))
    want = [o.token_ids for o in ref.run(reqs, arrival="asap")]
    eng = Engine(make_cfg(PENALTIES, tensor_parallel_size=2))
    try:
        tp = eng.tp
        assert tp is not None
        fits = tp.fits_ring
        calls = []

        def alternate(payload, *arrays):
            calls.append(len(calls) % 2 == 0 and fits(payload, *arrays))
            return calls[-1]

        tp.fits_ring = alternate  # type: ignore[method-assign]
        got = [o.token_ids for o in eng.run(reqs, arrival="asap")]
    finally:
        eng.close()
    assert got == want
    assert True in calls and False in calls
