"""The step header's transport: a single-producer ring of fixed-size int64 headers in shared
memory, rank 0 writing, every worker rank reading each header once (vLLM V1 broadcasts its
scheduler output to the workers through a shared-memory ring too; a gloo broadcast of the same
16 values cost rank 0 0.3 ms p50 and several ms p90 on a loaded host).

Layout (int64 words): one read counter per reader, each on its own 64-byte line, then SLOTS
slots of [seq, HEADER_LEN values] padded to whole lines, then SLOTS payload areas of
PAYLOAD_WORDS int64 values (a step's new slots' sampler state, then its host input arrays:
engine.Engine._broadcast; each part starts on an 8-byte boundary; a larger payload goes over
gloo or, inputs, a device broadcast, engine.tp.comm). Header number s (1, 2, ...) goes to slot
s % SLOTS: rank 0 writes the payload, the values, then seq = s; a reader waiting for header s
spins until the slot's seq is s and copies the values; it reads the payload (`payload`) before
its next `recv`, which stores s in its read counter (the reader is done with slot s). Rank 0
writes header s only once every reader is done with header s - SLOTS (readers are at most a
few steps behind: each step's collectives make rank 0 wait for them on the device).

The protocol relies on stores becoming visible in program order and loads not passing loads
(x86's TSO, which the GPU hosts are); numpy stores an aligned int64 in one instruction.

Waits: a reader spins (yielding the core) for `spin_s` (CUDA ranks: IDLE_S; CPU ranks, which
share the host's cores with rank 0's compute: SPIN_CPU_S), then sleeps SLEEP_S between looks
(an idle engine costs no core; a step after an idle spell starts up to SLEEP_S late); rank 0
waiting for a slot checks `alive()` every second and
raises once a worker is gone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np

SLOTS = 64
LINE = 8  # int64 words per 64-byte line
PAYLOAD_WORDS = 16384  # int64 values of payload per slot (128 KiB; 8 MiB for the ring): an
# 8192-token step's host input arrays (about 100 KB) fit one slot
PAYLOAD_BYTES = 8 * PAYLOAD_WORDS
IDLE_S = 0.5  # a CUDA rank that saw no header for this long sleeps between looks
SPIN_CPU_S = 0.0002
SLEEP_S = 0.0005


def _slot_words(header_len: int) -> int:
    return -(-(1 + header_len) // LINE) * LINE


def part_offsets(nbytes: list[int]) -> list[int]:
    """Byte offsets of payload parts of `nbytes` bytes laid back to back in a slot's area, each
    on an 8-byte boundary, then the end of the last (the bytes the parts need)."""
    out, at = [], 0
    for n in nbytes:
        out.append(at)
        at += -(-n // 8) * 8
    out.append(at)
    return out


class HeaderRing:
    def __init__(self, shm: shared_memory.SharedMemory, readers: int, header_len: int,
                 reader: int, owner: bool, spin_s: float = IDLE_S) -> None:  # fmt: skip
        """Use `create` (rank 0) or `attach` (worker `reader`, 0-based)."""
        self.shm, self.readers, self.header_len, self.reader = shm, readers, header_len, reader
        self.owner, self.spin_s = owner, spin_s
        words = np.ndarray((len(shm.buf) // 8,), dtype=np.int64, buffer=shm.buf)
        self._reads = words[: readers * LINE : LINE]  # reader i's counter at word i * LINE
        sw = _slot_words(header_len)
        base = readers * LINE
        self._slots = words[base : base + SLOTS * sw].reshape(SLOTS, sw)
        self._seq = self._slots[:, 0]
        self._values = self._slots[:, 1 : 1 + header_len]
        base += SLOTS * sw
        self._payload = words[base : base + SLOTS * PAYLOAD_WORDS].reshape(SLOTS, PAYLOAD_WORDS)
        self._payload_bytes = self._payload.view(np.uint8)  # [SLOTS, PAYLOAD_BYTES]
        self.last = 0  # headers written (rank 0) or read (a reader)
        self.out = np.zeros(header_len, dtype=np.int64)  # a reader's copy of the last header

    @staticmethod
    def size_bytes(readers: int, header_len: int) -> int:
        return 8 * (readers * LINE + SLOTS * (_slot_words(header_len) + PAYLOAD_WORDS))

    @classmethod
    def create(cls, readers: int, header_len: int) -> HeaderRing:
        shm = shared_memory.SharedMemory(create=True, size=cls.size_bytes(readers, header_len))
        np.ndarray((len(shm.buf),), dtype=np.uint8, buffer=shm.buf)[:] = 0
        return cls(shm, readers, header_len, -1, owner=True)

    @classmethod
    def attach(
        cls, name: str, readers: int, header_len: int, reader: int, spin_s: float = IDLE_S
    ) -> HeaderRing:
        shm = shared_memory.SharedMemory(name=name)
        return cls(shm, readers, header_len, reader, False, spin_s)

    @property
    def name(self) -> str:
        return self.shm.name

    # ---- rank 0 --------------------------------------------------------------------------------
    def send(
        self,
        values: np.ndarray,
        alive: Callable[[], bool],
        payload: np.ndarray | None = None,
        parts: tuple[np.ndarray, ...] = (),
    ) -> None:
        """Write the next header (HEADER_LEN int64 values) and its `payload` (int64 values),
        then `parts` (contiguous arrays of any dtype) after it at `part_offsets` (all together
        at most PAYLOAD_BYTES; the header tells the readers their lengths); waits only while a
        reader is SLOTS headers behind. Raises RuntimeError when `alive()` says a reader is
        gone."""
        s = self.last + 1
        if s > SLOTS and int(self._reads.min()) < s - SLOTS:
            self._wait_for_readers(s - SLOTS, alive)
        k = s % SLOTS
        if payload is not None:
            self._payload[k, : len(payload)] = payload
        if parts:
            area = self._payload_bytes[k]
            head = [0 if payload is None else 8 * len(payload)]
            at = part_offsets(head + [p.nbytes for p in parts])[1:-1]
            for p, a in zip(parts, at, strict=True):
                area[a : a + p.nbytes] = p.view(np.uint8)
        self._values[k] = values
        self._seq[k] = s  # after the values: a reader that sees s sees them
        self.last = s

    def _wait_for_readers(self, seq: int, alive: Callable[[], bool]) -> None:
        check = time.monotonic() + 1.0
        while int(self._reads.min()) < seq:
            os.sched_yield()
            if time.monotonic() > check:
                if not alive():
                    raise RuntimeError("a tensor-parallel worker rank exited")
                check = time.monotonic() + 1.0

    # ---- readers -------------------------------------------------------------------------------
    def recv(self) -> np.ndarray:
        """Wait for the next header; returns `out` (valid until the next recv). Done with the
        previous header (and its payload): rank 0 may write its slot again."""
        s = self.last + 1
        self._reads[self.reader] = s - 1
        k = s % SLOTS
        seq = self._seq
        if seq[k] != s:
            idle_at = time.monotonic() + self.spin_s
            while seq[k] != s:
                if time.monotonic() < idle_at:
                    os.sched_yield()
                else:
                    time.sleep(SLEEP_S)
        self.out[:] = self._values[k]
        self.last = s
        return self.out

    def payload(self, n: int) -> np.ndarray:
        """A copy of the last header's first `n` payload values (n <= PAYLOAD_WORDS)."""
        return self._payload[self.last % SLOTS, :n].copy()

    def part(self, offset: int, n: int, dtype: np.dtype) -> np.ndarray:
        """A view (no copy) of `n` values of `dtype` at byte `offset` of the last header's
        payload area (`send`'s `parts`), valid until the next recv."""
        nbytes = n * np.dtype(dtype).itemsize
        return self._payload_bytes[self.last % SLOTS, offset : offset + nbytes].view(dtype)

    def close(self) -> None:
        """Detach (and, rank 0, remove the segment). Idempotent."""
        if self.shm is None:
            return
        self._reads = self._slots = self._seq = self._values = None  # type: ignore[assignment]
        self._payload = self._payload_bytes = None  # type: ignore[assignment]
        shm, self.shm = self.shm, None
        shm.close()
        if self.owner:
            shm.unlink()
