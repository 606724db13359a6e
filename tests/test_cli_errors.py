"""Bad input and interruptions on every command that writes: one line on stderr, exit code 2
(143 for SIGTERM), nothing written, nothing left behind (bubblesim.core.outplace,
bubblesim.core.atomic)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from helpers import sigterm_while_busy

from bubblesim.core import atomic
from bubblesim.core.cli import run_main
from bubblesim.core.outplace import RUN_FOLDER, TRACE_FILE, check_place, output_place
from bubblesim.core.trace import make_trace, write_trace

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--set", "model=tiny"]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    n = 6
    t = make_trace(np.arange(n) * 0.01, np.full(n, 16), np.full(n, 4))
    return write_trace(t, tmp_path / "t.parquet")


def _main(prog: str):
    if prog == "sim":
        from sim.__main__ import main
    else:
        from replay.__main__ import main
    return main


def one_line_error(capsys: pytest.CaptureFixture[str], prog: str, *argv: str) -> str:
    """Run `python -m <prog> argv` in-process; it must exit 2 with one `error:` line."""
    with pytest.raises(SystemExit) as e:
        run_main(_main(prog), list(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def no_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any simulation from here on fails the test: refusals must come before the work."""
    import sim.run

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("simulated before checking the output place")

    monkeypatch.setattr(sim.run, "simulate", boom)


def listing(p: Path) -> list[str]:
    return sorted(x.name for x in p.iterdir())


# ---- unknown model / GPU ----------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["model=nope", "gpu=tpu"])
@pytest.mark.parametrize(
    "prog, cmd",
    [
        ("sim", ["run"]),
        ("sim", ["whatif"]),
        ("sim", ["plan", "--slo", "ttft_p99_s=1"]),
        ("replay", ["run"]),
        ("replay", ["ablate", "--no-measure"]),
    ],
)
def test_unknown_model_or_gpu_is_one_line(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    trace: Path,
    prog: str,
    cmd: list[str],
    bad: str,
) -> None:
    out = tmp_path / "out" / "x"
    err = one_line_error(capsys, prog, *cmd, str(trace), "--set", bad, "-o", str(out))
    assert f"config key '{bad.split('=')[0]}'" in err
    assert listing(tmp_path) == ["t.parquet"]  # not even the parent folder


def test_unknown_model_in_a_library_call_is_a_config_error() -> None:
    from bubblesim.core.config import ConfigError
    from bubblesim.core.gpus import get_gpu
    from bubblesim.core.models import get_model

    with pytest.raises(ConfigError, match="'model'"):
        get_model("nope")
    with pytest.raises(ConfigError, match="'gpu'"):
        get_gpu("tpu")


# ---- the output place: checked before any work ------------------------------------------------
def test_run_refuses_a_file_before_simulating(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, trace: Path
) -> None:
    no_simulation(monkeypatch)
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    err = one_line_error(capsys, "sim", "run", str(trace), *TINY, "-o", str(f))
    assert f"-o '{f}' is a file" in err and "--force" in err
    assert f.read_text() == "mine"


def test_run_refuses_a_foreign_folder_and_force_replaces_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, trace: Path
) -> None:
    d = tmp_path / "photos"
    d.mkdir()
    (d / "a.jpg").write_text("x")
    with monkeypatch.context() as m:
        no_simulation(m)
        err = one_line_error(capsys, "sim", "run", str(trace), *TINY, "-o", str(d))
    assert "not a run folder" in err and listing(d) == ["a.jpg"]
    assert run_main(_main("sim"), ["run", str(trace), *TINY, "-q", "-o", str(d), "--force"]) == 0
    assert "summary.json" in listing(d) and "a.jpg" not in listing(d)
    # an earlier run folder is replaced without --force
    assert run_main(_main("sim"), ["run", str(trace), *TINY, "-q", "-o", str(d)]) == 0
    assert listing(tmp_path) == ["photos", "t.parquet"]  # no temp left


@pytest.mark.parametrize("where", ["/proc/bubblesim-x", "FILE/sub"])
def test_run_into_an_unwritable_place_names_the_users_path(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    trace: Path,
    where: str,
) -> None:
    no_simulation(monkeypatch)
    (tmp_path / "FILE").write_text("x")
    out = where.replace("FILE", str(tmp_path / "FILE"))
    err = one_line_error(capsys, "sim", "run", str(trace), *TINY, "-o", out)
    assert f"-o '{out}'" in err and ".tmp" not in err


def test_force_never_replaces_the_current_folder(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, trace: Path
) -> None:
    no_simulation(monkeypatch)
    monkeypatch.chdir(tmp_path)
    err = one_line_error(capsys, "sim", "run", str(trace), *TINY, "-o", ".", "--force")
    assert "current or home folder" in err


