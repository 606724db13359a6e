"""Rank 0 starts the other ranks; each worker rank builds its model shard and then mirrors the
engines rank 0 builds and the steps it runs, until rank 0 says stop.

Start (`start`, in rank 0's process): a TCP store on a free localhost port and the header
ring in shared memory (engine.tp.ring), tp - 1 processes spawned (`torch.multiprocessing`,
spawn start method, daemonic: they end with rank 0's process), the process groups
(engine.tp.comm), then every rank builds its shard at the same time; all ranks agree that
every shard was built before rank 0 returns (a worker's error is printed by the worker, and
rank 0 raises one line saying so).

Worker loop (`serve`): read rank 0's next header (engine.tp.comm commands): OP_ENGINE builds an
`Engine` from the config rank 0 sends (the same constructor, so both ranks run the same
collectives: profiling forward, KV budget agreement, CUDA graph captures in the same order);
OP_STEP runs one step (`Engine.serve_step`); OP_WARM_FORWARDS the warm-up forwards;
OP_END_ENGINE drops the engine; OP_SHUTDOWN leaves.

Ending: `Comm.close` (rank 0; also at interpreter exit) sends OP_SHUTDOWN and joins the workers,
terminating any that do not leave in time. A worker whose step fails prints the error and exits
at once, so rank 0's next host message fails instead of waiting; a worker whose parent process
is gone exits within a second (a watchdog thread), so no worker outlives rank 0.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from core.config import Config
from engine.tp.comm import (
    HEADER_LEN,
    OP_END_ENGINE,
    OP_ENGINE,
    OP_SHUTDOWN,
    OP_STEP,
    OP_WARM_FORWARDS,
    Comm,
)
from engine.tp.ring import IDLE_S, SPIN_CPU_S, HeaderRing
from engine.tp.shard import check_divisible

START_TIMEOUT = timedelta(minutes=5)  # every rank joins the store within this
JOIN_S = 10.0  # a worker's time to leave after OP_SHUTDOWN before it is terminated


class Workers:
    """Rank 0's handles on the processes it started."""

    def __init__(self, procs: list[Any], store: Any) -> None:
        self.procs, self.store = procs, store

    def stop(self, comm: Comm | None) -> None:
        """Tell the workers to leave (when the group still works), join or end them, then leave
        the process group."""
        if comm is not None:
            with contextlib.suppress(Exception):  # a dead worker: the joins below end the rest
                comm.send_header(OP_SHUTDOWN)
        self.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None

    def join(self) -> None:
        deadline = time.monotonic() + JOIN_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def model_spec(cfg: Config):
    """The whole model's spec: a preset's, or a checkpoint folder's config.json."""
    from pathlib import Path

    from core.models import PRESETS, ModelSpec

    if cfg.model in PRESETS:
        return PRESETS[cfg.model]
    path = Path(cfg.model)
    if not (path / "config.json").is_file():
        from engine.loader import CheckpointError

        raise CheckpointError(f"checkpoint '{path}': no config.json")
    return ModelSpec.from_hf_config(path / "config.json", name=path.name)


def start(cfg: Config, max_model_len: int):
    """Rank 0: start the workers and the groups; returns rank 0's model shard (`.comm` set).
    Raises ValueError naming the config key when the model or the host cannot take tp."""
    tp = cfg.tensor_parallel_size
    check_divisible(model_spec(cfg), tp)
    if dist.is_initialized():
        raise ValueError(
            "config key 'tensor_parallel_size': this process already runs a tensor-parallel "
            "group (close the other tensor-parallel engine first)"
        )
    if cfg.device == "cuda":
        n = torch.cuda.device_count()
        if n < tp:
            raise ValueError(
                f"config key 'tensor_parallel_size': {tp} needs {tp} CUDA devices, {n} visible"
            )
        torch.cuda.set_device(0)
    store = dist.TCPStore(
        "127.0.0.1", 0, tp, is_master=True, wait_for_workers=False, timeout=START_TIMEOUT
    )
    ring = HeaderRing.create(tp - 1, HEADER_LEN)
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, tp):
        args = (rank, tp, store.port, ring.name, cfg, max_model_len, os.getpid())
        p = ctx.Process(target=worker_main, args=args, daemon=True, name=f"engine-tp{rank}")
        p.start()
        procs.append(p)
    workers = Workers(procs, store)
    try:
        comm = _join(0, tp, store, cfg.device, ring)
    except BaseException:
        workers.stop(None)
        ring.close()
        raise
    model, error = None, None
    try:
        model = build_shard(cfg, comm, max_model_len)
    except Exception as e:  # noqa: BLE001 - every rank must still vote, then it is raised
        error = e
    if comm.agree_min(0 if model is None else 1) == 0:
        workers.stop(None)
        ring.close()
        if error is not None:
            raise error
        raise RuntimeError(
            "a tensor-parallel worker rank failed to build its model shard (its error is "
            "printed above)"
        )
    comm.workers = workers
    _ACTIVE.append(comm)
    atexit.register(comm.close)
    return model


