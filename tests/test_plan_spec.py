"""Capacity planning input: SLOs, candidate files, --vary; bad input is one line, exit 2,
before any simulation (nothing written)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.cli import run_main
from bubblesim.core.config import Config
from bubblesim.core.trace import make_trace, write_trace
from bubblesim.plan import add_plan_parser
from bubblesim.plan.spec import SLO_KEYS, PlanError, load_plan_spec, parse_slos
from sim.__main__ import main


def test_package_exports_the_parser_hook() -> None:
    assert callable(add_plan_parser)


# ---- SLOs --------------------------------------------------------------------------------------
def test_slos_parse_in_a_fixed_order() -> None:
    slos = parse_slos(["tpot_p99_s=0.05", "ttft_p99_s=0.5", "itl_p99_s=0.1"])
    assert [s.key for s in slos] == ["ttft_p99_s", "tpot_p99_s", "itl_p99_s"]
    assert slos[0].metric == "ttft" and slos[0].quantile == "p99" and slos[0].limit_s == 0.5
    assert slos[0].q == 0.99
    assert slos[0].met({"ttft_s": {"p99": 0.5}}) and not slos[0].met({"ttft_s": {"p99": 0.51}})
    assert {"ttft_p50_s", "tpot_p50_s", "e2e_p99_s", "itl_p99_s"} <= set(SLO_KEYS)


@pytest.mark.parametrize(
    "items, words",
    [
        (None, "at least one --slo"),
        (["ttft_p98_s=1"], "KEY one of"),
        (["latency=1"], "KEY one of"),
        (["ttft_p99_s"], "KEY=SECONDS"),
        (["ttft_p99_s=fast"], "not a number"),
        (["ttft_p99_s=0"], "positive"),
        (["ttft_p99_s=-1"], "positive"),
        (["ttft_p99_s=nan"], "positive"),
        (["ttft_p99_s=1", "ttft_p99_s=2"], "given twice"),
    ],
)
def test_bad_slos(items: list[str] | None, words: str) -> None:
    with pytest.raises(PlanError, match=words):
        parse_slos(items)


# ---- candidates --------------------------------------------------------------------------------
def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cands.toml"
    p.write_text(text)
    return p


SLO = ["ttft_p99_s=1"]


def test_grid_is_a_product_in_key_then_value_order(tmp_path: Path) -> None:
    f = _write(
        tmp_path,
        """