def test_whatif_and_plan_refuse_a_foreign_folder(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, trace: Path
) -> None:
    no_simulation(monkeypatch)
    d = tmp_path / "mine"
    d.mkdir()
    (d / "keep.txt").write_text("x")
    err = one_line_error(capsys, "sim", "whatif", str(trace), *TINY, "-o", str(d))
    assert "not a what-if folder" in err
    err = one_line_error(
        capsys, "sim", "plan", str(trace), "--slo", "ttft_p99_s=1", *TINY, "-o", str(d)
    )
    assert "not a plan folder" in err
    assert listing(d) == ["keep.txt"]


def test_whatif_replaces_its_folder_whole(tmp_path: Path, trace: Path) -> None:
    out = tmp_path / "w"
    argv = ["whatif", str(trace), *TINY, "--variants", "gc_freeze", "--jobs", "1", "-q"]
    assert run_main(_main("sim"), [*argv, "--keep-runs", "-o", str(out)]) == 0
    assert listing(out) == ["runs", "whatif-info.json", "whatif.json"]
    assert run_main(_main("sim"), [*argv, "-o", str(out)]) == 0
    assert listing(out) == ["whatif-info.json", "whatif.json"]  # no stale runs/ kept
    assert listing(tmp_path) == ["t.parquet", "w"]


def test_trace_outputs_are_never_silently_replaced(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, trace: Path
) -> None:
    before = trace.read_bytes()
    synth = ["trace", "synth", "--num-requests", "3", "--prompt-len", "8", "--output-len", "2"]
    err = one_line_error(capsys, "sim", *synth, "-o", str(trace))
    assert f"-o '{trace}' exists" in err and "--force" in err
    src = tmp_path / "lengths.csv"
    src.write_text("prompt,output\n5,6\n")
    err = one_line_error(
        capsys, "sim", "trace", "import", "lengths-csv", str(src), "--rate", "1", "-o", str(trace)
    )
    assert "exists" in err and trace.read_bytes() == before
    assert run_main(_main("sim"), [*synth, "-o", str(trace), "--force"]) == 0
    assert trace.read_bytes() != before
    err = one_line_error(capsys, "sim", *synth, "-o", str(tmp_path), "--force")
    assert "is a folder" in err  # --force never puts a file in place of a folder


@pytest.mark.parametrize(
    "fmt, text",
    [
        ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n"),
        ("azure", ""),
        ("lengths-csv", "prompt,output\n"),
        ("lengths-csv", ""),
        ("mooncake", ""),
        ("mooncake", "\n\n"),
    ],
)
def test_importers_on_empty_input(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fmt: str, text: str
) -> None:
    src = tmp_path / "src.txt"
    src.write_text(text)
    out = tmp_path / "o.parquet"
    err = one_line_error(
        capsys, "sim", "trace", "import", fmt, str(src), "--rate", "1", "-o", str(out)
    )
    assert str(src) in err and ("no rows" in err or "empty" in err)
    assert listing(tmp_path) == ["src.txt"]


@pytest.mark.parametrize("text", ["", "ContextTokens,GeneratedTokens\n"])
def test_synth_lengths_from_an_empty_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str
) -> None:
    src = tmp_path / "lengths.csv"
    src.write_text(text)
    argv = ["trace", "synth", "--num-requests", "3", "--lengths-from", str(src)]
    err = one_line_error(capsys, "sim", *argv, "-o", str(tmp_path / "o.parquet"))
    assert str(src) in err and ("no rows" in err or "empty" in err)
    assert listing(tmp_path) == ["lengths.csv"]


def test_replay_outputs_follow_the_same_rule(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, trace: Path
) -> None:
    f = tmp_path / "taken.json"
    f.write_text("{}")
    run = tmp_path / "r"
    assert run_main(_main("sim"), ["run", str(trace), *TINY, "-q", "-o", str(run)]) == 0
    err = one_line_error(capsys, "replay", "calibrate", str(run), "-o", str(f))
    assert "not a cost profile" in err
    err = one_line_error(capsys, "replay", "shapes", *TINY, "--set", "device=cpu", "-o", str(run))
    assert "is a folder" in err
    for cmd in (["run", str(trace)], ["ablate", str(trace), "--no-measure"]):
        err = one_line_error(capsys, "replay", *cmd, *TINY, "-o", str(f))
        assert "is a file" in err
    err = one_line_error(capsys, "replay", "compare", str(run), str(run), "-o", str(run))
    assert "not a fidelity folder" in err
    assert f.read_text() == "{}" and (run / "summary.json").is_file()


