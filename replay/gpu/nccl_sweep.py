"""Time torch.distributed all_reduce over message sizes on N local GPUs (`python -m replay
allreduce`), for the simulator's collective model (replay/analysis/allreducefit.py fits it).

Per world size n: n spawned processes, one GPU each, one NCCL process group over TCP on
localhost (gloo on the CPU for the tests: times are then meaningless, the plumbing is not).
Per message size, in each mode:
  graph  `iters` all-reduces captured in one CUDA graph and replayed, as the engine's decode
         graphs hold them (no launch cost per call);
  eager  `iters` all-reduces launched back to back (mixed steps run eagerly);
  oneshot  as graph, through the engine's one-shot kernel over symmetric memory
         (engine.tp.comm.OneShot, config key tp_allreduce), on the sizes the shared rule sends
         to it (bubblesim.core.collectives); before timing, each size's one-shot sum of
         rank-seeded random values is checked against NCCL's on every rank (a mismatch fails
         the mode with a note);
  fused  as graph, through the all-reduce fused with the residual add and RMSNorm
         (engine.tp.comm.ReduceNorm, tp_allreduce "fused") on [bytes / (FUSED_HIDDEN x elem),
         FUSED_HIDDEN] (one row of bytes / elem below that), checked the same way against
         NCCL's sum then the same norm.
A sample: barrier, synchronize, time the `iters` calls (CUDA events; perf_counter on the CPU),
synchronize; the sample's per-call time is the slowest rank's (an all-reduce MAX of the ranks'
times). One untimed sample first (NCCL sets up its channels, the graph is captured). Rank 0
keeps the median of `samples` samples. A mode that fails (graph capture of NCCL calls needs
NCCL >= 2.9.6) leaves no rows and a note, the other mode goes on.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bubblesim.core.collectives import oneshot_max_bytes
from engine.kernels.rms_norm import rms_norm
from engine.tp.comm import OneShot, ReduceNorm
from replay.analysis.allreducefit import write_sweep

MODES: tuple[str, ...] = ("graph", "eager", "oneshot", "fused")
SMALL_KERNELS = ("oneshot", "fused")  # modes of one-kernel reductions (bubblesim.core.collectives)
FUSED_HIDDEN = 4096  # the fused mode's row width (llama3-8b's hidden size)
ONESHOT_RTOL = 2e-2  # bf16 sums of n values in another order: a few units of the last place
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TARGET_BYTES_PER_SAMPLE = 64 * 2**20  # calls per sample: about this many bytes reduced
MAX_ITERS = 50


def iters_for(nbytes: int) -> int:
    return max(1, min(MAX_ITERS, TARGET_BYTES_PER_SAMPLE // max(nbytes, 1)))


def sizes_between(lo: int, hi: int) -> list[int]:
    """Powers of two from lo to hi (both rounded to powers of two)."""
    a, b = max(0, round(math.log2(lo))), round(math.log2(hi))
    return [2**k for k in range(a, b + 1)]


def preset_of(device_name: str) -> str | None:
    """The bubblesim.core.gpus preset a CUDA device name is, if any ('NVIDIA H100 80GB HBM3' ->
    h100)."""
    name = device_name.lower()
    for key in ("h200", "h100", "a100", "l40s"):
        if key in name:
            return key
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class _Job:
    world_size: int
    port: int
    sizes: tuple[int, ...]
    samples: int
    modes: tuple[str, ...]
    dtype: str
    backend: str
    out: str  # rank 0 writes its rows (JSON) here


def _timer(cuda: bool) -> Callable[[Callable[[], None]], float]:
    """A function that runs `fn` once and returns its wall ms (CUDA events on a GPU)."""
    if not cuda:

        def cpu(fn: Callable[[], None]) -> float:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3

        return cpu
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def gpu(fn: Callable[[], None]) -> float:
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    return gpu


def _calls(
    mode: str, x: torch.Tensor, iters: int, one: OneShot | ReduceNorm | None = None
) -> Callable[[], None]:
    """What one sample runs: `iters` all-reduces of x, eagerly or as one graph replay (the
    one-shot kernel's for mode oneshot, the fused kernel's with a residual for mode fused)."""
    fused = _FusedCall(one, x) if isinstance(one, ReduceNorm) else None

    def eager() -> None:
        if fused is not None:
            for i in range(iters):
                fused(i)
            return
        if isinstance(one, OneShot):
            for _ in range(iters):
                one(x)
            return
        for _ in range(iters):
            dist.all_reduce(x)

    if mode == "eager":
        return eager
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: NCCL's lazy setup
        eager()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eager()
    torch.cuda.synchronize()
    return graph.replay


def _worker(rank: int, job: _Job) -> None:
    cuda = job.backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        job.backend,
        init_method=f"tcp://127.0.0.1:{job.port}",
        rank=rank,
        world_size=job.world_size,
    )
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    barrier_ids = [rank] if cuda else None  # NCCL: the barrier's device, no guessing
    timed = _timer(cuda)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    try:
        dtype = DTYPES[job.dtype]
        elem = torch.tensor([], dtype=dtype).element_size()
        for mode in job.modes:
            one: OneShot | ReduceNorm | None = None
            one_max = oneshot_max_bytes(mode, job.world_size)
            if mode == "oneshot":  # collective: every rank, same order
                one = OneShot(device, dtype, one_max)
            elif mode == "fused":
                one = ReduceNorm(device, rank, job.world_size, dtype, one_max)
            for nbytes in job.sizes:
                if mode in SMALL_KERNELS and nbytes > one_max:
                    continue
                iters = iters_for(nbytes)
                if mode == "fused":  # an even count: the next replay's first region differs
                    iters += iters % 2
                shape = fused_shape(nbytes, elem) if mode == "fused" else (max(1, nbytes // elem),)
                x = torch.ones(shape, dtype=dtype, device=device)
                fn: Callable[[], None] | None = None
                try:
                    if isinstance(one, OneShot):
                        _check_oneshot(one, x.numel(), rank)
                    elif isinstance(one, ReduceNorm):
                        _check_fused(one, tuple(x.shape), rank)
                    fn = _calls(mode, x, iters, one)
                except Exception as e:  # noqa: BLE001 - a mode this stack cannot run
                    notes.append(f"mode {mode} at {nbytes} bytes failed: {type(e).__name__}: {e}")
                ok = torch.tensor([1.0 if fn is not None else 0.0], device=device)
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank drops the mode, or none
                if fn is None or ok.item() < 1:
                    if fn is not None:
                        notes.append(f"mode {mode} at {nbytes} bytes failed on another rank")
                    break
                run = fn
                per_call: list[float] = []
                for i in range(job.samples + 1):
                    dist.barrier(device_ids=barrier_ids)
                    sync()
                    ms = timed(run) / iters
                    slowest = torch.tensor([ms], dtype=torch.float64, device=device)
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                    if i:  # the first sample is untimed
                        per_call.append(float(slowest.item()))
                rows.append(
                    {
                        "mode": mode,
                        "world_size": job.world_size,
                        "bytes": int(x.numel() * elem),
                        "iters": iters,
                        "samples": len(per_call),
                        "ms": statistics.median(per_call),
                        "ms_min": min(per_call),
                        "ms_max": max(per_call),
                    }
                )
                del fn, run, x
        if rank == 0:
            Path(job.out).write_text(json.dumps({"rows": rows, "notes": notes}))
    finally:
        dist.destroy_process_group()


def _check_oneshot(one: OneShot, numel: int, rank: int) -> None:
    """The one-shot sum of rank-seeded random values against NCCL's, on this rank."""
    g = torch.Generator(device=one.buffer.device).manual_seed(1000 + rank)
    x = torch.randn(numel, generator=g, device=one.buffer.device).to(one.dtype)
    got = one(x).float()
    ref = x.clone()
    dist.all_reduce(ref)
    err = (got - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item() or 1.0
    if err > ONESHOT_RTOL * scale:
        raise AssertionError(
            f"one-shot sum differs from NCCL's by {err:.3g} (max |sum| {scale:.3g})"
        )


def fused_shape(nbytes: int, elem: int) -> tuple[int, int]:
    """The fused mode's [rows, hidden] for a message of `nbytes`."""
    numel = max(1, nbytes // elem)
    return (numel // FUSED_HIDDEN, FUSED_HIDDEN) if numel >= FUSED_HIDDEN else (1, numel)


class _FusedCall:
    """Call i of a fused sample: the sum of x with a residual and a norm, alternating the
    buffer regions 1 and 2 as a forward does (engine.model.LlamaModel.forward)."""

    def __init__(self, fused: ReduceNorm, x: torch.Tensor) -> None:
        self.fused, self.x = fused, x
        self.residual = torch.zeros_like(x)
        self.weight = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)

    def __call__(self, i: int) -> None:
        self.fused(self.x, self.residual, 1 + i % 2, self.weight, 1e-5)


def _check_fused(fused: ReduceNorm, shape: tuple[int, int], rank: int) -> None:
    """The fused kernel's (normed, residual) of rank-seeded random values against NCCL's sum
    then engine.kernels.rms_norm, on this rank."""
    device = fused.buffer.device
    g = torch.Generator(device=device).manual_seed(2000 + rank)
    x = torch.randn(shape, generator=g, device=device).to(fused.dtype)
    res = torch.randn(shape, generator=torch.Generator(device=device).manual_seed(7),
                      device=device).to(fused.dtype)  # fmt: skip
    weight = torch.ones(shape[1], dtype=fused.dtype, device=device)
    got, got_res = fused(x, res.clone(), 0, weight, 1e-5)  # region 0: samples alternate 1, 2
    ref = x.clone()
    dist.all_reduce(ref)
    want, want_res = rms_norm(ref, weight, 1e-5, res.clone())
    for name, a, b in (("normed", got, want), ("residual", got_res, want_res)):
        err = (a.float() - b.float()).abs().max().item()
        scale = b.float().abs().max().item() or 1.0
        if err > ONESHOT_RTOL * scale:
            raise AssertionError(
                f"fused {name} differs from NCCL's sum then the norm by {err:.3g} (max {scale:.3g})"
            )


@dataclass
class SweepResult:
    path: Path
    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def sweep(
    out: str | Path,
    world_sizes: Sequence[int],
    sizes: Sequence[int],
    samples: int = 20,
    modes: Sequence[str] = MODES,
    dtype: str = "bfloat16",
    backend: str = "nccl",
    gpu: str | None = None,
    announce: Callable[[str], None] = print,
) -> SweepResult:
    """Time all_reduce for every world size, mode and size; write the parquet `out`."""
    t0 = time.perf_counter()
    cuda = backend == "nccl"
    if cuda:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if max(world_sizes) > have:
            raise ValueError(f"--gpus {max(world_sizes)}: this host has {have} GPU(s)")
        modes = tuple(modes)
    else:
        modes = tuple(m for m in modes if m == "eager")  # no CUDA graphs nor symmetric memory
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for n in world_sizes:
        announce(f"all_reduce on {n} x {device} ({backend}): {len(sizes)} sizes x {modes}")
        with tempfile.TemporaryDirectory() as tmp:
            job = _Job(
                n, _free_port(), tuple(sizes), samples, modes, dtype, backend,
                os.path.join(tmp, "rows.json"),
            )  # fmt: skip
            mp.spawn(_worker, args=(job,), nprocs=n, join=True)
            got = json.loads(Path(job.out).read_text())
        rows += got["rows"]
        notes += [f"{n} GPUs: {x}" for x in got["notes"]]
    meta = {
        "gpu": gpu or (preset_of(device) if cuda else None),
        "device": device,
        "backend": backend,
        "dtype": dtype,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "notes": notes,
    }
    path = write_sweep(out, rows, meta)
    return SweepResult(path, rows, notes, time.perf_counter() - t0)
