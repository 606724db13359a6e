"""Builders shared by the tests: the tiny model's engine config on CPU or CUDA, the scheduling
policy's config, parametrize
cases left to the full suite, and the rerun of a test file's `test_interp_*` tests under the
Triton interpreter. Imported as `helpers` (pytest
puts tests/ on sys.path; a subprocess adds it to PYTHONPATH)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bubblesim.core.config import Config
from bubblesim.core.policy import SchedulerConfig

ROOT = Path(__file__).resolve().parents[1]

# CPU: float32 and eager, small batches (greedy tokens are stable across batch compositions).
CPU_TINY: dict[str, object] = dict(
    model="tiny",
    device="cpu",
    dtype="float32",
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=512,
    cuda_graphs=False,
    gc_freeze=False,
    batches_in_flight=2,
)
# CUDA: bfloat16 with CUDA graphs and a fixed KV cache (no sizing from free memory).
CUDA_TINY: dict[str, object] = dict(
    CPU_TINY,
    device="cuda",
    dtype="bfloat16",
    max_num_seqs=16,
    max_num_batched_tokens=256,
    max_model_len=1024,
    num_kv_blocks=512,
    cuda_graphs=True,
)


def mark_measured(run_dir: Path) -> None:
    """Make a simulated run folder read as measured (summary `source.kind` "replay"), for the
    fits that take measured runs only: a run made with a known model gives that model back."""
    path = Path(run_dir) / "summary.json"
    summary = json.loads(path.read_text())
    summary["source"]["kind"] = "replay"
    path.write_text(json.dumps(summary))


def make_cfg(sampling: tuple[tuple[str, object], ...] | None = None, **kw: object) -> Config:
    """The tiny model's engine config: CPU_TINY, or CUDA_TINY when device="cuda", updated by
    `kw` (Config fields); `sampling`: (name, value) pairs for the sampling section."""
    base = CUDA_TINY if kw.get("device") == "cuda" else CPU_TINY
    cfg = Config(**{**base, **kw})  # type: ignore[arg-type]
    return cfg if sampling is None else cfg.replace(**{f"sampling.{k}": v for k, v in sampling})


def spec_cfg(method: str, k: int = 3, **kw: object) -> Config:
    """make_cfg(**kw) with speculative decoding: `method` drafting `k` tokens a step."""
    return make_cfg(**kw).replace(**{"spec.method": method, "spec.k": k})  # type: ignore[arg-type]


def sched_cfg(**kw: object) -> SchedulerConfig:
    """The scheduling policy's config on its own (no engine): small limits, 4-token blocks,
    chunked prefill and prefix caching on, no drafts; updated by `kw`."""
    base: dict[str, object] = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_blocks=64,
        block_size=4,
        max_model_len=4096,
        chunked_prefill=True,
        prefix_caching=True,
        spec_k=0,
    )
    return SchedulerConfig(**{**base, **kw})  # type: ignore[arg-type]


def slow_cases(*values: object) -> list[object]:
    """Parametrize values marked slow: the full suite runs them, the quick loop
    (`-m "not slow"`) keeps only the unmarked cases beside them. A tuple is one case of several
    arguments."""
    return [
        pytest.param(*v, marks=pytest.mark.slow)
        if isinstance(v, tuple)
        else pytest.param(v, marks=pytest.mark.slow)
        for v in values
    ]


def interpreter_bound_bug() -> str | None:
    """Why this Triton interpreter cannot run a loop whose bounds come from a program id, or
    None. Triton 3.6's interpreter (the GPU hosts') holds a program id as a 1-element array and
    reads a `range()` bound with `int()` of it, which NumPy 2.5 refuses ("only 0-dimensional
    arrays can be converted to Python scalars"); later interpreters squeeze it first."""
    # lazy: Triton only for the interpreter tests (importing helpers stays light)
    import inspect
    import warnings

    import numpy as np
    import triton
    from triton.runtime import interpreter

    if "int(self.handle.data))" not in inspect.getsource(interpreter):
        return None
    try:
        with warnings.catch_warnings():  # NumPy 1.25-2.4 warn and convert
            warnings.simplefilter("ignore", DeprecationWarning)
            int(np.array([1]))
    except TypeError:
        return (
            f"Triton {triton.__version__}'s interpreter reads loop bounds with int() of a "
            f"1-element array, which NumPy {np.__version__} refuses (the compiled kernels are "
            "tested on the GPU; a later Triton runs these)"
        )
    return None


def run_interpreter_tests(test_file: str, timeout_s: float, program_id_loops: bool = True) -> None:
    """Rerun `test_file`'s `test_interp_*` tests in a subprocess with TRITON_INTERPRET=1 (it must
    be set before Triton kernels are decorated); fails with the subprocess's output tail.
    `program_id_loops`: the file's kernels loop over bounds computed from a program id, so they
    are skipped where the interpreter cannot run such a loop (`interpreter_bound_bug`)."""
    if program_id_loops and (why := interpreter_bound_bug()) is not None:
        pytest.skip(why)
    path = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{path}"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file]
    cmd += ["-k", "test_interp_"]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-3000:]


# A command's pool task replaced by one that notes its worker's pid, sends the command one
# SIGTERM (`kill PID`: the command alone, not Ctrl-C's whole process group; the first worker to
# get there) and sleeps; its third argument, the run's folder, is made first.
_SIGTERM_SCRIPT = """
import importlib, os, signal, sys, time
from bubblesim.core.cli import run_main
from sim.__main__ import main

def busy(*args):
    os.makedirs(args[2], exist_ok=True)
    open(os.path.join(sys.argv[1], f"worker-{os.getpid()}"), "w").close()
    try:  # one SIGTERM (a second one kills at once, by design)
        os.close(os.open(os.path.join(sys.argv[1], "signalled"), os.O_CREAT | os.O_EXCL))
        os.kill(os.getppid(), signal.SIGTERM)
    except FileExistsError:
        pass
    time.sleep(60)

module, name = sys.argv[2].rsplit(".", 1)
setattr(importlib.import_module(module), name, busy)
sys.exit(run_main(main, sys.argv[3:]))
"""


def sigterm_while_busy(
    task: str, argv: list[str], pids: Path, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m sim ARGV` with the pool task `task` ("module.function") busy as above; each
    worker's pid is a file `worker-PID` in `pids`. Asserts that the command ended at once: exit
    143 with its one line, and every worker gone."""
    from bubblesim.core.atomic import pid_alive

    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    cmd = [sys.executable, "-c", _SIGTERM_SCRIPT, str(pids), task, *argv]
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=150)
    assert res.returncode == 143, res.stderr
    assert res.stderr.strip() == "terminated (SIGTERM)"
    workers = [int(p.name.split("-")[1]) for p in pids.glob("worker-*")]
    assert workers
    deadline = time.monotonic() + 10  # a loaded machine may take a moment to reap them
    while any(pid_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(w) for w in workers)
    return res