_ACTIVE: list[Comm] = []  # rank 0's groups this process started (at most one open at a time)


def stop_all() -> None:
    """Stop every worker this process started (replay calls it when its repeats are done: they
    share one model, so no single engine owns the workers). Idempotent."""
    while _ACTIVE:
        _ACTIVE.pop().close()


def _join(rank: int, size: int, store: Any, device: str, ring: HeaderRing) -> Comm:
    """Join the default group (NCCL on CUDA, gloo on CPU) and build the rank's Comm."""
    if device == "cuda":
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=size, device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    return Comm(rank, size, dev, ring)


def build_shard(cfg: Config, comm: Comm, max_model_len: int):
    """This rank's slice of the model: seeded random weights (the TP = 1 weights, sliced) or
    its slices of a checkpoint."""
    from core.models import PRESETS
    from engine.engine import engine_dtype
    from engine.model import LlamaModel

    dtype = engine_dtype(cfg)
    if cfg.model not in PRESETS:
        from engine.loader import load_checkpoint

        return load_checkpoint(cfg.model, dtype, comm.device, max_positions=max_model_len,
                               comm=comm)  # fmt: skip
    spec = PRESETS[cfg.model]
    model = LlamaModel(spec, dtype, comm.device, max_positions=max_model_len, comm=comm)
    return model.init_random(cfg.seed)


# ---- worker ranks ----------------------------------------------------------------------------
def worker_main(
    rank: int,
    size: int,
    port: int,
    ring_name: str,
    cfg: Config,
    max_model_len: int,
    parent_pid: int,
) -> None:
    """A worker process: join, build the shard, serve until OP_SHUTDOWN."""
    _exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops us
    if cfg.device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # the CPU ranks share the host's cores
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=START_TIMEOUT)
    spin_s = IDLE_S if cfg.device == "cuda" else SPIN_CPU_S  # CPU ranks share the cores
    ring = HeaderRing.attach(ring_name, size - 1, HEADER_LEN, rank - 1, spin_s)
    comm = _join(rank, size, store, cfg.device, ring)
    model = None
    try:
        model = build_shard(cfg, comm, max_model_len)
    except Exception:  # noqa: BLE001 - printed here; rank 0 raises for every rank
        traceback.print_exc()
    if comm.agree_min(0 if model is None else 1) == 0:
        dist.destroy_process_group()
        ring.close()
        return
    try:
        serve(comm, model)
    except BaseException:  # noqa: BLE001 - say why, and go: rank 0's next message fails
        traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()
    ring.close()


def serve(comm: Comm, model: Any) -> None:
    """The worker loop (module docstring)."""
    from engine.engine import Engine

    engine = None
    while True:
        h = comm.recv_header()
        op = int(h[0])
        if op == OP_STEP:
            assert engine is not None, "a step before any engine"
            engine.serve_step(h)
        elif op == OP_ENGINE:
            engine = _drop(engine)
            cfg = comm.recv_object()
            engine = Engine(cfg, model=model)  # type: ignore[arg-type]
        elif op == OP_WARM_FORWARDS:
            assert engine is not None, "warm-up before any engine"
            engine.warm_forwards(int(h[1]))
        elif op == OP_END_ENGINE:
            engine = _drop(engine)
        elif op == OP_SHUTDOWN:
            _drop(engine)  # unfrozen and freed: nothing left for the interpreter's exit
            return
        else:
            raise RuntimeError(f"tensor-parallel worker {comm.rank}: unknown command {op}")


def _drop(engine: Any) -> None:
    """Free a worker's engine (KV cache, graphs): its start-up heap may be frozen (gc_freeze)."""
    if engine is None:
        return None
    del engine
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return None


def _exit_with_parent(parent_pid: int) -> None:
    """A daemon thread that ends this process once its parent (rank 0) is gone."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()
