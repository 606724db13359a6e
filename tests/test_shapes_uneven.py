"""The sweep's chunks(uneven) family (unequal chunks in one step, alone and beside decode rows)
and `replay shapes --families` (a sweep of some families, to add to another)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from bubblesim.core.cli import run_main
from bubblesim.core.config import Config
from replay.analysis.shapes_file import META_KEY
from replay.analysis.shapes_grid import FAMILIES, Limits, grid
from replay.analysis.shapes_plan import plan

LIM = Limits(max_tokens=8192, max_seqs=256, max_len=131072, kv_tokens=40000 * 16)
TINY = dict(max_num_batched_tokens=320, max_num_seqs=20, max_model_len=768)


def test_uneven_chunks_differ_and_the_other_families_keep_their_points(monkeypatch):
    batches = grid(LIM)
    uneven = [b for b in batches if b.label == "chunks(uneven)"]
    assert len(uneven) == 36  # 3 totals x 3 row counts x 4 splits
    for b in uneven:
        chunks = [e for e in b.entries if e.prefill]
        assert len(chunks) >= 2 and len({e.n for e in chunks}) == 2, b
        rows = [e for e in b.entries if not e.prefill]
        assert len(rows) in (0, 16, 64)
        assert sum(e.n for e in b.entries) <= LIM.max_tokens
    later = [b for b in uneven if any(e.prefill and e.start for e in b.entries)]
    assert len(later) == 18  # a later chunk beside a fresh one of another size
    rest = [b for b in batches if b.label != "chunks(uneven)"]
    monkeypatch.setattr("replay.analysis.shapes_grid._uneven_chunks", lambda g: None)
    assert rest == grid(LIM)  # the family adds points, moves none
    assert FAMILIES[-3:] == ("chunks(uneven)", "decode(mix)", "decode(mix desc)")


def test_a_plan_of_some_families():
    cfg = Config(model="tiny", device="cpu", **TINY)
    whole = plan(cfg, 300, budget_s=None)
    some = plan(cfg, 300, budget_s=None, families=("chunks", "chunks(uneven)"))
    assert some.families == ("chunks", "chunks(uneven)") and whole.families == ()
    assert {b.label for b in some.batches} == {"chunks", "chunks(uneven)"}
    assert some.grid_shapes == len(some.batches) < whole.grid_shapes
    assert [b for b in whole.batches if b.label in some.families] == some.batches


def test_shapes_cli_families(tmp_path: Path, capsys):
    from replay.__main__ import main

    sets = ["--set", "model=tiny", "--set", "device=cpu"]
    sets += [f"--set={k}={v}" for k, v in TINY.items()]
    out = tmp_path / "u.parquet"
    argv = ["shapes", *sets, "--families", "chunks(uneven)", "--repeats", "1", "-q"]
    assert main([*argv, "-o", str(out)]) == 0
    t = pq.read_table(out)
    meta = json.loads(t.schema.metadata[META_KEY])
    assert set(t.column("label").to_pylist()) == {"chunks(uneven)"}
    assert meta["grid"]["families"] == ["chunks(uneven)"]
    with pytest.raises(SystemExit) as e:
        run_main(main, ["shapes", *sets, "--families", "chunk", "-o", str(tmp_path / "x.parquet")])
    assert e.value.code == 2 and "--families: unknown ['chunk']" in capsys.readouterr().err
    assert not (tmp_path / "x.parquet").exists()