def test_check_place_rules(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    check_place(empty, RUN_FOLDER)
    check_place(tmp_path / "new" / "deeper", RUN_FOLDER)
    check_place(tmp_path / "new.parquet", TRACE_FILE)
    (tmp_path / "t.parquet").write_text("x")
    check_place(tmp_path / "t.parquet", TRACE_FILE, force=True)
    assert not (tmp_path / "new").exists()  # checking creates nothing


# ---- compare: which side was measured ----------------------------------------------------------
def test_compare_of_two_predicted_runs_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, trace: Path
) -> None:
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "fid"
    for d in (a, b):
        assert run_main(_main("sim"), ["run", str(trace), *TINY, "-q", "-o", str(d)]) == 0
    capsys.readouterr()
    assert run_main(_main("replay"), ["compare", str(a), str(b), "-o", str(out)]) == 0
    o, err = capsys.readouterr()
    assert err.startswith("warning: neither run was measured") and err.count("\n") == 1
    assert "not a fidelity check" in o.splitlines()[-1]
    assert (
        "neither run was measured"
        in json.loads((out / "fidelity.json").read_text())["sides_warning"]
    )


def test_sides_warning() -> None:
    from replay.analysis.compare import sides_warning

    def s(kind: str) -> dict:
        return {"source": {"kind": kind}}

    assert sides_warning(s("sim"), s("replay")) is None
    assert "swapped" in str(sides_warning(s("replay"), s("sim")))
    assert "two measurements" in str(sides_warning(s("replay"), s("replay")))
    assert "two predictions" in str(sides_warning(s("sim"), s("sim")))


# ---- plan --ray ---------------------------------------------------------------------------------
def test_plan_ray_init_failure_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, trace: Path
) -> None:
    def init(**kw: object) -> None:
        raise ValueError(
            "When connecting to an existing cluster, num_cpus and num_gpus must not be "
            "provided.\nmore text"
        )

    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init)
    monkeypatch.setitem(sys.modules, "ray", fake)
    out = tmp_path / "p"
    err = one_line_error(
        capsys, "sim", "plan", str(trace), "--slo", "ttft_p99_s=1", *TINY, "--ray", "local",
        "-o", str(out),
    )  # fmt: skip
    assert "--ray local: a Ray cluster already runs here" in err and "--ray auto" in err
    assert listing(tmp_path) == ["t.parquet"]


# ---- signals and leftovers ----------------------------------------------------------------------
# The run is stopped once every file is in its temp folder, before the rename into place: the
# moment a signal leaves the most behind. The signal is real (os.kill of the process itself).
STOP_SCRIPT = """
import os, signal, sys, time
import bubblesim.core.runfmt.io as io
from bubblesim.core.cli import run_main
from sim.__main__ import main

def stop(tmp, target):
    assert any(tmp.glob("*.parquet")), "no partial files yet"
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    time.sleep(60)
    raise SystemExit("signal not delivered")

io.swap_in = stop
sys.exit(run_main(main, sys.argv[2:]))
"""


