"""Speculative decoding in the engine loop: what each phase does with drafts.

    prepare_inputs  new slots: reset draft state; seed 5 off: wait for the accepted counts of
                    the in-flight steps and correct positions on the host; seed 5 on: the GPU
                    corrects them in the kernel that resolves the input ids (`correct`,
                    engine.spec.slot_mapping)
    sample          target tokens for the k + 1 rows of each generating request, greedy
                    verification (rejected = -1), accepted counts (seed 2) and their D2H copy,
                    backup + next token ids (seed 1), per-slot state (last token, penalties)
    draft           ngram-gpu: append the accepted tokens to the device token buffer and
                    propose into the draft table (no host work); ngram-cpu: wait for the tokens
                    (a sync) and run bubblesim.core.ngram over the CPU token lists, setting draft
                    hints
    process_outputs counts -> emitted (accepted + 1) for the policy's rewind

Per-slot device state: `token_source` = [last token (S) | draft table (S x k)] (input ids
-(i + 1) read it), `rejected_total` (drafts rejected so far for the slot's request). The host
keeps `rejected_known` (the part applied by `process`), so shift = total - known is what the CPU
assumed accepted while those steps were in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from bubblesim.core.config import Config
from bubblesim.core.policy import ScheduledBatch
from bubblesim.core.request import Status
from engine.inputs import QSL, ROW_SLOT, SEQ_LENS
from engine.requests import RequestState
from engine.sampler import Sampler, SampleRows
from engine.spec.backup_tokens import BackupTokenIds, next_token_ids
from engine.spec.inputs import KNOWN, SpecViews
from engine.spec.ngram_cpu import NgramProposerCPU
from engine.spec.ngram_gpu import NgramProposerGPU
from engine.spec.slot_mapping import finish_inputs
from engine.spec.verify import AcceptedCounts, greedy_accept


class SpecDecoder:
    def __init__(self, cfg: Config, depth: int, max_model_len: int, device: torch.device) -> None:
        sc = cfg.spec
        n = cfg.max_num_seqs
        self.k, self.num_slots, self.device = sc.k, n, device
        self.on_gpu = sc.method == "ngram-gpu"
        self.optimistic = cfg.optimistic_spec_decode
        self.token_source = torch.zeros(n * (1 + sc.k), dtype=torch.int32, device=device)
        self.last_sampled = self.token_source[:n]
        self.draft_table = self.token_source[n:].view(n, sc.k)
        self.counts = AcceptedCounts(depth, n, device, cfg.accepted_count_by_sum)
        self.backup = BackupTokenIds(depth, n, device, cfg.preallocated_backup_tokens)
        self.rejected_total = torch.zeros(n, dtype=torch.int32, device=device)
        self.rejected_known = np.zeros(n, dtype=np.int64)
        self.num_tokens_no_spec = np.zeros(n, dtype=np.int64)  # per batch row, reused
        self.gpu_proposer: NgramProposerGPU | None = None
        self.cpu_proposer: NgramProposerCPU | None = None
        if self.on_gpu:
            self.gpu_proposer = NgramProposerGPU(n, max_model_len, sc.k, sc.min_n, sc.max_n, device)
        else:
            self.cpu_proposer = NgramProposerCPU(sc.k, sc.min_n, sc.max_n)
        self.cpu_drafts: dict[int, list[int]] = {}  # request index -> drafts (ngram-cpu)
        self.num_accepted = 0  # drafts accepted over the engine's life (statistics)

    # ---- prepare_inputs ----------------------------------------------------------------------
    def take_slot(self, st: RequestState) -> None:
        """Host side of a request taking a slot (before its first step is filled)."""
        req = st.req
        self.rejected_known[st.slot] = 0
        if self.cpu_proposer is not None:
            known = st.token_ids[: req.prompt_len + req.num_output_tokens]
            self.cpu_proposer.start(req.index, known)
            self.cpu_drafts[req.index] = []
            req.draft_hint = 0

    def reset_slot(self, st: RequestState) -> None:
        """Device side: the slot's draft state starts from the request's known tokens
        (enqueued after any earlier owner's in-flight work, before this step's)."""
        slot, req = st.slot, st.req
        self.draft_table[slot].fill_(-1)
        self.rejected_total[slot].fill_(0)  # a device fill: `= 0` copies a host scalar (syncs)
        if self.gpu_proposer is not None:
            known = st.token_ids[: req.prompt_len + req.num_output_tokens]
            self.gpu_proposer.reset_slot(slot, known)

    def release(self, st: RequestState) -> None:
        if self.cpu_proposer is not None:
            self.cpu_proposer.drop(st.req.index)
            self.cpu_drafts.pop(st.req.index, None)

    @staticmethod
    def drafts_in_flight(inflight: Sequence) -> bool:
        return any(f.batch.shape.draft_tokens for f in inflight)

    def host_shift(self, inflight: Sequence, states: list[RequestState]) -> np.ndarray:
        """Seed 5 off (counts already waited for): per slot, the drafts the in-flight steps
        rejected, which the scheduler's positions still count."""
        shift = np.zeros(self.num_slots, dtype=np.int64)
        for f in inflight:
            counts = self.counts.counts(f.ring, f.num_gen)
            g = 0
            for e in f.batch.entries:
                if not e.generates:
                    continue
                slot = states[e.req.index].slot
                if e.num_drafts and slot >= 0:
                    shift[slot] += e.num_drafts + 1 - int(counts[g])
                g += 1
        return shift

    def correct(self, step, block_size: int) -> None:
        """The step's device-side input work, right after `send`, one kernel whatever seed 5
        says (engine.spec.slot_mapping): input ids from the token source and, seed 5 on, the
        shift of positions, seq_lens, slot mapping and sampling indices by the rejections the
        GPU knows and the CPU did not."""
        sv: SpecViews = step.spec
        finish_inputs(
            sv.d_rows,
            (QSL, SEQ_LENS, ROW_SLOT, KNOWN),
            sv.d_toks,
            sv.padded_tokens,
            step.num_reqs,
            self.token_source,
            sv.resolved,
            sv.input_ids,
            self.rejected_total,
            sv.block_table,
            block_size,
            sv.needs_correction,
        )

    # ---- sample --------------------------------------------------------------------------------
    def sample(
        self,
        sampler: Sampler,
        batch: ScheduledBatch,
        states: list[RequestState],
        step,
        logits: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Targets, verification and per-slot state for a step; out int32 [G * (k + 1)] gets
        the verified ids (rejected = -1), row-major by generating entry."""
        sv: SpecViews = step.spec
        g, q = step.num_gen, self.k + 1
        backup = self._backup_tokens(batch, states, step)
        if not g:
            return
        li = sv.logits_idx  # [G, q]
        ok = li[:, 1:] > li[:, :-1]  # draft j exists (the row did not clamp)
        drafts = torch.where(ok, sv.resolved[li[:, 1:].long()], -1)  # [G, k]
        rows = self._rows(step, sampler.forced)
        extra = None
        if rows.hist_rows.numel():
            extra = self._history_drafts(drafts, rows, sampler.vocab)
        target = sampler.choose(logits[: g * q], rows, extra).view(g, q)
        ids = greedy_accept(drafts, target, out=out.view(g, q))
        counts = self.counts.count(step.ring, ids)  # seed 2, then D2H + event
        nd = sv.num_drafts
        self.rejected_total[sv.gen_slot.long()] += (nd + 1 - counts).to(torch.int32)
        # seed 1: the next token of every row, the backup where its tokens are discarded
        rg = sv.row_gen.long()
        has = rg >= 0
        gi = rg.clamp(min=0)
        nxt = next_token_ids(ids[gi], counts[gi], ~has, backup)
        self.last_sampled[sv.row_slot.long()] = nxt
        h = rows.hist_rows
        if h.numel():  # penalties' history: the accepted tokens of history rows
            hg = h.view(-1, q)[:, 0].long() // q  # generating entries with history
            acc = ids[hg]  # [Hg, q]
            slots = sv.gen_slot[hg].long()[:, None].expand_as(acc)
            valid = (acc >= 0).reshape(-1)
            sampler.count_tokens(slots.reshape(-1), acc.clamp(min=0).reshape(-1), valid)

    def _backup_tokens(self, batch, states, step) -> torch.Tensor:
        """Seed 1's host part: the backup token of every batch row (its last known token),
        then one copy to the device."""
        toks = []
        nts = self.num_tokens_no_spec
        for i, e in enumerate(batch.entries):
            toks.append(states[e.req.index].token_ids)
            nts[i] = e.req.prompt_len + e.req.num_output_tokens
        return self.backup.prepare(step.ring, toks, nts, step.num_reqs)

    def _rows(self, step, forced: torch.Tensor) -> SampleRows:
        """Sampling rows with output / forced indices gathered from the (corrected) tokens.
        A row past the request's forced ids (a step in flight over-emitted: its tokens are
        cut) is not forced."""
        sv: SpecViews = step.spec
        li = step.logits_idx.long()
        out_idx = sv.aux[0][li]
        f_idx = sv.aux[1][li]
        ok = (out_idx < forced.shape[1]) & (
            forced.view(-1)[f_idx.clamp(0, forced.numel() - 1)] >= 0
        )
        return replace(step.rows, out_idx=out_idx, forced_idx=torch.where(ok, f_idx, -1))

    def _history_drafts(self, drafts: torch.Tensor, rows: SampleRows, vocab: int) -> torch.Tensor:
        """int32 [H, V]: for history row (g, j), one count per draft g[0 .. j-1] (the tokens
        it follows if they are accepted)."""
        q = self.k + 1
        h = rows.hist_rows.long()
        g, j = h // q, h % q
        d = drafts[g]  # [H, k]
        cols = torch.arange(self.k, device=d.device)[None, :]
        use = ((cols < j[:, None]) & (d >= 0)).to(torch.int32)
        extra = torch.zeros((h.numel(), vocab), dtype=torch.int32, device=d.device)
        extra.scatter_add_(1, d.clamp(min=0).long(), use)
        return extra

    # ---- draft -----------------------------------------------------------------------------------
    def draft_gpu(self, batch: ScheduledBatch, step, ids: torch.Tensor) -> None:
        """ngram-gpu: accepted tokens into the token buffer, then proposals for the next step
        into the draft table. Host work: launches only."""
        assert self.gpu_proposer is not None
        g = step.num_gen
        if not g:
            return
        sv: SpecViews = step.spec
        width = 1
        for e in batch.entries:
            if e.generates:
                width = max(width, e.req.num_tokens)  # >= the true length after this step
        slots = sv.gen_slot.long()
        self.gpu_proposer.append(slots, ids.view(g, self.k + 1))
        self.draft_table[slots] = self.gpu_proposer.propose(slots, max_len=width + 1)

    def draft_cpu(
        self, batch: ScheduledBatch, states: list[RequestState], host_ids: np.ndarray, counts
    ) -> None:
        """ngram-cpu (tokens on the host): extend each generating request's token list with its
        emitted tokens, propose, and tell the scheduler how many drafts it has."""
        prop = self.cpu_proposer
        assert prop is not None
        q = self.k + 1
        emitted = _emitted(batch, counts)
        g = 0
        for e, n in zip(batch.entries, emitted):
            if not e.generates:
                continue
            req = e.req
            left = req.output_len - req.num_output_tokens
            take = n if n < left else left
            if req.status != Status.FINISHED and take < left:
                prop.extend(req.index, host_ids[g * q : g * q + take].tolist())
                d = prop.propose(req.index)
                self.cpu_drafts[req.index] = d
                req.draft_hint = len(d)
            g += 1

    # ---- process_outputs -------------------------------------------------------------------
    def emitted(self, flight) -> list[int]:
        self.counts.wait(flight.ring)
        return _emitted(flight.batch, self.counts.counts(flight.ring, flight.num_gen))

    def applied(
        self, batch: ScheduledBatch, states: list[RequestState], emitted: list[int]
    ) -> None:
        """After the policy applied a batch: the rejections it rewound are now known."""
        for e, n in zip(batch.entries, emitted):
            if e.generates and e.num_drafts:
                self.num_accepted += n - 1
                slot = states[e.req.index].slot
                if slot >= 0:
                    self.rejected_known[slot] += e.num_drafts + 1 - n


def _emitted(batch: ScheduledBatch, counts) -> list[int]:
    out = []
    g = 0
    for e in batch.entries:
        if e.generates:
            out.append(int(counts[g]))
            g += 1
        else:
            out.append(1)
    return out
