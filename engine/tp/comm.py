"""One rank's view of the tensor-parallel group: the collectives of the model and of the step.

The default process group (NCCL on CUDA, gloo on CPU) carries device tensors (the model's
all-reduces and logits gather; a step's input buffers only when their host arrays do not fit a
ring slot). Host messages from rank 0: a fixed-size int64 header per step or command
(`HEADER_LEN` values) through a shared-memory ring (engine.tp.ring) with, when the header
announces them, a variable-length int64 payload and host arrays (a step's inputs) in the same
ring slot (the payload over a gloo group when larger than the slot's area), and now and then a
pickled object over the gloo group. Every rank issues the same collectives in the
same order (the worker loop mirrors rank 0's step), so NCCL kernels captured in CUDA graphs pair
up on replay.

No call here waits for the device: NCCL collectives are enqueued in the compute stream's order
(the calling stream waits for them on the device, not on the host); the header and a step's
host arrays are shared-memory stores (a few KB for decode), which is the `broadcast` phase's
cost on rank 0.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bubblesim.core.collectives import oneshot_max_bytes
from engine.tp.ring import PAYLOAD_WORDS, HeaderRing, part_offsets
from engine.tp.watchdog import SHUTDOWN_S, deadline

HEADER_LEN = 17  # op, a step's 15 sizes, rank 0's hooks row of the step (Engine._broadcast)
# the host group waits for rank 0's next message as long as the engine lives (idle engines,
# long arrivals gaps): its timeout only ends workers whose rank 0 vanished without a word
HOST_TIMEOUT = timedelta(hours=24)
# torch >= 2.12 names it all_gather_single; older releases all_gather_into_tensor (same call)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# commands in header[0]
OP_STEP, OP_ENGINE, OP_END_ENGINE, OP_WARM_FORWARDS, OP_SHUTDOWN, OP_RANK_TIMES = range(1, 7)
# OP_RANK_TIMES's header[1]: the workers start their launch record, or send it (ranktimes.py)
RANK_TIMES_START, RANK_TIMES_GATHER = 0, 1


def _slot_bytes(payload: np.ndarray | None, arrays: tuple[np.ndarray, ...]) -> int:
    """Bytes of a ring slot's area that an int64 `payload` then `arrays` take (ring.send)."""
    head = [0 if payload is None else 8 * len(payload)]
    return part_offsets(head + [a.nbytes for a in arrays])[-1]


