"""Importers: each format round-trips (import -> write -> read gives the same requests), and
bad input is refused with one line naming file, line and column."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from shared_data import SHARED_TRACES, needs_shared

from bubblesim.core.trace import TraceError, read_trace, write_trace
from bubblesim.workloads.importers import import_azure, import_lengths_csv
from bubblesim.workloads.mooncake import BLOCK_TOKENS, import_mooncake

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:50.9951690,879,31
2023-11-16 18:16:01.0000000,2,1000
"""


def round_trip(trace, tmp_path: Path):
    return read_trace(write_trace(trace, tmp_path / "rt.parquet"))


def test_azure_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "azure.csv"
    src.write_text(AZURE)
    t = import_azure(src)
    back = round_trip(t, tmp_path)
    np.testing.assert_allclose(back.arrival_s, [0.0, 4.314579, 4.314579, 14.31941])
    assert back.prompt_len.tolist() == [374, 396, 879, 2]
    assert back.output_len.tolist() == [44, 109, 31, 1000]
    assert back.request_id.tolist() == [0, 1, 2, 3]
    assert "CC-BY 4.0" in back.metadata["license"] and "Splitwise" in back.metadata["license"]


@pytest.mark.parametrize(
    "edit,pattern",
    [
        (
            ("374", "abc"),
            r"line 2 column 'ContextTokens': must be an integer in 1..2147483647, got 'abc'",
        ),
        (
            ("109", "0"),
            r"line 3 column 'GeneratedTokens': must be an integer in 1..2147483647, got '0'",
        ),
        (("2023-11-16 18:15:50.9951690,879", "yesterday,879"), r"line 4 column 'TIMESTAMP'"),
        (
            ("2023-11-16 18:16:01", "2023-11-16 18:00:01"),
            r"line 5 column 'TIMESTAMP': earlier than the first row",
        ),
        (("GeneratedTokens", "Generated"), r"column 'GeneratedTokens': missing"),
    ],
)
def test_azure_bad_rows(tmp_path: Path, edit: tuple[str, str], pattern: str) -> None:
    src = tmp_path / "azure.csv"
    src.write_text(AZURE.replace(*edit, 1))
    with pytest.raises(TraceError, match=pattern) as e:
        import_azure(src)
    assert "\n" not in str(e.value)


def mooncake_rows() -> list[dict]:
    return [
        {"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 250, "input_length": 1100, "output_length": 6, "hash_ids": [1, 2, 4]},
        {"timestamp": 300, "input_length": 400, "output_length": 7, "hash_ids": [1]},
        {"timestamp": 900, "input_length": 900, "output_length": 8, "hash_ids": [9, 10]},
        {"timestamp": 1000, "input_length": 700, "output_length": 9, "hash_ids": [1, 2]},
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_prefixes_and_round_trip(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "m.jsonl", mooncake_rows())
    t, dropped = import_mooncake(src)
    assert dropped == 0
    back = round_trip(t, tmp_path)
    np.testing.assert_allclose(back.arrival_s, [0, 0.25, 0.3, 0.9, 1.0])
    assert back.prompt_len.tolist() == [1500, 1100, 400, 900, 700]
    g = back.prefix_group
    assert g is not None and back.prefix_len is not None
    # rows 0, 1, 4 share the run [1, 2]; row 2 only [1] (shared with all), row 3 nothing
    assert g[0] == g[1] == g[4] >= 0 and g[2] >= 0 and g[2] != g[0] and g[3] == -1
    assert back.prefix_len.tolist() == [2 * BLOCK_TOKENS, 2 * BLOCK_TOKENS, 400, 0, 700]
    # the prefix ids are stable hashes of the runs: the same under another file
    t2, _ = import_mooncake(write_jsonl(tmp_path / "m2.jsonl", mooncake_rows()[::-1]))
    assert t2.prefix_keys is not None and t.prefix_keys is not None
    assert set(t2.prefix_keys.tolist()) == set(t.prefix_keys.tolist())
    assert "Apache-2.0" in back.metadata["license"]


def test_mooncake_drops_requests_beyond_a_length(tmp_path: Path) -> None:
    rows = mooncake_rows()
    src = write_jsonl(tmp_path / "m.jsonl", rows)
    t, dropped = import_mooncake(src, max_total_len=1000)
    assert dropped == 2 and len(t) == 3
    assert t.prefix_group is not None and t.prefix_group.tolist()[0] >= 0  # rows 2, 4 share [1]


@pytest.mark.parametrize(
    "line,pattern",
    [
        ("{not json", r"line 2: not JSON"),
        (
            '{"timestamp": 1, "input_length": 3, "output_length": 2}',
            r"line 2 column 'hash_ids': missing",
        ),
        (
            '{"timestamp": 1, "input_length": "3", "output_length": 2, "hash_ids": []}',
            r"line 2 column 'input_length'",
        ),
        (
            '{"timestamp": 1, "input_length": 0, "output_length": 2, "hash_ids": []}',
            r"line 2 column 'input_length': must be >= 1, got 0",
        ),
    ],
)
def test_mooncake_bad_lines(tmp_path: Path, line: str, pattern: str) -> None:
    src = tmp_path / "m.jsonl"
    src.write_text(json.dumps(mooncake_rows()[0]) + "\n" + line + "\n")
    with pytest.raises(TraceError, match=pattern):
        import_mooncake(src)


def test_lengths_csv_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "sharegpt.csv"
    src.write_text(
        "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"
        "74,918,992,0.08\n290,905,1195,0.32\n5,7,12,0.7\n"
    )
    t = import_lengths_csv(src, np.random.default_rng(0), "poisson", 2.0, 1.0)
    back = round_trip(t, tmp_path)
    assert back.prompt_len.tolist() == [74, 290, 5]
    assert back.output_len.tolist() == [918, 905, 7]
    assert back.arrival_s[0] == 0 and (np.diff(back.arrival_s) > 0).all()
    again = import_lengths_csv(src, np.random.default_rng(0), "poisson", 2.0, 1.0)
    np.testing.assert_array_equal(again.arrival_s, t.arrival_s)
    limited = import_lengths_csv(src, np.random.default_rng(0), "fixed", 1.0, 1.0, limit=2)
    assert limited.arrival_s.tolist() == [0.0, 1.0]


def test_lengths_csv_bad_value(tmp_path: Path) -> None:
    src = tmp_path / "l.csv"
    src.write_text("num_prefill_tokens,num_decode_tokens\n74,918\n-3,905\n")
    with pytest.raises(TraceError, match=r"line 3 column 'num_prefill_tokens'"):
        import_lengths_csv(src, np.random.default_rng(0), "poisson", 2.0, 1.0)


@needs_shared("azure_llm_2023")
@needs_shared("mooncake_fast25")
def test_real_sources_import(tmp_path: Path) -> None:
    az = import_azure(SHARED_TRACES / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv")
    assert len(az) == 19_366 and az.arrival_s.max() == pytest.approx(3501.7, abs=0.1)
    mc, dropped = import_mooncake(
        SHARED_TRACES / "mooncake_fast25" / "synthetic_trace.jsonl", 131_072
    )
    assert len(mc) + dropped == 3_993 and dropped == 10
    back = round_trip(mc, tmp_path)
    assert back.prefix_group is not None and (back.prefix_group >= 0).mean() > 0.5
