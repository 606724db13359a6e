"""Speculative-decoding parts on their own: the GPU n-gram proposer (=
bubblesim.core.ngram.propose),
greedy verification and both accepted-count forms (seed 2), backup token ids before/after
(seed 1), and the optimistic input correction (seed 5) as torch fallback and as a Triton kernel.

Triton runs on CPU only under TRITON_INTERPRET=1, set before the kernel is decorated, so
`test_triton_correction_under_interpreter` reruns this file's `test_interp_*` tests in a
subprocess with it set. GPU tests skip without CUDA.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run_interpreter_tests

from bubblesim.core.ngram import accepted_prefix, propose
from engine.spec.backup_tokens import BackupTokenIds, next_token_ids
from engine.spec.ngram_cpu import NgramProposerCPU
from engine.spec.ngram_gpu import NgramProposerGPU, propose_ngram
from engine.spec.slot_mapping import correct_inputs_torch, finish_inputs
from engine.spec.verify import (
    AcceptedCounts,
    count_valid_cat_argmax,
    count_valid_sum,
    greedy_accept,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available() and not INTERPRET
interp_only = pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET subprocess")


def padded(seqs: list[list[int]], width: int, rng: np.random.Generator, vocab: int) -> np.ndarray:
    """Rows holding seqs, the columns after each filled with in-vocabulary garbage (must be
    ignored: it would create false matches)."""
    rows = rng.integers(0, vocab, (len(seqs), width)).astype(np.int32)
    for i, s in enumerate(seqs):
        rows[i, : len(s)] = s
    return rows


def expected(seq: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    d = propose(seq, k, min_n, max_n)
    return d + [-1] * (k - len(d))


def text_ids() -> list[int]:
    """Bytes of a stdlib source file: natural, repetitive text (what prompt lookup is for)."""
    import textwrap

    return list(Path(textwrap.__file__).read_bytes()[:6000])


# ---- n-gram proposer -----------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [2, 3, 8, 256])
def test_ngram_gpu_equals_core_ngram_on_random_sequences(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(60):
        k = int(rng.integers(1, 6))
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        width = int(rng.integers(1, 80))
        lens = rng.integers(0, width + 1, 7)
        seqs = [rng.integers(0, vocab, n).tolist() for n in lens]
        rows = padded(seqs, width, rng, vocab)
        got = propose_ngram(torch.from_numpy(rows), torch.from_numpy(lens), k, min_n, max_n)
        assert got.dtype == torch.int32 and got.shape == (7, k)
        for s, g in zip(seqs, got.tolist()):
            assert g == expected(s, k, min_n, max_n), (s, k, min_n, max_n)


def test_ngram_gpu_equals_core_ngram_on_repetitive_sequences():
    rng = np.random.default_rng(1)
    text = text_ids()
    seqs = []
    for _ in range(40):  # windows of real text
        a = int(rng.integers(0, len(text) - 400))
        seqs.append(text[a : a + int(rng.integers(2, 400))])
    for period in (1, 2, 3, 5, 7):  # periodic sequences, with and without a broken tail
        base = rng.integers(0, 50, period).tolist()
        seq = (base * (200 // period + 1))[:200]
        seqs += [seq, seq[:-1] + [99], seq + base[:2]]
    width = max(len(s) for s in seqs) + 3
    rows = torch.from_numpy(padded(seqs, width, rng, 256))
    lens = torch.tensor([len(s) for s in seqs])
    for k, min_n, max_n in [(1, 1, 1), (3, 2, 4), (4, 1, 3), (8, 3, 5), (2, 4, 4)]:
        got = propose_ngram(rows, lens, k, min_n, max_n).tolist()
        for s, g in zip(seqs, got):
            assert g == expected(s, k, min_n, max_n)
    # the text really exercises matches, cut drafts (near the end) and misses
    got = propose_ngram(rows, lens, 3, 2, 4)
    full = (got >= 0).all(1).sum().item()
    assert full > 20 and (got[:, 0] < 0).sum() > 0


def test_ngram_gpu_edge_lengths():
    for seq, k, lo, hi in [
        ([], 3, 1, 3),
        ([5], 3, 1, 3),
        ([5, 5], 3, 1, 3),  # n=1 match at 0 -> one draft (cut at the end)
        ([5, 5, 5], 2, 2, 2),
        ([1, 2, 1, 2], 4, 1, 4),
        ([1, 2, 3, 1, 2], 4, 3, 4),  # no length-3 match
    ]:
        rows = torch.tensor([seq + [9] * 3], dtype=torch.int32)
        got = propose_ngram(rows, torch.tensor([len(seq)]), k, lo, hi)[0].tolist()
        assert got == expected(seq, k, lo, hi), seq
    assert propose_ngram(torch.tensor([[5, 5]], dtype=torch.int32), torch.tensor([2]), 3, 1, 3)[
        0
    ].tolist() == [5, -1, -1]


def test_ngram_proposer_buffer_follows_a_growing_sequence():
    """reset_slot + append (verification rows with -1 tails) + propose, slot by slot, equals
    bubblesim.core.ngram on each request's token list; other slots and the trash row never leak
    in."""
    rng = np.random.default_rng(2)
    text = text_ids()
    k = 3
    prop = NgramProposerGPU(4, 256, k, 2, 4, torch.device("cpu"))
    assert prop.buffer_bytes == 5 * 256 * 4
    seqs: dict[int, list[int]] = {}
    for slot in (0, 2, 3):
        a = int(rng.integers(0, 3000))
        seqs[slot] = text[a : a + int(rng.integers(5, 40))]
        prop.reset_slot(slot, np.array(seqs[slot]))
    prop.reset_slot(1, np.array(text[:200]))  # a neighbour that is never proposed for
    slots = torch.tensor([3, 0, 2])
    for _ in range(30):
        got = prop.propose(slots, max_len=max(len(s) for s in seqs.values()) + 1).tolist()
        rows = []
        for slot, g in zip(slots.tolist(), got):
            s = seqs[slot]
            assert g == expected(s, k, 2, 4)
            n = int(rng.integers(1, k + 2))  # emitted tokens (accepted + bonus)
            new = text[len(s) + 100 : len(s) + 100 + n]
            s.extend(new)
            rows.append(new + [-1] * (k + 1 - n))
        prop.append(slots, torch.tensor(rows, dtype=torch.int32))
    for slot, s in seqs.items():
        assert prop.num_tokens[slot].item() == len(s)
        assert prop.token_ids[slot, : len(s)].tolist() == s
    assert prop.token_ids[1, :200].tolist() == text[:200]


def test_cpu_and_gpu_proposers_agree_step_by_step():
    text = text_ids()
    cpu = NgramProposerCPU(3, 2, 4)
    gpu_prop = NgramProposerGPU(2, 512, 3, 2, 4, torch.device("cpu"))
    cpu.start(7, np.array(text[:50]))
    gpu_prop.reset_slot(1, np.array(text[:50]))
    n = 50
    for step in range(40):
        d_cpu = cpu.propose(7)
        d_gpu = gpu_prop.propose(torch.tensor([1]))[0].tolist()
        assert d_gpu == d_cpu + [-1] * (3 - len(d_cpu)), step
        new = text[n : n + 1 + step % 3]
        n += len(new)
        cpu.extend(7, new)
        gpu_prop.append(torch.tensor([1]), torch.tensor([new + [-1] * (4 - len(new))]))
    assert cpu.tokens[7] == text[:n]
    cpu.drop(7)
    assert 7 not in cpu.tokens


# ---- verification and accepted counts ------------------------------------------------------------


def reference_accept(drafts: list[int], target: list[int]) -> list[int]:
    a = accepted_prefix([d for d in drafts if d >= 0], target)
    a = min(a, next((i for i, d in enumerate(drafts) if d < 0), len(drafts)))
    return target[: a + 1] + [-1] * (len(target) - a - 1)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_accept_and_both_count_forms(k):
    rng = np.random.default_rng(k)
    b = 64
    target = rng.integers(0, 4, (b, k + 1)).astype(np.int32)
    drafts = np.where(rng.random((b, k)) < 0.7, target[:, :k], rng.integers(0, 4, (b, k)))
    num = rng.integers(0, k + 1, b)  # rows with fewer drafts: -1 after them
    drafts = np.where(np.arange(k)[None, :] < num[:, None], drafts, -1).astype(np.int32)
    ids = greedy_accept(torch.from_numpy(drafts), torch.from_numpy(target))
    ref = [reference_accept(d, t) for d, t in zip(drafts.tolist(), target.tolist())]
    assert ids.tolist() == ref
    valid = [sum(1 for x in r if x >= 0) for r in ref]
    assert min(valid) >= 1 and max(valid) == k + 1 and len(set(valid)) > 1
    assert count_valid_cat_argmax(ids).tolist() == valid
    out = torch.full((b,), -7, dtype=torch.int64)
    assert count_valid_sum(ids, out) is out
    assert out.tolist() == valid
    into = torch.empty_like(ids)
    assert greedy_accept(torch.from_numpy(drafts), torch.from_numpy(target), into) is into
    assert into.tolist() == ref


@pytest.mark.parametrize("by_sum", [False, True])
def test_accepted_counts_ring(by_sum):
    counts = AcceptedCounts(2, 8, torch.device("cpu"), by_sum)
    ids = torch.tensor([[3, -1, -1], [1, 2, 3], [4, 5, -1]], dtype=torch.int32)
    dev = counts.count(1, ids)
    assert dev.tolist() == [1, 3, 2]
    assert counts.ready(1)
    counts.wait(1)
    assert counts.counts(1, 3).tolist() == [1, 3, 2]
    assert counts.counts(0, 3).tolist() == [0, 0, 0]


# ---- backup tokens -------------------------------------------------------------------------------


def test_backup_tokens_before_and_after_are_identical():
    rng = np.random.default_rng(3)
    tokens = [rng.integers(0, 1000, int(rng.integers(1, 50))).astype(np.int32) for _ in range(9)]
    known = np.array([int(rng.integers(1, len(t) + 1)) for t in tokens], dtype=np.int32)
    want = [int(t[n - 1]) for t, n in zip(tokens, known)]
    outs = []
    for pre in (False, True):
        b = BackupTokenIds(2, 16, torch.device("cpu"), preallocated=pre)
        got = b.prepare(1, tokens, known, 9)
        assert got.dtype == torch.int32 and got.tolist() == want
        assert b.bufs[1].np[:9].tolist() == want and not b.bufs[0].np.any()
        assert b.prepare(1, tokens, known, 4).tolist() == want[:4]
        outs.append(got.tolist())
    assert outs[0] == outs[1]


def test_next_token_ids_pick_the_last_valid_token_or_the_backup():
    ids = torch.tensor([[3, -1, -1], [1, 2, 3], [4, 5, -1], [0, -1, -1]], dtype=torch.int32)
    num = count_valid_sum(ids, torch.empty(4, dtype=torch.int64))
    discard = torch.tensor([False, False, False, True])
    backup = torch.tensor([10, 11, 12, 13], dtype=torch.int32)
    assert next_token_ids(ids, num, discard, backup).tolist() == [3, 3, 5, 13]


# ---- optimistic correction (seed 5) --------------------------------------------------------------


def correction_case(seed: int, num_aux: int = 2):
    """A mixed step (decodes with k+1 tokens, prefill chunks, padding tokens at the end), its
    inputs prepared as if all drafts of in-flight steps were accepted, and the expected fix."""
    rng = np.random.default_rng(seed)
    bs, k = 4, 3
    b = int(rng.integers(1, 9))
    num_slots = 12
    slots = rng.permutation(num_slots)[:b]
    rejected = rng.integers(0, 20, num_slots).astype(np.int32)
    known = np.zeros(b, np.int32)
    qlen, start = [], []
    for i in range(b):
        if rng.random() < 0.7:  # a decode whose in-flight steps may reject drafts
            qlen.append(k + 1)
            known[i] = rejected[slots[i]] - int(rng.integers(0, 2 * k + 1))
        else:  # a prefill chunk: nothing in flight
            qlen.append(int(rng.integers(1, 20)))
            known[i] = rejected[slots[i]]
        start.append(int(rng.integers(0, 40)))
    shift = rejected[slots] - known
    true_start = np.array(start)
    opt_start = true_start + shift  # what the CPU assumed
    max_blocks = (int(opt_start.max()) + max(qlen)) // bs + 1
    table = rng.permutation(b * max_blocks).reshape(b, max_blocks).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32)
    t_real = int(qsl[-1])
    t = t_real + 3  # graph-style padding tokens: owned by no row, left alone
    pos = np.zeros(t, np.int32)
    smap = np.full(t, -1, np.int32)
    aux = np.full((num_aux, t), -1, np.int32)
    want_pos, want_smap, want_aux = pos.copy(), smap.copy(), aux.copy()
    for i in range(b):
        for j in range(qlen[i]):
            tok = qsl[i] + j
            for src_start, p_arr, s_arr, a_arr in (
                (opt_start[i], pos, smap, aux),
                (true_start[i], want_pos, want_smap, want_aux),
            ):
                p = src_start + j
                p_arr[tok] = p
                s_arr[tok] = table[i, p // bs] * bs + p % bs
                for a in range(num_aux):
                    a_arr[a, tok] = -1 if (a + j) % 3 == 0 else p + 10 * a  # -1 stays -1
    seq_lens = opt_start + np.array(qlen)
    want_seq = true_start + np.array(qlen)
    i32 = lambda x: torch.tensor(np.asarray(x), dtype=torch.int32)  # noqa: E731
    inputs = dict(
        query_start_loc=i32(qsl),
        row_slot=i32(slots),
        known=i32(known),
        rejected_total=i32(rejected),
        positions=i32(pos),
        seq_lens=i32(seq_lens),
        slot_mapping=i32(smap),
        block_table=i32(table),
        block_size=bs,
        aux=i32(aux) if num_aux else None,
    )
    want = dict(positions=want_pos, seq_lens=want_seq, slot_mapping=want_smap)
    if num_aux:
        want["aux"] = want_aux
    return inputs, want


def packed_case(seed: int, fix: bool = True):
    """correction_case in the engine's layout (engine.spec.inputs): row fields [QSL, SEQ_LENS,
    ROW_SLOT, KNOWN] of width R, the token block [raw ids | positions | slot_mapping | out |
    forced], a per-slot block table, and raw ids that refer to a token source (-(i + 1), some
    entries -1 = no draft). Returns the finish_inputs arguments and the expected buffers."""
    inputs, want = correction_case(seed, num_aux=2)
    rng = np.random.default_rng(100 + seed)
    n = lambda x: x.numpy().copy()  # noqa: E731
    qsl, slots = n(inputs["query_start_loc"]), n(inputs["row_slot"])
    b, t = len(slots), len(n(inputs["positions"]))
    r = b + 4
    rows = np.full((4, r), 99, np.int32)  # junk past each field's length must stay
    rows[0, : b + 1], rows[0, b + 1 :] = qsl, qsl[-1]
    rows[1, :b], rows[2, :b], rows[3, :b] = n(inputs["seq_lens"]), slots, n(inputs["known"])
    source = rng.integers(-1, 500, 40).astype(np.int32)
    raw = np.where(rng.random(t) < 0.5, rng.integers(0, 500, t), -1 - rng.integers(0, 40, t))
    raw[qsl[-1] :] = 0  # padding tokens
    resolved = np.where(raw < 0, source[np.maximum(-1 - raw, 0)], raw).astype(np.int32)
    toks = np.concatenate(
        [raw, n(inputs["positions"]), n(inputs["slot_mapping"]), *n(inputs["aux"]), [77] * 5]
    ).astype(np.int32)  # junk after the block must stay
    num_slots, table = len(n(inputs["rejected_total"])), n(inputs["block_table"])
    per_slot = np.full((num_slots, table.shape[1] + 2), -5, np.int32)
    per_slot[slots, : table.shape[1]] = table
    expect_rows, expect_toks = rows.copy(), toks.copy()
    if fix:
        expect_rows[1, :b] = want["seq_lens"]
        for i, w in enumerate((want["positions"], want["slot_mapping"], *want["aux"])):
            expect_toks[(i + 1) * t : (i + 2) * t] = w
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    args = dict(
        rows=i32(rows),
        fields=(0, 1, 2, 3),
        toks=i32(toks),
        t=t,
        num_rows=b,
        token_source=i32(source),
        resolved=torch.full((t + 3,), -9, dtype=torch.int32),
        input_ids=torch.full((t + 3,), -9, dtype=torch.int32),
        rejected_total=inputs["rejected_total"],
        block_table=i32(per_slot),
        block_size=inputs["block_size"],
        fix=fix,
    )
    expect = dict(
        rows=expect_rows,
        toks=expect_toks,
        resolved=np.concatenate([resolved, [-9] * 3]),
        input_ids=np.concatenate([np.maximum(resolved, 0), [-9] * 3]),
    )
    return args, expect


def check_correction(triton_kernel: bool, device: str = "cpu") -> None:
    for seed in range(25):
        for fix in (True, False):
            args, expect = packed_case(seed, fix)
            args = {k: v.to(device) if torch.is_tensor(v) else v for k, v in args.items()}
            finish_inputs(**args, triton_kernel=triton_kernel)
            for name, w in expect.items():
                assert args[name].cpu().numpy().tolist() == w.tolist(), (seed, fix, name)


def test_correction_reference_on_separate_tensors():
    for seed in range(25):
        inputs, want = correction_case(seed, num_aux=seed % 3)
        correct_inputs_torch(*[inputs[n] for n in list(inputs)[:9]], inputs["aux"])
        for name, w in want.items():
            assert inputs[name].numpy().tolist() == w.tolist(), (seed, name)


def test_finish_inputs_torch_matches_reference():
    check_correction(triton_kernel=False)


def test_correction_with_nothing_rejected_changes_nothing():
    inputs, _ = correction_case(5)
    inputs["known"] = inputs["rejected_total"][inputs["row_slot"].long()].clone()
    before = {n: v.clone() for n, v in inputs.items() if torch.is_tensor(v)}
    correct_inputs_torch(*[inputs[n] for n in list(inputs)[:9]], inputs["aux"])
    for n, v in before.items():
        assert torch.equal(inputs[n], v), n


@interp_only
def test_interp_finish_inputs_triton_matches_reference():
    check_correction(triton_kernel=True)


# With CUDA the GPU test below runs the same cases on the compiled kernel. The interpreter is
# for CPU-only hosts: Triton 3.6's (the GPU host's) cannot run this kernel under NumPy 2 (its
# tensor `__index__` is int() of a 1-element array, which NumPy 2 refuses: the loop bounds
# loaded from `rows`); Triton 3.9's squeezes first.
@pytest.mark.skipif(INTERPRET or HAS_CUDA, reason="the interpreter run; with CUDA the GPU test")
@pytest.mark.slow
def test_triton_correction_under_interpreter():
    pytest.importorskip("triton")
    run_interpreter_tests(__file__, timeout_s=600)


@pytest.mark.skipif(INTERPRET or HAS_CUDA, reason="CPU-only check; GPU tests compile for real")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_finish_kernel_lowers_to_sm90_cubin():
    pytest.importorskip("triton.backends.nvidia")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.spec.slot_mapping import BLOCK_TOKENS, NUM_AUX, _finish_kernel

    p = "*i32"
    sig = dict(rows_ptr=p, toks_ptr=p, source_ptr=p, resolved_ptr=p, ids_ptr=p, rejected_ptr=p,
               table_ptr=p, row_stride="i32", table_stride="i32", block_size="i32", t="i32",
               num_rows="i32", fix="i32")  # fmt: skip
    consts = dict(QSL=0, SEQ_LENS=1, ROW_SLOT=2, KNOWN=9, NUM_AUX=NUM_AUX, BLOCK=BLOCK_TOKENS)
    names = _finish_kernel.arg_names
    src = ASTSource(
        fn=_finish_kernel,
        signature={**sig, **dict.fromkeys(consts, "constexpr")},
        constexprs={(names.index(n),): v for n, v in consts.items()},
    )
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


# ---- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_ngram_and_correction_match_cpu_without_host_sync():
    rng = np.random.default_rng(4)
    text = text_ids()
    seqs = [text[a : a + 300] for a in rng.integers(0, 5000, 32).tolist()]
    prop = NgramProposerGPU(32, 512, 4, 2, 4, torch.device("cuda"))
    for s, seq in enumerate(seqs):
        prop.reset_slot(s, np.array(seq))
    slots = torch.arange(32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        drafts = prop.propose(slots, max_len=320)
        ids = greedy_accept(drafts, torch.zeros((32, 5), dtype=torch.int32, device="cuda"))
        counts = AcceptedCounts(2, 32, torch.device("cuda"), by_sum=True)
        counts.count(0, ids)
        prop.append(slots, ids)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    counts.wait(0)
    assert drafts.cpu().tolist() == [expected(s, 4, 2, 4) for s in seqs]
    assert counts.counts(0, 32).tolist() == (ids >= 0).sum(1).cpu().tolist()
    check_correction(triton_kernel=True, device="cuda")
    check_correction(triton_kernel=False, device="cuda")
