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
OP_RANK_TIMES starts the rank's launch record or sends it to rank 0 (engine.tp.ranktimes);
OP_END_ENGINE drops the engine; OP_SHUTDOWN leaves.

Ending: `Comm.close` (rank 0; also at interpreter exit) drops the CUDA graphs of its engines,
sends OP_SHUTDOWN, and then every rank tears down together (`teardown`): a barrier on the gloo
group once every rank has dropped its graphs, then `destroy_process_group` on every rank at
the same time; rank 0 joins the workers last, terminating any that do not leave in time. The
order matters on NCCL: destroying (or aborting) a communicator waits until every CUDA graph
that captured one of its collectives is destroyed, so a rank that destroys its group while an
engine still holds its graphs never returns; and some NCCL versions' abort is collective, so
rank 0 must not wait for the workers to exit before it destroys its own.

Every start-up and shutdown step runs under a deadline (engine.tp.watchdog): a hang becomes
one error line naming the step. A worker whose step fails prints the error and exits at once,
so rank 0's next host message fails instead of waiting; a worker whose parent process is gone
exits within a second (a watchdog thread), so no worker outlives rank 0.
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
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bubblesim.core.config import Config
from engine.tp.comm import (
    HEADER_LEN,
    OP_END_ENGINE,
    OP_ENGINE,
    OP_RANK_TIMES,
    OP_SHUTDOWN,
    OP_STEP,
    OP_WARM_FORWARDS,
    RANK_TIMES_START,
    Comm,
)
from engine.tp.ring import IDLE_S, SPIN_CPU_S, HeaderRing
from engine.tp.shard import check_divisible
from engine.tp.watchdog import BUILD_S, SHUTDOWN_S, START_S, deadline

# engine.engine.Engine: built as engine_cls(cfg, model=shard) on every worker rank
EngineClass = Callable[..., Any]

START_TIMEOUT = timedelta(seconds=START_S)  # every rank joins the store within this
JOIN_S = 10.0  # a worker's time to leave after its teardown before it is terminated


class Workers:
    """Rank 0's handles on the processes it started."""

    def __init__(self, procs: list[Any], store: Any) -> None:
        self.procs, self.store = procs, store

    def stop(self, comm: Comm | None, say: bool = True) -> None:
        """Rank 0: tell the workers to leave (`say`: OP_SHUTDOWN; else they leave on their own,
        a failed start), tear down the groups together with them while they all live, join
        them (ending those that do not leave in time), and leave the groups if the teardown
        could not. A teardown error is raised after the joins (nothing is left running)."""
        error: BaseException | None = None
        if comm is not None and dist.is_initialized() and self.alive():
            try:
                if say:
                    comm.send_header(OP_SHUTDOWN)
                teardown(comm, self.kill)
            except Exception as e:  # noqa: BLE001 - the joins below must still run
                error = e
        self.join()
        if dist.is_initialized():  # no teardown (a dead worker) or a failed one
            with deadline("rank 0: leave the process groups (workers gone)", SHUTDOWN_S):
                _leave_alone()
        self.store = None
        if error is not None:
            raise error

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def kill(self) -> None:
        """End every worker now (a step of rank 0 is past its deadline)."""
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.kill()

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

    from bubblesim.core.models import PRESETS, ModelSpec

    if cfg.model in PRESETS:
        return PRESETS[cfg.model]
    path = Path(cfg.model)
    if not (path / "config.json").is_file():
        from engine.loader import CheckpointError

        raise CheckpointError(f"checkpoint '{path}': no config.json")
    return ModelSpec.from_hf_config(path / "config.json", name=path.name)


def start(cfg: Config, max_model_len: int, engine_cls: EngineClass):
    """Rank 0: start the workers and the groups; returns rank 0's model shard (`.comm` set).
    `engine_cls`: what the workers build for each OP_ENGINE (engine.engine.Engine, passed in:
    this module never imports the engine that starts it). Raises ValueError naming the config
    key when the model or the host cannot take tp."""
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
        args = (rank, tp, store.port, ring.name, cfg, max_model_len, os.getpid(), engine_cls)
        p = ctx.Process(target=worker_main, args=args, daemon=True, name=f"engine-tp{rank}")
        p.start()
        procs.append(p)
    workers = Workers(procs, store)
    try:
        with deadline("rank 0: start the workers and join the process groups", START_S,
                      workers.kill, workers.alive):  # fmt: skip
            comm = _join(0, tp, store, cfg.device, ring)
    except BaseException:
        workers.stop(None)
        ring.close()
        raise
    comm.on_expiry, comm.peers_alive = workers.kill, workers.alive
    model, error = None, None
    try:
        with deadline("rank 0: build the model shards (every rank)", BUILD_S, workers.kill,
                      workers.alive):  # fmt: skip
            try:
                model = build_shard(cfg, comm, max_model_len)
            except Exception as e:  # noqa: BLE001 - every rank must still vote, then it is raised
                error = e
            ok = comm.agree_min(0 if model is None else 1) == 1
    except BaseException:  # late, or interrupted: the workers may be anywhere in the build
        workers.kill()
        workers.stop(None)
        ring.close()
        raise
    if not ok:
        workers.stop(comm, say=False)  # the workers tear down after their vote too
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


