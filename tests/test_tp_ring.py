"""The tensor-parallel header ring's payload area (engine.tp.ring): payloads ride in their
header's slot, a reader keeps its slot until its next `recv` (so rank 0 never overwrites a
payload not yet read), and a payload too large for the slot goes over gloo (engine.tp.comm)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.tp.comm import HEADER_LEN, Comm
from engine.tp.ring import SLOTS, HeaderRing

pytestmark = pytest.mark.usefixtures("one_thread")


def header(s: int) -> np.ndarray:
    h = np.zeros(HEADER_LEN, np.int64)
    h[0] = s
    return h


def test_payloads_ride_with_their_headers_across_wraparounds():
    ring = HeaderRing.create(1, HEADER_LEN)
    reader = HeaderRing.attach(ring.name, 1, HEADER_LEN, 0)
    try:
        for s in range(1, 3 * SLOTS):
            ring.send(header(s), lambda: True, np.arange(s % 37, dtype=np.int64) + s)
            assert int(reader.recv()[0]) == s
            assert reader.payload(s % 37).tolist() == list(range(s, s + s % 37))
    finally:
        reader.close()
        ring.close()


def test_a_reader_keeps_its_slot_until_its_next_recv():
    ring = HeaderRing.create(1, HEADER_LEN)
    reader = HeaderRing.attach(ring.name, 1, HEADER_LEN, 0)
    try:
        for s in range(1, SLOTS + 1):
            ring.send(header(s), lambda: True, np.array([s]))
        assert int(reader.recv()[0]) == 1  # header 1 in hand, its payload not read yet
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="worker rank exited"):
            ring.send(header(SLOTS + 1), lambda: False, np.array([-1]))  # slot 1's turn
        assert time.monotonic() - t0 < 5
        assert reader.payload(1).tolist() == [1]  # untouched
        assert int(reader.recv()[0]) == 2  # done with header 1
        ring.send(header(SLOTS + 1), lambda: True, np.array([SLOTS + 1]))
        assert reader.payload(1).tolist() == [2]
    finally:
        reader.close()
        ring.close()


def _rank1(port: int, ring_name: str, q) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=1, world_size=2)
    ring = HeaderRing.attach(ring_name, 1, HEADER_LEN, 0, spin_s=0.0002)
    comm = Comm(1, 2, torch.device("cpu"), ring)
    comm.payload_words = 4
    got = []
    for _ in range(3):
        h = comm.recv_header()
        got.append((int(h[0]), comm.recv_ints(int(h[1])).tolist()))
    q.put(got)
    dist.destroy_process_group()
    comm.ring.close()


def test_a_payload_larger_than_the_slot_goes_over_gloo():
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ring = HeaderRing.create(1, HEADER_LEN)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_rank1, args=(store.port, ring.name, q), daemon=True)
    p.start()
    try:
        dist.init_process_group("gloo", store=store, rank=0, world_size=2)
        comm = Comm(0, 2, torch.device("cpu"), ring)
        comm.payload_words = 4
        sent = [[1, 2, 3], list(range(10, 20)), []]  # in the slot, over gloo, none
        for i, values in enumerate(sent):
            payload = np.asarray(values, np.int64) if values else None
            comm.send_header(i + 1, len(values), payload=payload)
        assert q.get(timeout=120) == [(i + 1, v) for i, v in enumerate(sent)]
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        ring.close()
