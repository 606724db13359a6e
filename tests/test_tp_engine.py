"""Tensor parallelism in the engine on CPU (gloo, two ranks, tiny models): the tokens of
tensor_parallel_size 2 equal those of 1 (random-weight preset and a safetensors checkpoint,
greedy and sampled with penalties, 1-3 batches in flight, mixed-step graphs run eagerly,
preemption), the step broadcast is recorded, a model that does not split is refused with one
line, and no worker process outlives its engine."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_cfg

from bubblesim.core.phases import BROADCAST, CPU_PHASES
from engine.engine import Engine
from engine.hooks import PHASE
from engine.loader import CheckpointError
from engine.requests import RequestInput

try:
    from tests.test_loader import CONFIG, random_weights, write_checkpoint
except ImportError:  # tests/ on sys.path, not the repo root
    from test_loader import CONFIG, random_weights, write_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

# sampled, with a repetition penalty strong enough that a worker rank without a new request's
# prompt history (engine.Engine._recv_inits) would pick other tokens than rank 0
RANDOM_PENALTIES = (("temperature", 0.8), ("top_k", 50), ("repetition_penalty", 4.0))


def requests(n: int = 10, history: bool = False, outputs=(4, 18)) -> list[RequestInput]:
    """Prompts of 3..120 tokens (chunked at 64 per step), `outputs` [lo, hi) output tokens;
    needs_history on every third request when `history`."""
    rng = np.random.default_rng(1)
    return [
        RequestInput(
            f"r{i}",
            int(rng.integers(3, 120)),
            int(rng.integers(*outputs)),
            needs_history=history and i % 3 == 0,
        )  # fmt: skip
        for i in range(n)
    ]


def tokens_of(cfg, reqs: list[RequestInput]) -> tuple[list[list[int]], Engine]:
    eng = Engine(cfg)
    try:
        outs = eng.run(reqs, arrival="asap")
    finally:
        eng.close()
    return [o.token_ids for o in outs], eng


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---- TP 2 = TP 1 -------------------------------------------------------------------------------


@pytest.mark.slow
def test_tp2_tokens_equal_tp1_and_the_broadcast_is_recorded():
    reqs = requests()
    ref, _ = tokens_of(make_cfg(), reqs)
    got, eng = tokens_of(make_cfg(tensor_parallel_size=2), reqs)
    assert got == ref
    tr = eng.trace
    b = tr.broadcast_ns
    assert b.shape == (tr.num_steps, 2) and (b[:, 0] > 0).all() and (b[:, 1] >= b[:, 0]).all()
    prep_end = tr.phase_ns[:, PHASE["prepare_inputs"], 1]
    launch_start = tr.phase_ns[:, PHASE["launch"], 0]
    assert (prep_end <= b[:, 0]).all() and (b[:, 1] <= launch_start).all()
    if BROADCAST in CPU_PHASES:  # the simulator's phase list has it: the same interval there
        assert (tr.phase_ns[:, PHASE[BROADCAST]] == b).all()


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw,history",
    [
        (dict(batches_in_flight=1), False),
        (dict(batches_in_flight=3, cuda_graphs=True, cuda_graphs_mixed=True), False),
        (dict(sampling=RANDOM_PENALTIES), True),  # new slots' history reaches the workers
        (dict(num_kv_blocks=12, batches_in_flight=3), False),  # preemption and recompute
    ],
    ids=["depth1", "depth3-mixed-graphs", "sampled-penalties", "preemption"],
)
def test_tp2_equals_tp1_across_loop_options(kw, history):
    reqs = requests(history=history, outputs=(30, 50) if "num_kv_blocks" in kw else (4, 18))
    ref, eng1 = tokens_of(make_cfg(**kw), reqs)
    got, _ = tokens_of(make_cfg(tensor_parallel_size=2, **kw), reqs)
    assert got == ref
    if kw.get("num_kv_blocks"):
        assert eng1.sched.num_preemptions > 0  # the case does preempt


@pytest.mark.slow
@pytest.mark.parametrize("vocab,tied", [(97, False), (96, True)], ids=["padded-vocab", "tied"])
def test_checkpoint_tp2_equals_tp1_and_ranks_read_their_slices(tmp_path: Path, vocab, tied):
    hf = {**CONFIG, "vocab_size": vocab, "tie_word_embeddings": tied}
    weights = random_weights(hf, seed=7)
    write_checkpoint(tmp_path / "ckpt", hf, weights, shards=2)
    kw = dict(model=str(tmp_path / "ckpt"), max_model_len=128, max_num_batched_tokens=32)
    reqs = [RequestInput(f"q{i}", 5 + 9 * i, 6) for i in range(6)]
    ref, _ = tokens_of(make_cfg(**kw), reqs)
    eng = Engine(make_cfg(tensor_parallel_size=2, **kw))
    try:
        got = [o.token_ids for o in eng.run(reqs, arrival="asap")]
        m = eng.model  # rank 0: the first half of every split dimension
        q, kv = 16, 8  # 2 of 4 query heads, 1 of 2 KV heads, head_dim 8
        qkv = m.layers[1].self_attn.qkv_proj
        w = "model.layers.1.self_attn."
        assert torch.equal(qkv[:q], weights[w + "q_proj.weight"][:q])
        assert torch.equal(qkv[q : q + kv], weights[w + "k_proj.weight"][:kv])
        assert torch.equal(qkv[q + kv :], weights[w + "v_proj.weight"][:kv])
        assert torch.equal(m.layers[1].self_attn.o_proj, weights[w + "o_proj.weight"][:, :q])
        assert torch.equal(m.embed_tokens, weights["model.embed_tokens.weight"][: -(-vocab // 2)])
        assert eng.kv_cache.shape[-2] == 1  # its KV head only
    finally:
        eng.close()
    assert got == ref


# ---- refusals and lifetime ---------------------------------------------------------------------


def test_heads_that_do_not_split_are_one_clear_error():
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError) as e:
        Engine(make_cfg(tensor_parallel_size=4))  # tiny: 2 KV heads
    msg = str(e.value)
    assert "\n" not in msg and "tensor_parallel_size" in msg and "num_kv_heads 2" in msg
    assert set(multiprocessing.active_children()) == before  # refused before any spawn


@pytest.mark.slow
def test_workers_exit_when_the_engine_closes():
    eng = Engine(make_cfg(tensor_parallel_size=2))
    pids = eng.model.comm.workers.pids
    assert len(pids) == 1 and all(alive(p) for p in pids)
    eng.run([RequestInput("a", 9, 3)], arrival="asap")
    eng.close()
    eng.close()  # idempotent
    assert not any(alive(p) for p in pids)
    assert not torch.distributed.is_initialized()  # the next engine may start its own group
    with pytest.raises(ValueError, match="worker ranks were stopped"):
        Engine(make_cfg(tensor_parallel_size=2), model=eng.model)


@pytest.mark.slow
def test_a_checkpoint_error_is_raised_once_and_no_worker_stays(tmp_path: Path):
    weights = random_weights(CONFIG)
    del weights["model.layers.1.mlp.up_proj.weight"]
    write_checkpoint(tmp_path / "bad", CONFIG, weights)
    before = set(multiprocessing.active_children())
    cfg = make_cfg(tensor_parallel_size=2, model=str(tmp_path / "bad"), max_model_len=128)
    with pytest.raises(CheckpointError, match="up_proj.weight' is missing"):
        Engine(cfg)
    assert set(multiprocessing.active_children()) == before
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_replay_run_with_tp2_is_complete_and_stops_its_workers(tmp_path: Path):
    from bubblesim.core.config import Config
    from bubblesim.core.runfmt import load_run
    from bubblesim.core.trace import make_trace, write_trace
    from replay.gpu.run import replay

    outs = [5, 3, 7]
    t = make_trace([0.0, 0.002, 0.004], [20, 35, 8], outs,
                   request_id=np.array(["a", "b", "c"], dtype=object))  # fmt: skip
    path = write_trace(t, tmp_path / "t.parquet")
    before = set(multiprocessing.active_children())
    res = replay(Config(model="tiny", device="cpu", tensor_parallel_size=2), path,
                 tmp_path / "run", repeat=2)  # fmt: skip
    run = load_run(tmp_path / "run")
    assert run.complete
    tp = res.summary["replay"]["tensor_parallel"]
    assert tp["size"] == 2 and tp["broadcast_steps"] == run.summary["num_steps"]
    assert tp["broadcast_us_p50"] > 0
    req = run.arrays("requests")
    assert dict(zip(req["request_id"].tolist(), req["output_tokens"].tolist())) == dict(
        zip("abc", outs)
    )
    assert set(multiprocessing.active_children()) == before
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_tp4_equals_tp1_on_a_model_with_4_kv_heads():
    reqs = [RequestInput(f"r{i}", 5 + 11 * i, 5) for i in range(4)]
    ref, _ = tokens_of(make_cfg(model="small"), reqs)
    got, _ = tokens_of(make_cfg(model="small", tensor_parallel_size=4), reqs)
    assert got == ref


CRASH = """
import os, sys
sys.path[:0] = [{root!r}, {tests!r}]
from helpers import make_cfg
from engine.engine import Engine
from engine.requests import RequestInput