def teardown(comm: Comm, on_expiry) -> None:
    """Every rank, at the same time, once its engines' CUDA graphs are gone: a barrier (every
    rank dropped its graphs: NCCL's destroy waits for them), then leave every group."""
    with deadline(f"rank {comm.rank}: barrier before teardown", SHUTDOWN_S, on_expiry):
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        dist.barrier(group=comm.host_group)
    with deadline(f"rank {comm.rank}: destroy the process groups", SHUTDOWN_S, on_expiry):
        dist.destroy_process_group()


def _leave_alone() -> None:
    """Rank 0 leaves its groups with its peers gone: NCCL's abort (its in-flight kernels stop
    waiting for the dead peers; a destroy would wait for them), else destroy."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.get_backend() == "nccl":
        abort()
    else:
        dist.destroy_process_group()


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
    from bubblesim.core.models import PRESETS
    from engine.model import LlamaModel, engine_dtype

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
    engine_cls: EngineClass,
) -> None:
    """A worker process: join, build the shard, serve until OP_SHUTDOWN, tear down. Any error
    (a step past its deadline among them) is printed and ends the process at once: rank 0's
    next message to it then fails."""
    _exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops us
    try:
        _worker(rank, size, port, ring_name, cfg, max_model_len, engine_cls)
    except BaseException:  # noqa: BLE001 - say why, and go
        traceback.print_exc()
        os._exit(1)


def _exit_now() -> None:
    os._exit(1)


def _worker(
    rank: int, size: int, port: int, ring_name: str, cfg: Config, max_model_len: int,
    engine_cls: EngineClass,
) -> None:  # fmt: skip
    if cfg.device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # the CPU ranks share the host's cores
    with deadline(f"rank {rank}: join the store and the process groups", START_S, _exit_now):
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=START_TIMEOUT)
        spin_s = IDLE_S if cfg.device == "cuda" else SPIN_CPU_S  # CPU ranks share the cores
        ring = HeaderRing.attach(ring_name, size - 1, HEADER_LEN, rank - 1, spin_s)
        comm = _join(rank, size, store, cfg.device, ring)
    comm.on_expiry = _exit_now
    model = None
    with deadline(f"rank {rank}: build the model shards (every rank)", BUILD_S, _exit_now):
        try:
            model = build_shard(cfg, comm, max_model_len)
        except Exception:  # noqa: BLE001 - printed here; rank 0 raises for every rank
            traceback.print_exc()
        ok = comm.agree_min(0 if model is None else 1) == 1
    if ok:
        serve(comm, model, engine_cls)
    model = None
    _collect()
    teardown(comm, _exit_now)
    ring.close()


def serve(comm: Comm, model: Any, engine_cls: EngineClass) -> None:
    """The worker loop (module docstring)."""
    engine = None
    while True:
        h = comm.recv_header()
        recv_ns = time.perf_counter_ns()  # the step's arrival, for the launch record
        op = int(h[0])
        if op == OP_STEP:
            assert engine is not None, "a step before any engine"
            engine.serve_step(h, recv_ns)
        elif op == OP_RANK_TIMES:  # rank 0's Engine.start / finish
            assert engine is not None, "a launch record before any engine"
            if int(h[1]) == RANK_TIMES_START:
                engine.rank_times.start()
            else:
                comm.gather_object(engine.rank_times.table())
        elif op == OP_ENGINE:
            engine = _drop(engine)
            _collect()
            cfg = comm.recv_object()
            engine = engine_cls(cfg, model=model)
        elif op == OP_WARM_FORWARDS:
            assert engine is not None, "warm-up before any engine"
            engine.warm_forwards(int(h[1]))
        elif op == OP_END_ENGINE:
            engine = _drop(engine)
            _collect()
        elif op == OP_SHUTDOWN:
            engine = _drop(engine)  # graphs gone before the teardown (which collects)
            return
        else:
            raise RuntimeError(f"tensor-parallel worker {comm.rank}: unknown command {op}")


def _drop(engine: Any) -> None:
    """Destroy a worker's engine's CUDA graphs now (the communicator's destroy waits for them,
    and a frozen or cyclic engine would keep them alive). Returns None: `engine =
    _drop(engine)`, then `_collect()` frees the rest once no name holds it."""
    if engine is not None:
        engine.release_graphs()
    return None


def _collect() -> None:
    """Free what was dropped: the engines' start-up heap may be frozen (gc_freeze)."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _exit_with_parent(parent_pid: int) -> None:
    """A daemon thread that ends this process once its parent (rank 0) is gone."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()