def run_stopped(tmp_path: Path, sig: str, trace: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", STOP_SCRIPT, sig, "run", str(trace), "-q", *TINY]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("sig, rc", [("SIGTERM", 143), ("SIGINT", 130)])
def test_signal_while_writing_leaves_nothing(
    tmp_path: Path, trace: Path, sig: str, rc: int
) -> None:
    res = run_stopped(tmp_path, sig, trace)
    assert res.returncode == rc, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert listing(tmp_path) == ["t.parquet"]  # neither the run nor the runs/ it made


def test_sigkill_leftovers_are_swept_by_the_next_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, trace: Path
) -> None:
    res = run_stopped(tmp_path, "SIGKILL", trace)
    assert res.returncode == -signal.SIGKILL
    left = listing(tmp_path / "runs")
    assert len(left) == 1 and left[0].startswith(".sim-t.tmp-"), left
    assert list((tmp_path / "runs" / left[0]).glob("*.parquet"))  # partial files
    monkeypatch.chdir(tmp_path)  # the default output runs/sim-t, as the killed run had
    assert run_main(_main("sim"), ["run", str(trace), *TINY, "-q"]) == 0
    assert listing(tmp_path / "runs") == ["sim-t"]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_sweep_removes_only_dead_processes_temps(tmp_path: Path) -> None:
    host, dead = atomic._HOST, dead_pid()
    assert not atomic.pid_alive(dead) and atomic.pid_alive(os.getpid())
    stale = tmp_path / f".run.tmp-{host}-{dead}-abc"
    live = tmp_path / f".run.tmp-{host}-{os.getpid()}-abc"
    other_host = tmp_path / f".run.tmp-0badc0de-{dead}-abc"
    stale_file = tmp_path / f".t.parquet.tmp-{host}-{dead}-xyz"
    for d in (stale, live, other_host):
        d.mkdir()
        (d / "steps.parquet").write_text("partial")
    stale_file.write_text("partial")
    # a swap that died between its two renames: the previous folder goes back in place
    old = tmp_path / f".kept.old-{host}-{dead}-q"
    (old / "previous").mkdir(parents=True)
    (old / "previous" / "summary.json").write_text("{}")
    removed = atomic.sweep_stale(tmp_path)
    assert sorted(p.name for p in removed) == sorted([stale.name, stale_file.name, old.name])
    assert sorted(listing(tmp_path)) == sorted([live.name, other_host.name, "kept"])
    assert (tmp_path / "kept" / "summary.json").is_file()


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_outputs_follow_the_umask(tmp_path: Path, trace: Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        out = tmp_path / "r"
        assert run_main(_main("sim"), ["run", str(trace), *TINY, "-q", "-o", str(out)]) == 0
        tr = write_trace(make_trace([0.0], [4], [2]), tmp_path / "x.parquet")
        f = atomic.atomic_file(tmp_path / "x.json", "{}")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask
    assert (out / "summary.json").stat().st_mode & 0o777 == 0o666 & ~mask
    assert tr.stat().st_mode & 0o777 == 0o666 & ~mask
    assert f.stat().st_mode & 0o777 == 0o666 & ~mask


def test_output_place_puts_things_back_on_failure(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    with pytest.raises(KeyboardInterrupt), output_place(foreign, RUN_FOLDER, force=True):
        assert not foreign.exists()  # moved aside while the command works
        raise KeyboardInterrupt
    assert listing(foreign) == ["keep.txt"]
    deep = tmp_path / "a" / "b" / "run"
    with pytest.raises(RuntimeError), output_place(deep, RUN_FOLDER):
        assert deep.parent.is_dir()
        raise RuntimeError
    assert listing(tmp_path) == ["mine"]  # the parents it made are gone again


@pytest.mark.parametrize("nth", [1, 2])
def test_output_place_undoes_a_parent_made_as_an_interrupt_arrives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nth: int
) -> None:
    """SIGTERM's handler (or Ctrl-C's) runs right after the mkdir that made a parent folder: the
    folders made so far go again, that one included."""
    real, calls = Path.mkdir, []

    def mkdir_then_interrupted(self: Path, *args: object, **kwargs: object) -> None:
        real(self, *args, **kwargs)  # type: ignore[arg-type]
        calls.append(self)
        if len(calls) == nth:
            raise KeyboardInterrupt

    monkeypatch.setattr(Path, "mkdir", mkdir_then_interrupted)
    with pytest.raises(KeyboardInterrupt), output_place(tmp_path / "a" / "b" / "run", RUN_FOLDER):
        pass
    assert len(calls) == nth and listing(tmp_path) == []


# SIGTERM to the command alone (`kill PID`, not Ctrl-C's whole process group) while its workers
# are busy: the workers are stopped too, and the command ends at once with nothing left behind.
def test_sigterm_stops_the_workers_too(tmp_path: Path, trace: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    argv = ["whatif", str(trace), *TINY, "--variants", "gc_freeze", "--jobs", "2", "-q"]
    sigterm_while_busy("sim.whatif.run_one", [*argv, "-o", "out/w"], pids, tmp_path)
    assert listing(tmp_path) == ["pids", "t.parquet"]


def test_disk_full_while_writing_is_one_line_naming_the_output(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, trace: Path
) -> None:
    import errno

    import bubblesim.core.runfmt.io as io

    real = io.pq.write_table

    def full(table: object, where: object, **kw: object) -> None:
        if not isinstance(where, (str, os.PathLike)):  # an in-memory buffer: no disk involved
            return real(table, where, **kw)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))

    monkeypatch.setattr(io.pq, "write_table", full)
    out = tmp_path / "runs" / "r"
    err = one_line_error(capsys, "sim", "run", str(trace), *TINY, "-q", "-o", str(out))
    assert err == f"error: -o '{out}': cannot write (No space left on device)"
    assert listing(tmp_path) == ["t.parquet"]


def test_plan_ray_without_ray_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, trace: Path
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    argv = ["plan", str(trace), "--slo", "ttft_p99_s=1", *TINY, "--ray", "auto"]
    err = one_line_error(capsys, "sim", *argv, "-o", str(tmp_path / "p"))
    assert "--ray needs the 'ray' package" in err
    assert listing(tmp_path) == ["t.parquet"]