if __name__ == "__main__":
    eng = Engine(make_cfg(tensor_parallel_size=2))
    eng.run([RequestInput("a", 9, 3)], arrival="asap")
    print(*eng.model.comm.workers.pids, flush=True)
    os._exit(3)  # rank 0 dies without closing anything (no atexit either)
"""


@pytest.mark.slow
def test_workers_exit_when_rank_0_dies_without_closing(tmp_path: Path):
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "crash.py"
    script.write_text(CRASH.format(root=str(root), tests=str(root / "tests")))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, cwd=root)  # fmt: skip
    assert res.returncode == 3, res.stderr[-2000:]
    pids = [int(p) for p in res.stdout.split()]
    assert len(pids) == 1
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


@pytest.mark.slow
def test_an_engine_that_fails_after_starting_its_workers_stops_them(monkeypatch):
    def fail(self):
        raise RuntimeError("injected start-up failure")

    monkeypatch.setattr(Engine, "_kv_blocks", fail)  # rank 0 only: workers import afresh
    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="injected"):
        Engine(make_cfg(tensor_parallel_size=2))
    assert set(multiprocessing.active_children()) == before
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["oneshot", "fused"])
def test_symmetric_allreduce_falls_back_on_the_cpu_with_the_same_tokens(capsys, algorithm):
    """tp_allreduce oneshot and fused need CUDA symmetric memory: on gloo the engine says so
    once and reduces through the process group before the norm, so the tokens are TP 1's."""
    reqs = requests()
    ref, _ = tokens_of(make_cfg(), reqs)
    got, eng = tokens_of(make_cfg(tensor_parallel_size=2, tp_allreduce=algorithm), reqs)
    assert got == ref
    assert f"tp_allreduce={algorithm}: no CUDA symmetric memory" in capsys.readouterr().out


@pytest.mark.slow
def test_tp8_equals_tp1_on_a_checkpoint_with_8_kv_heads(tmp_path: Path):
    """Any degree whose heads divide: 8 ranks (gloo, one process each) on a checkpoint with 8
    query and 8 KV heads (head_dim 8), a vocabulary that 8 does not divide; the tokens are
    TP 1's. No 8-GPU host is lent; this is the degree's plumbing on the CPU."""
    hf = {**CONFIG, "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 8,
          "vocab_size": 100}  # fmt: skip
    write_checkpoint(tmp_path / "ckpt", hf, random_weights(hf, seed=3), shards=2)
    kw = dict(model=str(tmp_path / "ckpt"), max_model_len=128, max_num_batched_tokens=32)
    reqs = [RequestInput(f"e{i}", 4 + 7 * i, 5) for i in range(4)]
    ref, _ = tokens_of(make_cfg(**kw), reqs)
    got, eng = tokens_of(make_cfg(tensor_parallel_size=8, **kw), reqs)
    assert got == ref
    assert eng.kv_cache.shape[-2] == 1  # one KV head per rank