class Comm:
    """Built on every rank after `dist.init_process_group` (same order everywhere)."""

    def __init__(self, rank: int, size: int, device: torch.device, ring: HeaderRing) -> None:
        """`ring`: the header ring, created by rank 0 (`HeaderRing.create`), attached by the
        workers."""
        self.rank, self.size, self.device = rank, size, device
        self.host_group = dist.new_group(backend="gloo", timeout=HOST_TIMEOUT)
        self.ring = ring
        self.payload_words = PAYLOAD_WORDS  # a larger payload goes over gloo (same on all ranks)
        self.header_np = np.zeros(HEADER_LEN, dtype=np.int64)
        self.workers = None  # rank 0: engine.tp.workers.Workers (the processes it started)
        # rank 0: the engines built on this group; their CUDA graphs go before the group does
        self.engines: weakref.WeakSet = weakref.WeakSet()
        # a step past its deadline (engine.tp.watchdog): rank 0 kills the workers, a worker exits
        self.on_expiry: Callable[[], None] | None = None
        self.peers_alive: Callable[[], bool] | None = None  # rank 0: every worker still runs
        self.oneshot: OneShot | None = None  # the model's small all-reduces (use_allreduce)
        self._oneshot_buffer: OneShot | None = None  # kept across engines once exchanged
        self.fused: ReduceNorm | None = None  # all-reduce + residual add + norm (use_allreduce)
        self._fused_buffer: ReduceNorm | None = None  # kept across engines once exchanged

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # ---- the model's collectives (device group) ----------------------------------------------
    def use_allreduce(self, algorithm: str, dtype: torch.dtype) -> None:
        """Every rank, in the same order (an engine's build, before its graphs are captured):
        the model's all-reduces of `dtype` take `algorithm` (config key tp_allreduce,
        bubblesim.core.collectives). The first "oneshot" allocates this rank's symmetric-memory
        buffer and exchanges its handle with the peers (collective); later engines reuse it.
        Without CUDA symmetric memory (the CPU, gloo) "oneshot" falls back to the process
        group's all-reduce and says so once."""
        max_bytes = oneshot_max_bytes(algorithm, self.size)
        self.oneshot = self.fused = None
        if max_bytes == 0:
            return
        if self.device.type != "cuda" or not OneShot.available():
            if self.rank == 0 and algorithm not in _warned:
                _warned.add(algorithm)
                print(f"tp_allreduce={algorithm}: no CUDA symmetric memory here; using the "
                      "process group's all-reduce")  # fmt: skip
            return
        if algorithm == "fused":
            have_f = self._fused_buffer
            if have_f is None or have_f.dtype != dtype or have_f.max_bytes < max_bytes:
                have_f = ReduceNorm(self.device, self.rank, self.size, dtype, max_bytes)
                self._fused_buffer = have_f
                if self.rank == 0:
                    _symmetric_groups.append(weakref.ref(self))
            self.fused = have_f
            return
        have = self._oneshot_buffer
        if have is None or have.dtype != dtype or have.max_bytes < max_bytes:
            have = self._oneshot_buffer = OneShot(self.device, dtype, max_bytes)
            if self.rank == 0:
                _symmetric_groups.append(weakref.ref(self))
        self.oneshot = have

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks: the one-shot kernel's new tensor for a small enough message of its
        dtype (use_allreduce), else NCCL's ring in place. Callers use the returned tensor."""
        one = self.oneshot
        if one is not None and one.takes(x):
            return one(x)
        dist.all_reduce(x)
        return x

    def reduce_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, region: int, norm: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum over ranks of the partial `x`, then `norm` (an engine.model.RMSNorm: its
        residual add and norm, (normed, new residual)): in one kernel with tp_allreduce "fused"
        for a small enough message (`region`: engine.kernels.reduce_norm's buffer region), else
        the all-reduce (all_reduce) then `norm.normalize`."""
        fused = self.fused
        if fused is not None and fused.takes(x, residual):
            return fused(x, residual, region, norm.weight, norm.eps)
        return norm.normalize(self.all_reduce(x), residual)

    def gather_vocab(self, x: torch.Tensor, vocab: int) -> torch.Tensor:
        """Every rank's logits slice [n, Vr] -> the whole rows [n, vocab] on every rank."""
        n, vr = x.shape
        out = torch.empty((self.size * n, vr), dtype=x.dtype, device=x.device)
        _all_gather(out, x.contiguous())
        full = out.view(self.size, n, vr).permute(1, 0, 2).reshape(n, self.size * vr)
        return full if self.size * vr == vocab else full[:, :vocab].contiguous()

    def broadcast_device(self, x: torch.Tensor) -> None:
        """Rank 0's contiguous device tensor into every rank's `x` (enqueued, no host wait)."""
        dist.broadcast(x, src=0)

    # ---- host messages (gloo group) -----------------------------------------------------------
    def fits_ring(self, payload: np.ndarray | None, *arrays: np.ndarray) -> bool:
        """Whether `payload` (int64) and `arrays` fit one ring slot together (`send_header`)."""
        return _slot_bytes(payload, arrays) <= 8 * self.payload_words

    def send_header(
        self, *values: int, payload: np.ndarray | None = None, arrays: tuple[np.ndarray, ...] = ()
    ) -> None:
        """Rank 0: header = values (the rest zero), to every rank, with an int64 `payload`
        whose length the header announces (the workers' `recv_ints`): in the header's ring
        slot when it fits (`payload_words`), else over gloo after the header; and contiguous
        host `arrays` after the payload in the same slot (the workers' `recv_arrays`; the
        caller checked `fits_ring`)."""
        h = self.header_np
        h[:] = 0
        h[: len(values)] = values
        fits = payload is None or len(payload) <= self.payload_words
        if arrays and not (fits and _slot_bytes(payload, arrays) <= 8 * self.payload_words):
            raise ValueError("send_header: the arrays do not fit a ring slot (check fits_ring)")
        self.ring.send(h, self._workers_alive, payload if fits else None, arrays)
        if not fits:
            dist.broadcast(torch.from_numpy(np.ascontiguousarray(payload, np.int64)), src=0,
                           group=self.host_group)  # fmt: skip

    def _workers_alive(self) -> bool:
        w = self.workers
        return w is None or all(p.is_alive() for p in w.procs)

    def recv_header(self) -> np.ndarray:
        """Workers: wait for rank 0's next header; returns it (valid until the next)."""
        return self.ring.recv()

    def recv_ints(self, n: int) -> np.ndarray:
        """Workers: the last header's payload of `n` values (`send_header`), before the next
        `recv_header`."""
        if n <= self.payload_words:
            return self.ring.payload(n)
        t = torch.empty(n, dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.host_group)
        return t.numpy()

    def recv_arrays(self, payload_len: int, *shapes: tuple[int, np.dtype]) -> list[np.ndarray]:
        """Workers: views (no copies; valid until the next `recv_header`) of the last header's
        host arrays of (length, dtype) `shapes`, after its int64 payload of `payload_len`
        values (`send_header`'s `arrays`)."""
        sizes = [8 * payload_len] + [n * np.dtype(dt).itemsize for n, dt in shapes]
        at = part_offsets(sizes)[1:-1]
        return [self.ring.part(a, n, dt) for a, (n, dt) in zip(at, shapes, strict=True)]

    def send_object(self, obj: object) -> None:
        dist.broadcast_object_list([obj], src=0, group=self.host_group)

    def recv_object(self) -> object:
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self.host_group)
        return box[0]

    def gather_object(self, obj: object) -> list[object] | None:
        """Every rank's `obj` in rank order on rank 0 (None on the workers); all ranks call it."""
        out: list[object] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.host_group)
        return out

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (all ranks call it)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group)
        return int(t.item())

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Rank 0: destroy the CUDA graphs of every engine built on this group (an engine not
        closed yet still holds them, and NCCL's destroy waits for them), stop the workers and
        leave the group together with them (engine.tp.workers: Workers.stop). Idempotent.
        Raises engine.tp.watchdog.StepTimeout naming the step when a teardown step hangs."""
        if self.workers is None:
            return
        workers, self.workers = self.workers, None
        try:
            with deadline("rank 0: drop the engines' CUDA graphs", SHUTDOWN_S, workers.kill):
                for engine in list(self.engines):
                    engine.release_graphs()
            workers.stop(self)
        finally:
            self.ring.close()


_warned: set[str] = set()  # the algorithms whose CPU fallback was announced
# rank 0: the group whose symmetric memory this process exchanged (at most one: check_symmetric)
_symmetric_groups: list[weakref.ref] = []


def check_symmetric(comm: Comm | None) -> None:
    """Rank 0, before an engine with tp_allreduce oneshot or fused (both exchange symmetric
    memory) tells its workers anything: refuse a
    second tensor-parallel group in one process. On 2 x H100 (torch 2.11, 2026-11-26) the first
    group's one-shot engine ran and closed, but the next group's symmetric-memory exchange in
    the same process never returned (test and bench both hung there): torch keeps the first
    group's registration under a group name the next group reuses. An engine on the same
    group (replay's shared model) is fine. Raises ValueError naming the key."""
    if any(comm is None or r() is not comm for r in _symmetric_groups):
        raise ValueError(
            "config key 'tp_allreduce': oneshot and fused serve one tensor-parallel group per "
            "process (a second group's symmetric-memory exchange hangs under torch 2.11); start "
            "a new process, or use nccl"
        )


class OneShot:
    """A one-shot all-reduce through torch symmetric memory (torch.ops.symm_mem): each rank
    copies its message into its buffer, every rank waits at a cross-GPU barrier, reads the
    message from every peer's buffer over NVLink and sums, then a second barrier says every
    peer is done reading, so the one buffer is free for the next call. One kernel, one launch:
    capturable in a CUDA graph (the buffer's address is fixed for the group's lifetime)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, max_bytes: int) -> None:
        self.dtype, self.max_bytes = dtype, max_bytes
        self.buffer, _ = _symmetric_buffer(device, dtype, max_bytes // dtype.itemsize)
        group = dist.group.WORLD
        assert group is not None
        self.group_name = group.group_name

    @staticmethod
    def available() -> bool:
        ops = getattr(torch.ops, "symm_mem", None)
        return torch.cuda.is_available() and hasattr(ops, "one_shot_all_reduce_copy")

    def takes(self, x: torch.Tensor) -> bool:
        return (
            x.dtype == self.dtype
            and x.numel() * x.element_size() <= self.max_bytes
            and x.is_contiguous()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(
            self.buffer[:n], x.view(-1), "sum", self.group_name
        )
        return out.view(x.shape)


def _symmetric_buffer(device: torch.device, dtype: torch.dtype, numel: int):
    """This rank's symmetric-memory tensor of `numel` elements and its handle (collective:
    every rank of the default group, in the same order)."""
    from torch.distributed import _symmetric_memory as symm_mem

    group = dist.group.WORLD
    assert group is not None
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # older releases must be told; newer ones warn that it is moot
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group.group_name)
    buffer = symm_mem.empty(numel, dtype=dtype, device=device)
    return buffer, symm_mem.rendezvous(buffer, group.group_name)


class ReduceNorm:
    """The all-reduce fused with the residual add and RMSNorm after it
    (engine.kernels.reduce_norm): each rank pushes its partial rows into the peers'
    symmetric-memory buffers, meets them at a per-row cross-GPU barrier and sums locally.
    One symmetric allocation per rank: int32 flags [MAX_ROWS_LIMIT, W] (zeroed before the
    peers may raise them), then the data area [regions, W, max_rows, hidden] of the dtype."""

    MAX_ROWS_LIMIT = 1024  # flag rows: the most rows (programs) one call may take

    def __init__(
        self, device: torch.device, rank: int, world: int, dtype: torch.dtype, max_bytes: int
    ) -> None:
        """Collective: every rank of the default (NCCL) group, in the same order."""
        from engine.kernels.reduce_norm import NUM_REGIONS

        self.dtype, self.max_bytes = dtype, max_bytes
        self.rank, self.world = rank, world
        flag_bytes = self.MAX_ROWS_LIMIT * world * 4
        data_bytes = NUM_REGIONS * world * max_bytes
        words = (flag_bytes + data_bytes + 3) // 4
        self.buffer, handle = _symmetric_buffer(device, torch.int32, words)
        self.buffer[: flag_bytes // 4].zero_()
        torch.cuda.synchronize(device)
        dist.barrier()  # every rank's flags are zero before anyone raises one
        offset = self.buffer.data_ptr() - handle.buffer_ptrs[self.rank]  # the same on every rank
        bases = [p + offset for p in handle.buffer_ptrs]
        self.handle = handle  # keeps the peers' mappings alive
        self.flag_ptrs = torch.tensor(bases, dtype=torch.int64, device=device)
        self.data_ptrs = torch.tensor([b + flag_bytes for b in bases], dtype=torch.int64,
                                      device=device)  # fmt: skip

    def takes(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        rows, hidden = x.shape
        return (
            x.dtype == self.dtype
            and 0 < rows <= self.MAX_ROWS_LIMIT
            and rows * hidden * x.element_size() <= self.max_bytes
            and x.stride(1) == 1
            and (residual is None or residual.is_contiguous())
        )

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, region: int,
        weight: torch.Tensor, eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        from engine.kernels.reduce_norm import reduce_norm

        max_rows = self.max_bytes // (x.shape[1] * x.element_size())
        return reduce_norm(x, weight, eps, residual, self.data_ptrs, self.flag_ptrs, self.rank,
                           region, max_rows)  # fmt: skip
