"""Speculative decoding in the engine loop (CPU, tiny model): drafts never change the output.

With forced token ids (n-gram-friendly text from traces/seed4_ngram.parquet, cut short, plus
smoke requests) speculative output equals plain output for ngram-cpu and ngram-gpu, k = 1..4,
1/2/3 batches in flight, seed 5 on and off; unforced greedy and penalised decoding too (those
catch a wrong position, KV slot or history, which forced ids would hide). Accepted counts equal
bubblesim.core.ngram's drafts checked against the text, step by step; every seed switch gives
identical
tokens and counts; the output lists keep their placeholder invariant. The GPU correction kernel
runs in the loop under TRITON_INTERPRET=1 in a subprocess; GPU tests skip without CUDA.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from bubblesim.core.ngram import accepted_prefix, propose
from bubblesim.core.request import Status
from bubblesim.core.trace import read_trace
from engine.attention import AttentionMetadata
from engine.engine import Engine
from engine.graphs import DecodeGraphs
from engine.inputs import QSL, SEQ_LENS
from engine.requests import RequestInput, inputs_from_trace

ROOT = Path(__file__).resolve().parents[1]
SEED4 = ROOT / "traces" / "seed4_ngram.parquet"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import make_cfg, run_interpreter_tests, slow_cases, spec_cfg  # noqa: E402
from test_engine import workload  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def text_requests(n: int = 6, prompt: int = 96, output: int = 40) -> list[RequestInput]:
    """Repetitive text (n-gram drafts get accepted), forced: the seed-4 trace's requests cut to
    their last `prompt` prompt ids and first `output` output ids; built from one stdlib file
    when the trace is missing."""
    if SEED4.exists():
        items = inputs_from_trace(read_trace(SEED4))[:n]
        pairs = [(np.asarray(r.prompt_ids), np.asarray(r.output_ids)) for r in items]
    else:
        import textwrap

        data = np.frombuffer(Path(textwrap.__file__).read_bytes(), np.uint8).astype(np.int32)
        pairs = [(data[i * 700 :], data[i * 700 + prompt :]) for i in range(n)]
    return [
        RequestInput(f"t{i}", prompt, output, 0.0, p[-prompt:] if SEED4.exists() else p[:prompt],
                     o[:output])
        for i, (p, o) in enumerate(pairs)
    ]  # fmt: skip


def mixed(forced: bool = True, history: bool = False) -> list[RequestInput]:
    reqs = text_requests() + workload(6, forced=True)
    out = []
    for i, r in enumerate(reqs):
        out.append(
            replace(
                r, output_ids=r.output_ids if forced else None, needs_history=history and i % 3 == 0
            )
        )
    return out


def run(cfg, reqs, on_step=None):
    eng = Engine(cfg)
    outs = eng.run(reqs, arrival="asap", on_step=on_step)
    return [o.token_ids for o in outs], eng


_PLAIN: dict = {}


def plain(reqs_key: str, reqs, **kw):
    key = (reqs_key, tuple(sorted(kw.items())))
    if key not in _PLAIN:
        _PLAIN[key] = run(make_cfg(batches_in_flight=1, **kw), reqs)[0]
    return _PLAIN[key]


# ---- the same tokens --------------------------------------------------------------------------


@pytest.mark.parametrize("k", [*slow_cases(1, 2), 3, *slow_cases(4)])
@pytest.mark.parametrize(
    "method,depth,optimistic",
    [("ngram-cpu", 2, True)] + [("ngram-gpu", d, o) for d in (1, 2, 3) for o in (True, False)],
)
def test_forced_speculative_output_equals_plain_output(method, depth, optimistic, k):
    reqs = mixed()
    want = plain("forced", reqs)
    cfg = spec_cfg(method, k, batches_in_flight=depth, optimistic_spec_decode=optimistic)
    got, eng = run(cfg, reqs)
    assert got == want
    assert [len(t) for t in got] == [r.output_len for r in reqs]
    assert eng.depth == (1 if method == "ngram-cpu" else depth)
    assert eng.sd.num_accepted > 20 * k  # drafts really were accepted
    assert sum(s.draft_tokens for s in eng.trace.shapes) > eng.sd.num_accepted
    assert not eng.sched.has_unfinished and sorted(eng.slots.free) == list(range(8))


@pytest.mark.parametrize("history", [*slow_cases(False), True], ids=["greedy", "greedy-penalties"])
@pytest.mark.parametrize(
    "method,depth,optimistic",
    [
        ("ngram-cpu", 1, True),
        ("ngram-gpu", 2, True),
        ("ngram-gpu", 3, True),
        ("ngram-gpu", 3, False),
    ],
)
def test_unforced_speculative_output_equals_plain_output(method, depth, optimistic, history):
    """Tokens come from the model: a wrong position, KV slot, rolled-back KV or penalty history
    would change them."""
    reqs = mixed(forced=False, history=history)
    want = plain(f"free-{history}", reqs)
    cfg = spec_cfg(method, 3, batches_in_flight=depth, optimistic_spec_decode=optimistic)
    got, eng = run(cfg, reqs)
    assert got == want
    assert eng.sd.num_accepted > 0


def test_seeded_random_sampling_is_unchanged_by_drafts():
    """Verification against the sampled targets keeps counter-based sampling exact."""
    sampling = (("temperature", 0.8), ("top_k", 50))
    reqs = mixed(forced=False, history=True)
    want = plain("random", reqs, sampling=sampling)
    got, _ = run(spec_cfg("ngram-gpu", 2, batches_in_flight=2, sampling=sampling), reqs)
    assert got == want


def test_preemption_with_drafts_gives_the_same_tokens():
    reqs = mixed(forced=False)
    want = plain("free-False", reqs)
    got, eng = run(spec_cfg("ngram-gpu", 3, batches_in_flight=2, num_kv_blocks=40), reqs)
    assert eng.sched.num_preemptions > 0
    assert got == want
    got, eng = run(spec_cfg("ngram-cpu", 3, num_kv_blocks=40), reqs)
    assert eng.sched.num_preemptions > 0
    assert got == want


def test_verification_rows_see_their_preceding_drafts_in_the_penalty_history():
    """Row j of a verification step samples after drafts 0..j-1: its penalties must count them,
    as a plain step would once they are accepted (checked against one-row-at-a-time sampling)."""
    from engine.sampler import Sampler, SampleRows
    from engine.spec.decoder import SpecDecoder

    cfg = spec_cfg("ngram-gpu", 3).replace(**{"sampling.frequency_penalty": 0.5})
    vocab, q, cpu = 12, 4, torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    prompt, outputs = np.array([1, 2, 3], np.int32), np.array([4, 4], np.int32)

    def fresh() -> Sampler:
        s = Sampler(cfg.sampling, 0, 2, vocab, cpu)
        s.init_slot(1, (prompt, outputs), None)
        return s

    def rows(n: int, first: int) -> SampleRows:
        i = torch.arange(first, first + n, dtype=torch.int32)
        one = torch.ones(n, dtype=torch.int32)
        return SampleRows(one, i, one, -one, torch.arange(n, dtype=torch.int32))

    differs = 0
    for _ in range(20):
        logits = torch.rand((q, vocab), generator=gen) * 0.5
        drafts = logits[:, :].argmax(-1)[:3].to(torch.int32)  # likely tokens, so penalties bite
        extra = SpecDecoder(cfg, 1, 64, cpu)._history_drafts(drafts[None], rows(q, 0), vocab)
        got = fresh().choose(logits.clone(), rows(q, 0), extra)
        ref_sampler = fresh()
        for j in range(q):
            ref = ref_sampler.choose(logits[j : j + 1].clone(), rows(1, j))
            assert got[j] == ref[0], j
            if j < 3:
                ref_sampler.count_tokens(torch.tensor([1]), drafts[j : j + 1])
        differs += (fresh().choose(logits.clone(), rows(q, 0)) != got).any().item()
    assert differs > 0  # the preceding drafts did change some choices


@pytest.mark.parametrize("method", ["ngram-gpu", "ngram-cpu"])
def test_penalty_history_counts_every_accepted_token(method):
    """After each step (one in flight), a running history request's token counts on the device
    equal its confirmed outputs: accepted drafts counted once, rejected ones not at all."""
    reqs = [replace(r, needs_history=True) for r in mixed()]  # forced: drafts get accepted
    checked = [0]

    def check(eng: Engine) -> None:
        for st in eng.states:
            r = st.req
            if r.status == Status.RUNNING and st.slot >= 0 and r.num_output_tokens:
                want = np.bincount(st.confirmed_outputs(), minlength=eng.spec.vocab_size)
                assert eng.sampler.counts[st.slot].tolist() == want.tolist(), r.request_id
                checked[0] += 1

    _, eng = run(spec_cfg(method, 3, batches_in_flight=1), reqs, on_step=check)
    assert eng.sd.num_accepted > 50 and checked[0] > 50


# ---- accepted counts ------------------------------------------------------------------------


def record_emitted(eng: Engine) -> list[tuple[int, int, int, int]]:
    """(request index, confirmed outputs before the step, drafts, emitted) per verified entry."""
    seen = []
    orig = eng.sd.emitted

    def emitted(flight):
        out = orig(flight)
        for e, n in zip(flight.batch.entries, out):
            if e.generates and e.num_drafts and e.req.status != Status.FINISHED:
                seen.append((e.req.index, e.req.num_output_tokens, e.num_drafts, n))
        return out

    eng.sd.emitted = emitted
    return seen


@pytest.mark.parametrize("method,depth", [("ngram-cpu", 1), ("ngram-gpu", 1), ("ngram-gpu", 3)])
def test_accepted_counts_equal_core_ngram_on_the_text(method, depth):
    reqs = mixed()
    k = 3
    eng = Engine(spec_cfg(method, k, batches_in_flight=depth))
    seen = record_emitted(eng)
    eng.run(reqs, arrival="asap")
    texts = [
        (list(np.asarray(r.prompt_ids if r.prompt_ids is not None else st.prompt_ids)),
         list(np.asarray(r.output_ids)))
        for r, st in zip(reqs, eng.states)
    ]  # fmt: skip
    total = 0
    for index, done, drafts, n in seen:
        prompt, output = texts[index]
        ctx = prompt + output[:done]
        ref = propose(ctx, k, 2, 4)[:drafts]
        assert n - 1 == accepted_prefix(ref, output[done : done + drafts]), (index, done)
        total += n - 1
    assert total == eng.sd.num_accepted > 50
    if method == "ngram-cpu":  # the draft hint = exactly what bubblesim.core.ngram proposed
        assert all(d <= k for _, _, d, _ in seen)
    if depth == 1:  # sequential reference: each step drafts min(k, room) from the true text
        for index, (prompt, output) in enumerate(texts):
            done, ref_total = 1, 0
            while done < len(output):
                room = len(output) - done - 1
                d = propose(prompt + output[:done], k, 2, 4)[: min(k, room)]
                a = accepted_prefix(d, output[done : done + len(d)])
                ref_total += a
                done += a + 1
            got = sum(n - 1 for i, _, _, n in seen if i == index)
            assert got == ref_total, index


# ---- switches ---------------------------------------------------------------------------------

SWITCHES = (
    "optimistic_spec_decode",
    "preallocated_backup_tokens",
    "accepted_count_by_sum",
    "reverse_placeholder_scan",
)


@pytest.mark.parametrize("method", ["ngram-gpu", "ngram-cpu"])
@pytest.mark.slow
def test_every_seed_switch_gives_identical_tokens_and_counts(method):
    reqs = mixed(forced=False, history=True)
    base_cfg = spec_cfg(method, 3, batches_in_flight=3)
    want, eng = run(base_cfg, reqs)
    want_acc = eng.sd.num_accepted
    for name in SWITCHES:
        cfg = base_cfg.replace(**{name: not getattr(base_cfg, name)})
        got, eng = run(cfg, reqs)
        assert got == want, name
        assert eng.sd.num_accepted == want_acc, name
    off = base_cfg.replace(**dict.fromkeys(SWITCHES, False))
    assert run(off, reqs)[0] == want


def test_seed5_off_corrects_on_the_host_and_on_corrects_on_the_device(monkeypatch):
    """Both launch the one input kernel every step (engine.spec.slot_mapping); only seed 5 on
    asks it to correct, only seed 5 off shifts on the host."""
    import engine.spec.decoder as dec

    calls = {"fix": 0, "plain": 0, "host": 0}
    kernel, host = dec.finish_inputs, dec.SpecDecoder.host_shift

    def count_kernel(*a, **kw):
        calls["fix" if a[-1] else "plain"] += 1
        return kernel(*a, **kw)

    def count_host(self, *a):
        calls["host"] += 1
        return host(self, *a)

    monkeypatch.setattr(dec, "finish_inputs", count_kernel)
    monkeypatch.setattr(dec.SpecDecoder, "host_shift", count_host)
    reqs = mixed()
    _, eng = run(spec_cfg("ngram-gpu", 2, batches_in_flight=2, optimistic_spec_decode=True), reqs)
    assert calls["fix"] > 20 and calls["host"] == 0
    assert calls["fix"] + calls["plain"] == eng.trace.num_steps
    calls.update(fix=0, plain=0)
    _, eng = run(spec_cfg("ngram-gpu", 2, batches_in_flight=2, optimistic_spec_decode=False), reqs)
    assert calls["fix"] == 0 and calls["host"] > 20
    assert calls["plain"] == eng.trace.num_steps


# ---- bookkeeping ------------------------------------------------------------------------------


def test_output_lists_keep_placeholders_at_the_tail_with_drafts():
    reqs = mixed(forced=False, history=True)
    seen = [0]

    def check(eng: Engine) -> None:
        for st in eng.states:
            r = st.req
            if r.status == Status.FINISHED:
                assert len(st.output) == r.output_len and -1 not in st.output
                continue
            assert len(st.output) == r.num_output_tokens + r.num_placeholders
            assert -1 not in st.output[: r.num_output_tokens]
            seen[0] += r.num_placeholders > 1
        eng.sched.check_invariants()

    run(spec_cfg("ngram-gpu", 3, batches_in_flight=3), reqs, on_step=check)
    assert seen[0] > 0


def test_ngram_cpu_drafts_follow_the_hints_and_every_phase_is_recorded():
    reqs = mixed()
    _, eng = run(spec_cfg("ngram-cpu", 4, batches_in_flight=3), reqs)
    shapes = eng.trace.shapes
    per_req = {(s.draft_tokens, s.decode_tokens - s.draft_tokens) for s in shapes}
    assert any(d % 4 for d, n in per_req if n)  # fewer than k drafts where the text has fewer
    ph = eng.trace.phase_ns
    assert (ph[:, :, 0] >= 0).all()


class EagerSpecGraphs(DecodeGraphs):
    """The CUDA-graph layout for k + 1 tokens per request (padded bucket, fixed views) run
    eagerly; each replay is checked against the unpadded batch: padding rows own no tokens,
    write no KV and leave the real rows' logits alone."""

    def capture(self) -> None:
        self.replays = self.padded = 0

    def replay(self, bucket: int, with_history: bool = False) -> torch.Tensor:
        inp, q = self.inputs, self.query_len
        t = bucket * q
        t_real = int(inp.d_rows[QSL, bucket])
        b = t_real // q
        attn = AttentionMetadata(
            query_start_loc=inp.d_rows[QSL, : b + 1],
            seq_lens=inp.d_rows[SEQ_LENS, :b],
            block_tables=inp.batch_tables[:b],
            slot_mapping=inp.d_toks[2 * t : 2 * t + t_real],
            max_query_len=q,
            max_seq_len=int(inp.d_rows[SEQ_LENS, :b].max()),
        )
        pos = inp.d_toks[t : t + t_real]
        ref = self.model(inp.input_ids[:t_real], pos, attn, self.kv_cache)
        ref = self.model.compute_logits(ref)
        logits = self.forward_fn(bucket)()
        torch.testing.assert_close(logits[:t_real], ref, atol=1e-5, rtol=1e-5)
        self.replays += 1
        self.padded += bucket > b
        return logits