[grid]
gpu = ["h100", "h200"]
batches_in_flight = [1, 2, 3]
spec.method = "none"
[[config]]
model = "llama3.2-1b"
gpu = "a100"
[[config]]           # a duplicate of a grid point is dropped
gpu = "h100"
batches_in_flight = 1
[prices]
h100 = 2.0
[search]
max_replicas = 8
loads = [2, 4]
""",
    )
    spec = load_plan_spec(SLO, Config(), f)
    names = [c.name for c in spec.candidates]
    assert len(names) == 7
    assert names[0] == "gpu=h100 batches_in_flight=1 spec.method=none"
    assert names[2] == "gpu=h100 batches_in_flight=3 spec.method=none"
    assert names[3].startswith("gpu=h200 batches_in_flight=1")
    assert names[6] == "model=llama3.2-1b gpu=a100"
    assert spec.candidates[0].price_per_hour == 2.0  # overridden
    assert spec.candidates[3].price_per_hour == 3.5  # bubblesim/core/gpus.py
    assert spec.candidates[4].config.batches_in_flight == 2
    assert spec.search.max_replicas == 8
    assert spec.search.loads == (1.0, 2.0, 4.0)  # the trace's own load always included
    assert [c.index for c in spec.candidates] == list(range(7))


def test_the_example_candidates_file_parses() -> None:
    example = Path(__file__).resolve().parents[1] / "bubblesim/plan/candidates.example.toml"
    spec = load_plan_spec(SLO, Config(), example)
    # the 70B table (2 routers) at its smallest fitting degree on an H200 (2) and the next (4)
    assert len(spec.candidates) == 2 * 3 * 2 * 2 + 2 * 2
    assert spec.candidates[-1].config.model == "llama3-70b"
    assert spec.candidates[-1].router == "prefix-aware"
    assert spec.search.loads == (1.0, 2.0, 4.0) and spec.search.max_replicas == 32


def test_no_file_is_the_base_config_alone() -> None:
    spec = load_plan_spec(SLO, Config(max_num_seqs=64))
    assert len(spec.candidates) == 1
    assert spec.candidates[0].name == "base"
    assert spec.candidates[0].config.max_num_seqs == 64


def test_vary_adds_grid_dimensions_and_routers() -> None:
    spec = load_plan_spec(
        SLO, Config(), vary=["batches_in_flight=1,2", "router=round-robin,prefix-aware"]
    )
    assert [(c.config.batches_in_flight, c.router) for c in spec.candidates] == [
        (1, "round-robin"),
        (1, "prefix-aware"),
        (2, "round-robin"),
        (2, "prefix-aware"),
    ]


@pytest.mark.parametrize(
    "text, words",
    [
        ("[gird]\ngpu='h100'", "unknown table 'gird'"),
        ("[grid]\nbatches_in_fligt = [1]", "unknown key 'batches_in_fligt'"),
        ("[grid]\nbatches_in_flight = [1, 5]", "batches_in_flight=5.*must be 1, 2 or 3"),
        ("[grid]\nbatches_in_flight = ['two']", "expected int"),
        ("[grid]\ngpu = ['h100', 'tpu']", "gpu=tpu.*unknown GPU 'tpu'"),
        ("[grid]\ngpu = []", "empty list"),
        ("[grid]\nrouter = ['random']", "router 'random'"),
        ("[[config]]\nspec.method = 'eagle'", r"\[\[config\]\] #1.*spec.method"),
        ("[prices]\nh100 = -1", "positive USD/hour"),
        ("[prices]\ntpu = 1", "unknown GPU 'tpu'"),
        ("[search]\nmax_replica = 3", "unknown key 'max_replica'"),
        ("[search]\nmax_replicas = 0", "max_replicas"),
        ("[search]\nmax_replicas = 2.5", "bad value"),
        ("[search]\nload_tol = 2", "load_tol"),
        ("[grid\n", "not valid TOML"),
    ],
)
def test_bad_candidate_files(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(PlanError, match=words):
        load_plan_spec(SLO, Config(), _write(tmp_path, text))


def test_missing_candidates_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="does not exist"):
        load_plan_spec(SLO, Config(), tmp_path / "nope.toml")


def test_bad_vary() -> None:
    with pytest.raises(PlanError, match="--vary 'batches_in_flight'"):
        load_plan_spec(SLO, Config(), vary=["batches_in_flight"])


# ---- the command refuses bad input before simulating ------------------------------------------
@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    n = 12
    tr = make_trace(np.arange(n) * 0.1, np.full(n, 200), np.full(n, 20))
    return write_trace(tr, tmp_path / "t.parquet")


def _cli_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        run_main(main, argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--slo", "ttft_p99=1"], "KEY one of"),
        ([], "at least one --slo"),
        (
            ["--slo", "ttft_p99_s=1", "--vary", "gpu=h100,l40s", "--set", "model=llama3-70b"]
            + ["--tp", "1"],
            "candidate 'gpu=h100'.*does not fit",
        ),
        (["--slo", "ttft_p99_s=1", "--set", "max_model_len=100"], "row 0.*exceeds the context"),
        (["--slo", "ttft_p99_s=1", "--set", "batches_in_flight=4"], "batches_in_flight"),
        (["--slo", "ttft_p99_s=1", "--loads", "1,x"], "--loads"),
        (["--slo", "ttft_p99_s=1", "--jobs", "0"], "--jobs"),
    ],
)
def test_cli_bad_input_exits_2_before_simulating(
    small_trace: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    words: str,
) -> None:
    out = tmp_path / "plan"
    err = _cli_error(["plan", str(small_trace), "-o", str(out), *extra], capsys)
    assert re.search(words, err), err
    assert not (out / "points.jsonl").exists()


def test_cli_missing_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _cli_error(["plan", str(tmp_path / "none.parquet"), "--slo", "ttft_p99_s=1"], capsys)
    assert "none.parquet" in err
