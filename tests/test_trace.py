"""bubblesim.core.trace: Contract 1 read / validate / write."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bubblesim.core.models import PRESETS
from bubblesim.core.trace import (
    TokenLists,
    Trace,
    TraceError,
    encode_prefixes,
    make_trace,
    read_trace,
    trace_sha256,
    validate,
    write_trace,
)

TINY = PRESETS["tiny"]


def full_trace() -> Trace:
    """Every column, prefixes consistent with the ids, arrivals out of order with a tie."""
    prompts = [[1, 2, 3, 4], [1, 2, 3], [7, 8], [1, 2, 9, 9, 9]]
    outputs = [[5, 6], [4], [9, 9, 9], [3]]
    return make_trace(
        [0.5, 0.1, 0.5, 0.0],
        [len(p) for p in prompts],
        [len(o) for o in outputs],
        request_id=np.array(["a", "b", "c", "d"], dtype=object),
        prompt_ids=TokenLists.from_lists(prompts),
        output_ids=TokenLists.from_lists(outputs),
        accept_rate=np.array([0.5, 0.7, 1.0, 0.0], dtype=np.float32),
        needs_history=np.array([True, False, False, True]),
        prefix_group=np.array([0, 0, -1, 0], dtype=np.int32),
        prefix_keys=np.array(["sys"], dtype=object),
        prefix_len=np.array([2, 2, 0, 2], dtype=np.int32),
        metadata={"source": "unit test", "license": "none", "description": "four requests"},
    )


def table() -> pa.Table:
    return full_trace().to_table()


def set_col(t: pa.Table, name: str, arr: pa.Array) -> pa.Table:
    return t.set_column(t.column_names.index(name), name, arr)


def assert_same(a: Trace, b: Trace) -> None:
    assert list(a.request_id) == list(b.request_id)
    for col in ("arrival_s", "prompt_len", "output_len", "accept_rate", "needs_history"):
        x, y = getattr(a, col), getattr(b, col)
        assert (x is None) == (y is None), col
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=col)
    for col in ("prompt_ids", "output_ids"):
        x, y = getattr(a, col), getattr(b, col)
        assert (x is None) == (y is None), col
        if x is not None:
            assert [list(x[i]) for i in range(len(x))] == [list(y[i]) for i in range(len(y))]
    if a.prefix_group is None:
        assert b.prefix_group is None
    else:
        assert b.prefix_group is not None and b.prefix_keys is not None
        assert a.prefix_keys is not None
        ka = [a.prefix_keys[g] if g >= 0 else None for g in a.prefix_group]
        kb = [b.prefix_keys[g] if g >= 0 else None for g in b.prefix_group]
        assert ka == kb
        np.testing.assert_array_equal(a.prefix_len, b.prefix_len)


# ---- round trips ----------------------------------------------------------------------------
def test_round_trip_keeps_every_column_and_metadata(tmp_path: Path) -> None:
    t = full_trace()
    path = write_trace(t, tmp_path / "t.parquet", TINY)
    back = read_trace(path, TINY)
    assert_same(t, back)
    assert back.metadata["source"] == "unit test"
    assert back.metadata["description"] == "four requests"
    schema = pq.read_schema(path)
    assert schema.field("prompt_len").type == pa.int32()
    assert schema.field("prompt_ids").type.value_type == pa.int32()
    assert schema.field("accept_rate").type == pa.float32()
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]  # no temp file left


def test_by_arrival_is_stable_and_rows_are_python_values() -> None:
    s = full_trace().by_arrival()
    assert list(s.request_id) == ["d", "b", "a", "c"]  # a and c tie at 0.5: file order kept
    assert list(s.prompt_ids[2]) == [1, 2, 3, 4]  # ids travel with their row
    rows = list(s.rows())
    assert rows[0].request_id == "d" and rows[0].needs_history is True
    assert rows[0].prefix_group == 0 and rows[0].prefix_len == 2
    assert type(rows[1].arrival_s) is float and type(rows[1].prompt_len) is int
    assert rows[3].prefix_group == -1
    sorted_trace = make_trace([0.0, 1.0], [1, 1], [1, 1])
    assert sorted_trace.by_arrival() is sorted_trace


def test_token_lists_take_matches_python() -> None:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 9, rng.integers(0, 5)).tolist() for _ in range(20)]
    tl = TokenLists.from_lists(seqs)
    order = rng.permutation(20)[:12]
    taken = tl.take(order)
    assert [list(taken[i]) for i in range(12)] == [seqs[i] for i in order]


def test_encode_prefixes_numbers_groups_by_first_appearance() -> None:
    group, keys = encode_prefixes(np.array([50, 7, 50, 0, 7]), np.array([1, 1, 1, 0, 1], bool))
    assert group.tolist() == [0, 1, 0, -1, 1]
    assert keys.tolist() == [50, 7]


@pytest.mark.parametrize(
    "name,arr",
    [
        ("prompt_len", pa.array([4, 3, 2, 5], pa.int64())),
        ("prompt_len", pa.array([4, 3, 2, 5], pa.uint16())),
        ("output_len", pa.array([2, 1, 3, 1], pa.int8())),
        ("arrival_s", pa.array([1, 0, 2, 3], pa.int64())),
        ("arrival_s", pa.array([0.5, 0.1, 0.5, 0.0], pa.float32())),
        ("request_id", pa.array(["a", "b", "c", "d"], pa.large_string())),
        ("request_id", pa.array(["a", "b", "c", "d"]).dictionary_encode()),
        ("request_id", pa.array([10, 11, 12, 13], pa.uint8())),
        (
            "prompt_ids",
            pa.array([[1, 2, 3, 4], [1, 2, 3], [7, 8], [1, 2, 9, 9, 9]], pa.large_list(pa.int64())),
        ),
        ("accept_rate", pa.array([0.5, 0.7, 1.0, 0.0], pa.float64())),
    ],
)
def test_compatible_widths_are_accepted(name: str, arr: pa.Array) -> None:
    out = validate(set_col(table(), name, arr), TINY, "w.parquet")
    canonical = {
        "prompt_len": pa.int32(),
        "output_len": pa.int32(),
        "arrival_s": pa.float64(),
        "accept_rate": pa.float32(),
    }
    if name in canonical:
        assert out.schema.field(name).type == canonical[name]


def test_chunked_table_is_accepted() -> None:
    t = table()
    two = pa.concat_tables([t.slice(0, 2), t.slice(2)])
    assert two.column("prompt_ids").num_chunks == 2
    out = validate(two, TINY)
    assert out.num_rows == 4


# ---- refusals -------------------------------------------------------------------------------
CASES = [
    # (what, mutate, model?, expected message (regex, after "trace 'bad.parquet' "))
    (
        "missing column",
        lambda t: t.drop_columns(["output_len"]),
        False,
        r"column 'output_len': required column is missing",
    ),
    (
        "unknown column",
        lambda t: t.append_column("promt_len", pa.array([1, 2, 3, 4])),
        False,
        r"column 'promt_len': unknown column",
    ),
    (
        "string lengths",
        lambda t: set_col(t, "prompt_len", pa.array(["4", "3", "2", "5"])),
        False,
        r"column 'prompt_len': must be int, got string",
    ),
    (
        "float lengths",
        lambda t: set_col(t, "output_len", pa.array([2.0, 1, 3, float("nan")])),
        False,
        r"column 'output_len': must be int, got double",
    ),
    (
        "string arrival",
        lambda t: set_col(t, "arrival_s", pa.array(["0", "1", "2", "3"])),
        False,
        r"column 'arrival_s': must be float or int, got string",
    ),
    (
        "bool history as int",
        lambda t: set_col(t, "needs_history", pa.array([1, 0, 0, 1])),
        False,
        r"column 'needs_history': must be bool, got int64",
    ),
    (
        "zero length",
        lambda t: set_col(t, "prompt_len", pa.array([4, 3, 0, 5])),
        False,
        r"row 2 column 'prompt_len': must be >= 1, got 0",
    ),
    (
        "negative length",
        lambda t: set_col(t, "output_len", pa.array([2, -1, 3, 1])),
        False,
        r"row 1 column 'output_len': must be >= 1, got -1",
    ),
    (
        "huge length",
        lambda t: set_col(t, "output_len", pa.array([2, 1, 3, 2**40])),
        False,
        r"row 3 column 'output_len': must be <= 2147483647",
    ),
    (
        "null length",
        lambda t: set_col(t, "prompt_len", pa.array([4, None, 2, 5])),
        False,
        r"row 1 column 'prompt_len': must not be null",
    ),
    (
        "NaN arrival",
        lambda t: set_col(t, "arrival_s", pa.array([0.5, 0.1, np.nan, 0.0])),
        False,
        r"row 2 column 'arrival_s': must not be NaN",
    ),
    (
        "negative arrival",
        lambda t: set_col(t, "arrival_s", pa.array([0.5, -0.1, 0.5, 0.0])),
        False,
        r"row 1 column 'arrival_s': must be >= 0, got -0.1",
    ),
    (
        "infinite arrival",
        lambda t: set_col(t, "arrival_s", pa.array([0.5, 0.1, np.inf, 0.0])),
        False,
        r"row 2 column 'arrival_s': must be finite",
    ),
    (
        "duplicate int id",
        lambda t: set_col(t, "request_id", pa.array([3, 4, 5, 4])),
        False,
        r"row 3 column 'request_id': duplicate id 4 \(also row 1\)",
    ),
    (
        "duplicate str id",
        lambda t: set_col(t, "request_id", pa.array(["a", "a", "c", "d"])),
        False,
        r"row 1 column 'request_id': duplicate id 'a' \(also row 0\)",
    ),
    (
        "ids length mismatch",
        lambda t: set_col(t, "output_ids", pa.array([[5, 6], [4], [9, 9], [3]])),
        False,
        r"row 2 column 'output_ids': has 2 ids but output_len is 3",
    ),
    (
        "negative id",
        lambda t: set_col(t, "output_ids", pa.array([[5, 6], [4], [9, -9, 9], [3]])),
        False,
        r"row 2 column 'output_ids': token id must be >= 0, got -9 \(token 1\)",
    ),
    (
        "null id",
        lambda t: set_col(t, "output_ids", pa.array([[5, 6], [None], [9, 9, 9], [3]])),
        False,
        r"row 1 column 'output_ids': token id must not be null",
    ),
    (
        "id beyond vocab",
        lambda t: set_col(
            t, "prompt_ids", pa.array([[1, 2, 3, 4], [1, 2, 3], [7, 512], [1, 2, 9, 9, 9]])
        ),
        True,
        r"row 2 column 'prompt_ids': token id must be <= 511 \(model vocab 512\), got 512",
    ),
    (
        "beyond context",
        lambda t: set_col(t, "output_len", pa.array([2, 1, 3, 131_068])).drop_columns(
            ["output_ids"]
        ),
        True,
        r"row 3 column 'output_len': prompt_len \+ output_len = 131073 exceeds the context of "
        r"model 'tiny' \(131072 tokens\)",
    ),
    (
        "accept rate above 1",
        lambda t: set_col(t, "accept_rate", pa.array([0.5, 1.5, 1, 0], pa.float32())),
        False,
        r"row 1 column 'accept_rate': must be <= 1, got 1.5",
    ),
    (
        "prefix longer than prompt",
        lambda t: set_col(t, "prefix_len", pa.array([2, 4, 0, 2])),
        False,
        r"row 1 column 'prefix_len': must be <= prompt_len \(3\), got 4",
    ),
    (
        "prefix len without prefix id",
        lambda t: set_col(t, "prefix_len", pa.array([2, 2, 1, 2])),
        False,
        r"row 2 column 'prefix_len': must be 0 where prefix_id is null, got 1",
    ),
    (
        "prefix id without prefix len",
        lambda t: t.drop_columns(["prefix_len"]),
        False,
        r"column 'prefix_len': required when 'prefix_id' is present",
    ),
    (
        "prefix tokens differ",
        lambda t: set_col(
            t, "prompt_ids", pa.array([[1, 2, 3, 4], [1, 2, 3], [7, 8], [1, 5, 9, 9, 9]])
        ),
        False,
        r"row 3 column 'prompt_ids': differs at token 1 from row 0, which has the same prefix_id",
    ),
    ("no rows", lambda t: t.slice(0, 0), False, r"has no rows"),
]


@pytest.mark.parametrize("what,mutate,with_model,pattern", CASES, ids=[c[0] for c in CASES])
def test_malformed_is_refused_with_one_line(what, mutate, with_model, pattern) -> None:
    bad = mutate(table())
    with pytest.raises(TraceError) as e:
        validate(bad, TINY if with_model else None, name="bad.parquet")
    msg = str(e.value)
    assert "\n" not in msg
    assert re.match(r"trace 'bad\.parquet'[ :]", msg), msg
    assert re.search(pattern, msg), msg


@pytest.mark.parametrize("what,mutate,with_model,pattern", CASES, ids=[c[0] for c in CASES])
def test_malformed_file_is_refused_on_read(tmp_path: Path, what, mutate, with_model, pattern):
    path = tmp_path / "bad.parquet"
    pq.write_table(mutate(table()), path)
    with pytest.raises(TraceError, match=pattern):
        read_trace(path, TINY if with_model else None)


def test_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    t = full_trace()
    t.prompt_len = t.prompt_len.copy()
    t.prompt_len[1] = 0
    with pytest.raises(TraceError, match=r"row 1 column 'prompt_len'"):
        write_trace(t, tmp_path / "out.parquet")
    assert list(tmp_path.iterdir()) == []


def test_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = write_trace(full_trace(), tmp_path / "out.parquet")
    before = path.read_bytes()
    t = full_trace()
    t.arrival_s = np.array([0.0, np.nan, 1.0, 2.0])
    with pytest.raises(TraceError, match="NaN"):
        write_trace(t, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["out.parquet"]


def test_write_checks_the_model_too(tmp_path: Path) -> None:
    t = make_trace([0.0], [131_000], [100])
    with pytest.raises(TraceError, match="exceeds the context"):
        write_trace(t, tmp_path / "long.parquet", TINY)
    assert list(tmp_path.iterdir()) == []


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "missing.parquet")
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(TraceError, match="not a readable parquet file"):
        read_trace(junk)


def test_sha256_is_the_file_hash(tmp_path: Path) -> None:
    path = write_trace(full_trace(), tmp_path / "t.parquet")
    assert trace_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_write_is_deterministic(tmp_path: Path) -> None:
    a = write_trace(full_trace(), tmp_path / "a.parquet")
    b = write_trace(full_trace(), tmp_path / "b.parquet")
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.slow
def test_large_trace_round_trips(tmp_path: Path) -> None:
    """1M rows read back whole (the read is columnar; its speed is bench/sim_speed.py's job)."""
    n = 1_000_000
    rng = np.random.default_rng(0)
    t = make_trace(
        np.sort(rng.random(n) * 3600),
        rng.integers(1, 4000, n),
        rng.integers(1, 1000, n),
        needs_history=rng.random(n) < 0.3,
    )
    path = write_trace(t, tmp_path / "big.parquet")
    back = read_trace(path, TINY)
    assert len(back) == n
    assert np.array_equal(back.output_len, t.output_len)