@pytest.mark.parametrize("optimistic", [True, False])
def test_uniform_decode_graph_layout_with_drafts(optimistic):
    reqs = mixed(forced=False)
    cfg = spec_cfg("ngram-gpu", 3, batches_in_flight=2, optimistic_spec_decode=optimistic,
                   max_num_seqs=12, num_kv_blocks=96)  # fmt: skip
    want = plain("free-False", reqs)
    eng = Engine(cfg)
    eng.graphs = EagerSpecGraphs(eng.model, eng.kv_cache, eng.inputs, 12, eng.max_model_len, 4)
    eng.graphs.capture()
    got = [o.token_ids for o in eng.run(reqs, arrival="asap")]
    assert eng.graphs.replays > 10 and eng.graphs.padded > 0
    assert got == want


# ---- the Triton correction kernel in the loop (interpreter) ----------------------------------


@pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET subprocess")
def test_interp_engine_with_triton_correction():
    from engine.spec import slot_mapping

    assert slot_mapping.use_triton(torch.device("cpu"))
    reqs = mixed(forced=False)[:8]
    want = run(make_cfg(batches_in_flight=1), reqs)[0]
    got, eng = run(spec_cfg("ngram-gpu", 3, batches_in_flight=3), reqs)
    assert got == want and eng.sd.num_accepted > 0


@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run")
@pytest.mark.slow
def test_engine_correction_kernel_under_interpreter():
    pytest.importorskip("triton")
    run_interpreter_tests(__file__, timeout_s=600)
