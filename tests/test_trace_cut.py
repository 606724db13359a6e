"""`python -m sim trace cut`: a window of a trace, moved to start at 0 and optionally faster;
reports/fidelity/make_traces.py makes the committed fidelity windows with the same function."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from bubblesim.core.cli import run_main
from bubblesim.core.trace import TraceError, make_trace, read_trace, write_trace
from bubblesim.core.tracecut import cut_trace
from bubblesim.workloads.tracecmd import main

ROOT = Path(__file__).resolve().parents[1]


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        rc = run_main(main, list(argv))
    except SystemExit as e:
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def small() -> tuple:
    t = make_trace(
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
        [10, 500, 20, 30, 600, 40],
        [5, 6, 7, 8, 9, 10],
        needs_history=np.array([0, 1, 0, 1, 0, 1], bool),
    )
    t.metadata.update({"source": "unit test", "description": "six requests"})
    return t


def test_window_shift_speedup_and_metadata() -> None:
    t = small()
    cut = cut_trace(t, 1.0, 4.0, speedup=2.0, source="six.parquet")
    w = cut.trace
    assert cut.in_window == 3 and cut.dropped_long_prompt == 0
    assert w.arrival_s.tolist() == [0.0, 0.5, 1.0]  # (arrival - 1) / 2
    assert w.request_id.tolist() == t.request_id[1:4].tolist()
    assert w.prompt_len.tolist() == [500, 20, 30] and w.needs_history.tolist() == [1, 0, 1]
    assert w.metadata["source"] == "unit test"
    assert w.metadata["description"] == "1-4 s of six requests at 2x"
    info = json.loads(w.metadata["cut"])
    assert info == {
        "source": "six.parquet",
        "from_s": 1.0,
        "to_s": 4.0,
        "speedup": 2.0,
        "max_prompt_len": None,
        "in_window": 3,
        "dropped_long_prompt": 0,
    }


def test_long_prompts_are_dropped_and_counted() -> None:
    cut = cut_trace(small(), 0.0, 10.0, max_prompt_len=100)
    assert cut.in_window == 6 and cut.dropped_long_prompt == 2
    assert cut.trace.prompt_len.tolist() == [10, 20, 30, 40]
    assert cut.trace.arrival_s.tolist() == [0.0, 2.0, 3.0, 5.0]  # from_s 0: as recorded


@pytest.mark.parametrize(
    "args,msg",
    [
        ((3.0, 3.0), "need 0 <= from < to"),
        ((-1.0, 3.0), "need 0 <= from < to"),
        ((0.0, np.inf), "need 0 <= from < to"),
        ((10.0, 20.0), "holds no request"),
        ((0.0, 3.0, 0.0), "speedup 0"),
        ((0.0, 3.0, 1.0, 0), "max prompt length 0"),
        ((1.0, 2.0, 1.0, 100), "all 1 over 100 prompt tokens"),
    ],
)
def test_bad_windows_are_refused(args: tuple, msg: str) -> None:
    with pytest.raises(TraceError, match=msg):
        cut_trace(small(), *args)


def test_cli_writes_the_window_and_prints_what_it_dropped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_trace(small(), tmp_path / "six.parquet")
    out = tmp_path / "w.parquet"
    rc, stdout, _ = cli(
        capsys, "cut", str(src), "--from-s", "1", "--to-s", "5", "--speedup", "4",
        "--max-prompt-len", "100", "-o", str(out),
    )  # fmt: skip
    assert rc == 0
    assert "4 of 6 requests in [1, 5) s, dropped 2 with prompts over 100" in stdout
    w = read_trace(out)
    assert w.arrival_s.tolist() == [0.25, 0.5] and w.prompt_len.tolist() == [20, 30]
    assert json.loads(w.metadata["cut"])["dropped_long_prompt"] == 2


@pytest.mark.parametrize(
    "bad", [["--to-s", "0"], ["--to-s", "5", "--speedup", "-2"], ["--from-s", "9", "--to-s", "12"]]
)
def test_cli_bad_window_exits_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: list[str]
) -> None:
    src = write_trace(small(), tmp_path / "six.parquet")
    out = tmp_path / "w.parquet"
    rc, _, err = cli(capsys, "cut", str(src), *bad, "-o", str(out))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error:")
    assert not out.exists()


def _make_traces():  # reports/fidelity/make_traces.py, imported from its file
    spec = importlib.util.spec_from_file_location(
        "make_traces", ROOT / "reports" / "fidelity" / "make_traces.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "name,src,kw",
    [
        ("azure45x4", "azure_conv", {"seconds": 45, "speedup": 4.0}),
        ("mooncake45", "mooncake", {"seconds": 45, "max_prompt_len": 16384}),
    ],
)
def test_make_traces_windows_match_the_committed_files(
    tmp_path: Path, name: str, src: str, kw: dict
) -> None:
    """The product's cut regenerates the committed fidelity windows row for row."""
    w = _make_traces().window(read_trace(ROOT / "traces" / f"{src}.parquet"), **kw)
    write_trace(w, tmp_path / "w.parquet")
    committed = pq.read_table(ROOT / "traces" / "fidelity" / f"{name}.parquet")
    again = pq.read_table(tmp_path / "w.parquet")
    assert again.num_rows == committed.num_rows > 50
    assert again.replace_schema_metadata(None).equals(committed.replace_schema_metadata(None))
    desc = b"description"
    assert again.schema.metadata[desc] == committed.schema.metadata[desc]
