"""`replay shapes --batches FILE`: given decode batches timed instead of the grid (on CPU with the
tiny model), each row under its batch's label; a bad batches file gets one clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from bubblesim.core.cli import run_main
from replay.analysis.batches_file import BatchesError, batches_doc, read_batches

SETS = ["--set", "model=tiny", "--set", "device=cpu", "--set", "num_kv_blocks=64",
        "--set", "max_num_seqs=8", "--set", "max_model_len=768"]  # fmt: skip


def _write(path: Path, doc: object) -> Path:
    path.write_text(json.dumps(doc))
    return path


def test_the_batches_are_timed_in_order_under_their_labels(tmp_path: Path, capsys) -> None:
    from replay.__main__ import main

    batches = [("a:mixed", [40, 300, 7, 120]), ("a:uniform", [117, 117, 117, 116]), ("b", [2])]
    f = _write(tmp_path / "b.json", batches_doc(batches))
    out = tmp_path / "s.parquet"
    assert main(["shapes", *SETS, "--repeats", "1", "-q", "--batches", str(f), "-o", str(out)]) == 0
    assert "grid: 3 of 3 shapes" in capsys.readouterr().out
    t = pq.read_table(out).to_pydict()
    assert t["label"] == ["a:mixed", "a:uniform", "b"]
    for (_, ctx), rows, kv, longest in zip(
        batches, t["num_reqs"], t["kv_read_tokens"], t["max_kv_tokens"], strict=True
    ):
        assert (rows, kv, longest) == (len(ctx), sum(ctx), max(ctx))
    assert all(ms > 0 for ms in t["gpu_ms"])
    # --families names grid families: not with --batches; a bad file: one usage error
    (tmp_path / "bad.json").write_text("[]")
    for bad, why in (
        (["--batches", str(f), "--families", "decode"], "leave --families out"),
        (["--batches", str(tmp_path / "bad.json")], "not a batches file"),
    ):
        with pytest.raises(SystemExit) as e:
            run_main(main, ["shapes", *SETS, *bad, "-o", str(tmp_path / "x.parquet")])
        assert e.value.code == 2 and why in capsys.readouterr().err
        assert not (tmp_path / "x.parquet").exists()


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        ({"format": "other"}, "not a batches file"),
        ({"format": "replay.batches", "version": 2, "batches": []}, "version 2"),
        ({"format": "replay.batches", "version": 1, "batches": []}, "non-empty list"),
        (batches_doc([("x", [5]), ("x", [6])]), "appears twice"),
        (batches_doc([("x", [])]), "'contexts' must be a non-empty list"),
        (batches_doc([("x", [1])]), "below 2 keys"),
        (
            {
                "format": "replay.batches",
                "version": 1,
                "batches": [{"label": "x", "contexts": [5.5]}],
            },
            "integers",
        ),
        (batches_doc([("x", [5] * 9)]), "more than max_num_seqs = 8"),
        (batches_doc([("x", [5, 769])]), "769 keys, more than max_model_len = 768"),
    ],
)
def test_a_bad_batches_file_names_its_problem(tmp_path: Path, doc: object, why: str) -> None:
    f = _write(tmp_path / "b.json", doc)
    with pytest.raises(BatchesError, match=why) as e:
        read_batches(f, max_rows=8, max_context=768)
    assert str(f) in str(e.value)


def test_an_unreadable_file(tmp_path: Path) -> None:
    (tmp_path / "b.json").write_text("{")
    with pytest.raises(BatchesError, match="not a readable JSON"):
        read_batches(tmp_path / "b.json")
