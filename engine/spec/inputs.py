"""Input preparation for speculative decoding: each decode request feeds its last token and its
drafts (1 + d query tokens), and every generating request gets k + 1 logits rows.

Layout on top of engine.inputs (same pinned ring, same fixed-address views for CUDA graphs):
- token block [ids | positions | slot_mapping | out_idx | forced_idx], each t long: the last two
  are per-token sampling indices (-1 for tokens without logits) that seed 5's correction shifts
  with the positions, then gathered per logits row;
- row fields: the base fields, with LOGITS_IDX / GEN_SLOT / GEN_KEY / HIST per logits row
  (G * (k + 1) of them: row g * (k + 1) + j is the j-th token of generating entry g, clamped to
  its last token), plus KNOWN and ROW_GEN per batch row and NUM_DRAFTS / GEN_ROW_SLOT per
  generating entry.
Input ids: -(1 + slot) = the slot's last token; -(1 + S + slot * k + j) = draft j of the slot in
the device draft table (ngram-gpu; -1 there = no draft, fed as token 0 and never accepted); real
ids for prefill tokens and CPU drafts (ngram-cpu). `resolved` keeps the ids before -1 is clamped,
so verification compares the drafts that were proposed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bubblesim.core.policy import ScheduledBatch
from engine.inputs import (
    GEN_FORCED,
    GEN_KEY,
    GEN_OUT,
    GEN_SLOT,
    HIST,
    LOGITS_IDX,
    NUM_ROW_FIELDS,
    ROW_SLOT,
    InputBuffers,
    StepInputs,
)
from engine.requests import RequestState
from engine.sampler import SampleRows

KNOWN, ROW_GEN, NUM_DRAFTS, GEN_ROW_SLOT = range(NUM_ROW_FIELDS, NUM_ROW_FIELDS + 4)
NUM_SPEC_ROW_FIELDS = NUM_ROW_FIELDS + 4
TOKEN_FIELDS = 5  # ids, positions, slot_mapping, out_idx, forced_idx


@dataclass(slots=True)
class SpecViews:
    k: int
    num_rows: int  # logits rows: G * (k + 1)
    row_slot: torch.Tensor  # [B] request slot of each batch row
    known: torch.Tensor  # [B] rejections the CPU had applied for the row's slot
    row_gen: torch.Tensor  # [B] generating-entry index of the row, -1 = none
    num_drafts: torch.Tensor  # [G]
    gen_slot: torch.Tensor  # [G]
    aux: torch.Tensor  # [2, t]: out_idx, forced_idx per token
    resolved: torch.Tensor  # [t] input ids before clamping (-1 = no draft)
    logits_idx: torch.Tensor  # [G, k + 1]
    needs_correction: bool  # the CPU assumed in-flight drafts accepted (seed 5 on)
    # what engine.spec.slot_mapping.finish_inputs reads and writes (whole buffers)
    d_rows: torch.Tensor  # [F, R] row fields
    d_toks: torch.Tensor  # token block [raw ids | positions | slot_mapping | out | forced]
    padded_tokens: int  # t
    input_ids: torch.Tensor
    block_table: torch.Tensor  # per request slot


class SpecInputBuffers(InputBuffers):
    def __init__(
        self,
        depth: int,
        max_num_seqs: int,
        max_tokens: int,
        max_blocks: int,
        block_size: int,
        token_source: torch.Tensor,
        k: int,
    ) -> None:
        super().__init__(
            depth,
            max_num_seqs,
            max_tokens,
            max_blocks,
            block_size,
            token_source,
            num_row_fields=NUM_SPEC_ROW_FIELDS,
            row_width=max_num_seqs * (k + 1) + 1,
            token_fields=TOKEN_FIELDS,
        )
        self.k = k
        self.num_slots = max_num_seqs
        self.resolved = torch.zeros(max_tokens, dtype=torch.int32, device=self.device)

    def fill(  # type: ignore[override]
        self,
        batch: ScheduledBatch,
        states: list[RequestState],
        bucket: int,
        forced_width: int,
        known: np.ndarray | None = None,
        shift: np.ndarray | None = None,
        cpu_drafts: dict[int, list[int]] | None = None,
    ) -> StepInputs:
        """Host work for a step with drafts. `bucket` > 0: a uniform decode batch (k drafts
        each) padded to `bucket` rows. known[slot]: rejections applied on the CPU (seed 5 on:
        the GPU corrects by the rest); shift[slot]: the rejections of in-flight steps, already
        known (seed 5 off: positions are corrected here); cpu_drafts: request index -> drafts
        (ngram-cpu) else the device draft table is used."""
        kr = self._k
        self._k = (kr + 1) % self.depth
        k, S = self.k, self.num_slots
        q = k + 1
        entries = batch.entries
        b = len(entries)
        t_real = batch.shape.num_tokens
        t = bucket * q or t_real
        bs, mb = self.block_size, self.max_blocks
        rows = self._rows_np[kr]
        toks = self._toks_np[kr]
        ids, pos, smap = toks[:t], toks[t : 2 * t], toks[2 * t : 3 * t]
        out_t, forced_t = toks[3 * t : 4 * t], toks[4 * t : 5 * t]
        out_t[:] = -1
        forced_t[:] = -1

        known_of = known.tolist() if known is not None else None
        qsl, seq_lens, row_slot, known_row, row_gen = [0], [], [], [], []
        logits_idx, g_slot, g_key, hist, num_drafts, gen_slot = [], [], [], [], [], []
        d_tok, d_id, d_pos, d_smap, d_out, d_forced = [], [], [], [], [], []  # decode tokens
        p_idx, p_blk = [], []
        tok = 0
        max_q = 1
        for e in entries:
            req = e.req
            st = states[req.index]
            slot = st.slot
            s, n = e.start_pos, e.num_tokens
            if shift is not None:
                s -= int(shift[slot])
            blocks = req.block_ids
            sent = self.sent_blocks[slot]
            if len(blocks) > sent:
                base = slot * mb
                p_idx.extend(range(base + sent, base + len(blocks)))
                p_blk.extend(blocks[sent:])
                self.sent_blocks[slot] = len(blocks)
            last = tok + n - 1
            if e.is_prefill:
                ids[tok : tok + n] = st.token_ids[s : s + n]
                p = np.arange(s, s + n, dtype=np.int32)
                pos[tok : tok + n] = p
                table = np.asarray(blocks[s // bs : (s + n - 1) // bs + 1], dtype=np.int32)
                smap[tok : tok + n] = table[p // bs - s // bs] * bs + p % bs
                if e.generates:  # only the last token has logits
                    out_t[last] = s + n - req.prompt_len
                    if st.forced is not None:
                        forced_t[last] = out_t[last] + slot * forced_width
            else:  # the last token (device), then drafts (device table or CPU ids)
                d = e.num_drafts
                d_id.append(-1 - slot)
                if d:
                    if cpu_drafts is not None:
                        d_id.extend(cpu_drafts[req.index][:d])
                    else:
                        first = -1 - S - slot * k
                        d_id.extend(range(first, first - d, -1))
                out0 = s + 1 - req.prompt_len
                d_tok.extend(range(tok, tok + n))
                d_pos.extend(range(s, s + n))
                d_out.extend(range(out0, out0 + n))
                if st.forced is not None:
                    f0 = slot * forced_width + out0
                    d_forced.extend(range(f0, f0 + n))
                else:
                    d_forced.extend([-1] * n)
                b0, b1 = s // bs, (s + n - 1) // bs
                if b0 == b1:  # the usual case: all k + 1 tokens in one block
                    base = (blocks[b0] - b0) * bs
                    d_smap.extend(range(base + s, base + s + n))
                else:
                    d_smap.extend([blocks[p // bs] * bs + p % bs for p in range(s, s + n)])
            max_q = max(max_q, n)
            qsl.append(tok + n)
            seq_lens.append(s + n)
            row_slot.append(slot)
            known_row.append(known_of[slot] if known_of is not None else 0)
            if e.generates:
                g = len(gen_slot)
                row_gen.append(g)
                num_drafts.append(e.num_drafts)
                gen_slot.append(slot)
                if req.needs_history:
                    hist.extend(range(g * q, g * q + q))
                if n == q and not e.is_prefill:  # k drafts: one logits row per token
                    logits_idx.extend(range(tok, tok + q))
                else:  # fewer tokens with logits (lo .. last): the last one repeats
                    lo = last if e.is_prefill else tok
                    logits_idx.extend([lo + j if lo + j < last else last for j in range(q)])
                g_slot.extend([slot] * q)
                g_key.extend([st.key] * q)
            else:
                row_gen.append(-1)
            tok += n
        if len(d_tok) == t_real:  # all decodes: the tokens are 0 .. T-1 in order
            ids[:t_real], pos[:t_real], smap[:t_real] = d_id, d_pos, d_smap
            out_t[:t_real], forced_t[:t_real] = d_out, d_forced
        elif d_tok:
            ids[d_tok] = d_id
            pos[d_tok] = d_pos
            smap[d_tok] = d_smap
            out_t[d_tok] = d_out
            forced_t[d_tok] = d_forced
        self._fill_sequences(rows, ids, pos, smap, t, t_real, qsl, seq_lens, row_slot)
        g, r, h = len(gen_slot), len(logits_idx), len(hist)
        rows[KNOWN, :b] = known_row
        rows[ROW_GEN, :b] = row_gen
        rows[NUM_DRAFTS, :g] = num_drafts
        rows[GEN_ROW_SLOT, :g] = gen_slot
        rows[LOGITS_IDX, :r] = logits_idx
        rows[GEN_SLOT, :r] = g_slot
        rows[GEN_KEY, :r] = g_key
        rows[HIST, :h] = hist
        self._stage_pairs(kr, p_idx, p_blk)

        max_seq = max(seq_lens)
        dr = self.d_rows
        li = dr[LOGITS_IDX, :r]
        return StepInputs(
            num_reqs=b,
            num_tokens=t_real,
            num_gen=g,
            bucket=bucket,
            ring=kr,
            input_ids=self.input_ids[:t],
            positions=self.positions(t),
            attn=self.attn_views(b, t, max_q, max_seq),
            logits_idx=li,
            rows=SampleRows(  # out_idx / forced_idx: set after the correction (SpecDecoder)
                slot=dr[GEN_SLOT, :r],
                out_idx=dr[GEN_OUT, :r],
                key=dr[GEN_KEY, :r],
                forced_idx=dr[GEN_FORCED, :r],
                hist_rows=dr[HIST, :h],
            ),
            padded_tokens=t,
            num_pairs=len(p_idx),
            table_cols=min(mb, -(-max_seq // bs)),
            spec=SpecViews(
                k=k,
                num_rows=r,
                row_slot=dr[ROW_SLOT, :b],
                known=dr[KNOWN, :b],
                row_gen=dr[ROW_GEN, :b],
                num_drafts=dr[NUM_DRAFTS, :g],
                gen_slot=dr[GEN_ROW_SLOT, :g],
                aux=self.d_toks[3 * t : 5 * t].view(2, t),
                resolved=self.resolved[:t],
                logits_idx=li.view(g, q),
                needs_correction=known is not None,
                d_rows=self.d_rows,
                d_toks=self.d_toks,
                padded_tokens=t,
                input_ids=self.input_ids,
                block_table=self.block_table,
            ),
        )

    def _finish_ids(self, t: int) -> None:
        """Nothing here: the ids are resolved (into `resolved` and input_ids, -1 fed as token
        0) by the one kernel that also applies seed 5's correction, engine.spec.slot_mapping,
        launched by SpecDecoder.correct right after `send`."""
