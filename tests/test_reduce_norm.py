"""The fused all-reduce + residual add + RMSNorm kernel (engine.kernels.reduce_norm) under the
Triton interpreter, as one rank of a group whose peers have already done their part: their rows
sit in this rank's buffer and their flags are raised. The kernel must push its own rows into
every peer's slot of the region, raise its flag in every peer's array, take the peers' flags in
its own, and return exactly what engine.kernels.rms_norm returns on the sum rounded to the dtype
(checked against a float64 reference too). `test_interp_*` run in a TRITON_INTERPRET=1
subprocess (test_reduce_norm_under_interpreter); the two-GPU run is tests/test_tp_fused_gpu.py."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from helpers import run_interpreter_tests

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET subprocess")
if INTERPRET:  # the kernels are decorated for the interpreter only when it is set
    from engine.kernels.reduce_norm import NUM_REGIONS, reduce_norm
    from engine.kernels.rms_norm import rms_norm
else:
    NUM_REGIONS = 3
FLAG_ROWS = 16
EPS = 1e-5


class Group:
    """Every rank's data area and flags, in this process: rank `me` runs the kernel."""

    def __init__(self, world: int, me: int, rows: int, hidden: int, max_rows: int, dtype):
        self.world, self.me, self.rows, self.hidden, self.max_rows = (
            world,
            me,
            rows,
            hidden,
            max_rows,
        )
        self.slot = max_rows * hidden
        self.data = [
            torch.full((NUM_REGIONS * world * self.slot,), 7.0, dtype=dtype) for _ in range(world)
        ]
        self.flags = [torch.zeros(FLAG_ROWS * world, dtype=torch.int32) for _ in range(world)]
        self.data_ptrs = torch.tensor([d.data_ptr() for d in self.data], dtype=torch.int64)
        self.flag_ptrs = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64)

    def slot_rows(self, owner: int, region: int, src: int) -> torch.Tensor:
        """Rows that rank `src` pushed into rank `owner`'s slot of `region`."""
        at = (region * self.world + src) * self.slot
        return self.data[owner][at : at + self.rows * self.hidden].view(self.rows, self.hidden)

    def peers_arrive(self, region: int, rows: dict[int, torch.Tensor]) -> None:
        """The peers' part of the call: their rows in `me`'s buffer, their flags raised."""
        for src, x in rows.items():
            self.slot_rows(self.me, region, src).copy_(x)
            for t in range(self.rows):
                self.flags[self.me][t * self.world + src] = 1


def reference(
    parts: list[torch.Tensor], residual, weight, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    s = sum(p.double() for p in parts).to(dtype)
    r = s if residual is None else (s.double() + residual.double()).to(dtype)
    normed = (r.double() / torch.sqrt(r.double().pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    return normed.double() * weight.double(), r


@interp_only
@pytest.mark.parametrize(
    "world,me,region,with_residual",
    [(2, 0, 1, True), (2, 1, 0, False), (4, 2, 2, True), (8, 7, 1, True)],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_interp_one_rank_of_the_group(world, me, region, with_residual, dtype):
    rows, hidden, max_rows = 3, 96, 4  # hidden not a power of two: the masked tail
    g = Group(world, me, rows, hidden, max_rows, dtype)
    gen = torch.Generator().manual_seed(world * 10 + me)
    parts = [torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(world)]
    residual = torch.randn(rows, hidden, generator=gen).to(dtype) if with_residual else None
    weight = torch.randn(hidden, generator=gen).to(dtype)
    g.peers_arrive(region, {r: parts[r] for r in range(world) if r != me})
    res_in = None if residual is None else residual.clone()

    out, res_out = reduce_norm(
        parts[me], weight, EPS, res_in, g.data_ptrs, g.flag_ptrs, me, region, max_rows
    )

    for peer in range(world):  # its rows pushed, its flag raised, in every peer's area
        if peer == me:
            continue
        assert torch.equal(g.slot_rows(peer, region, me), parts[me])
        assert g.flags[peer].view(FLAG_ROWS, world)[:rows, me].tolist() == [1] * rows
    assert int(g.flags[me].sum()) == 0  # every peer's flag taken
    untouched = [r for r in range(NUM_REGIONS) if r != region]
    for peer in range(world):
        for r in untouched:
            at = r * world * g.slot
            assert (g.data[peer][at : at + world * g.slot] == 7.0).all()
    summed = parts[0].float()
    for p in parts[1:]:
        summed = summed + p.float()  # rank order, float32: the kernel's order
    want_out, want_res = rms_norm(
        summed.to(dtype), weight, EPS, None if residual is None else residual.clone()
    )
    assert torch.equal(res_out, want_res) and torch.equal(out, want_out)
    if res_in is not None:
        assert res_out is res_in  # the residual stream updated in place
    ref_out, ref_res = reference(parts, residual, weight, dtype)
    tol = 2e-2 if dtype == torch.float16 else 1e-5
    assert (res_out.double() - ref_res.double()).abs().max() <= tol * ref_res.double().abs().max()
    assert (out.double() - ref_out).abs().max() <= tol * ref_out.abs().max()


@interp_only
def test_interp_a_flag_still_raised_from_the_call_before_waits_for_the_peer():
    """The raise is a compare-and-swap 0 -> 1: while a peer has not taken this rank's flag of
    the call before, the kernel spins; here the peer takes it only after a delay, from another
    thread, and the call completes afterwards."""
    world, me, region = 2, 0, 1
    g = Group(world, me, 1, 32, 2, torch.float32)
    x = torch.randn(1, 32)
    g.peers_arrive(region, {1: torch.randn(1, 32)})
    g.flags[1][0 * world + me] = 1  # not taken yet by rank 1
    took = []

    def peer_takes_it_late() -> None:
        time.sleep(0.5)
        took.append(time.monotonic())
        g.flags[1][0 * world + me] = 0

    t = threading.Thread(target=peer_takes_it_late)
    t.start()
    reduce_norm(x, torch.ones(32), EPS, None, g.data_ptrs, g.flag_ptrs, me, region, 2)
    done = time.monotonic()
    t.join()
    assert took and done >= took[0]
    assert int(g.flags[1][me]) == 1  # raised again, for this call


@pytest.mark.skipif(INTERPRET, reason="the parent of the interpreter run")
def test_reduce_norm_under_interpreter():
    run_interpreter_tests(__file__, timeout_s=600, program_id_loops=False)
