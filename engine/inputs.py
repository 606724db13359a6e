"""Preallocated input buffers and their per-step preparation.

Host side, per ring slot k (one per batch in flight, see engine.outputs for the ring rule),
pinned int32 buffers written through numpy views:
- `rows[k]` [NUM_ROW_FIELDS, R] (R = max_num_seqs + 1): per-request fields, field-major;
- `toks[k]` [3 * max_tokens]: per-token [ids | positions | slot_mapping], each T long for a step
  of T (padded) tokens, so a step needs one contiguous copy of 3T values;
- `pairs[k]`: block-table updates [flat index (K) | block id (K)].
Device side: the same blocks once (the compute stream orders every use), the per-slot block table
[max_num_seqs, max_blocks] and the per-batch gathered table `batch_tables`.

Per step the host sends rows (whole: R * 9 ints), 3T token values, and only the block-table
entries that changed since the slot's last step (new blocks; a new slot's whole list once); the
device gathers the batch's table rows from the per-slot table.

Input ids of decode tokens are not known on the host while their producing batch is in flight:
the host writes -(slot + 1) and the device substitutes `last_sampled[slot]` (engine.sampler).
For a CUDA graph of bucket size Bk, every view used below has the same address on every replay:
token fields sit at offsets 0, Bk, 2Bk and row fields at fixed offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bubblesim.core.policy import ScheduledBatch
from engine.attention import AttentionMetadata
from engine.requests import RequestState
from engine.sampler import SampleRows

# row fields: rows[F, :] (QSL has B + 1 values, the others B or G or H). The first
# NUM_ROW_FIELDS are shared with speculative decoding (engine.spec.inputs adds its own after
# them); GEN_FORCED there is an index into the sampler's forced table, which the device corrects.
# Plain decoding adds GEN_FORCED_TOK (the forced token itself, -1 = none) and GEN_HIST (0/1:
# the row's request needs its history): the host knows both, and a CUDA graph that samples
# reads them for every row of its bucket.
QSL, SEQ_LENS, ROW_SLOT, LOGITS_IDX, GEN_SLOT, GEN_OUT, GEN_KEY, GEN_FORCED, HIST = range(9)
NUM_ROW_FIELDS = 9
GEN_FORCED_TOK, GEN_HIST = range(NUM_ROW_FIELDS, NUM_ROW_FIELDS + 2)
NUM_PLAIN_ROW_FIELDS = NUM_ROW_FIELDS + 2


@dataclass(slots=True)
class StepInputs:
    """A prepared step: device views and the host-known sizes."""

    num_reqs: int  # B
    num_tokens: int  # T (unpadded)
    num_gen: int  # G: entries that sample a token
    bucket: int  # CUDA graph batch size, 0 = eager
    ring: int  # ring slot k
    input_ids: torch.Tensor  # [T or bucket]
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_idx: torch.Tensor  # [G] token index of each generating entry's last token
    rows: SampleRows
    padded_tokens: int  # t: tokens laid out in the token block (bucket or T)
    num_pairs: int  # block-table entries to send
    table_cols: int  # block-table columns this step reads
    spec: Any = None  # speculative decoding's extra views (engine.spec.inputs.SpecViews)
    mixed: int = 0  # > 0: bucket is a mixed-step graph's token bucket, this its sampling rows


def _pinned(shape: tuple[int, ...], cuda: bool) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.int32, pin_memory=cuda)


class InputBuffers:
    def __init__(
        self,
        depth: int,
        max_num_seqs: int,
        max_tokens: int,
        max_blocks: int,
        block_size: int,
        last_sampled: torch.Tensor,
        num_row_fields: int = NUM_PLAIN_ROW_FIELDS,
        row_width: int = 0,
        token_fields: int = 3,
    ) -> None:
        """`last_sampled`: the device tokens host ids -(i + 1) refer to (the sampler's per-slot
        newest tokens; with speculative decoding followed by the draft table). The other three
        arguments let engine.spec.inputs lay out more fields (default: this file's layout)."""
        device = last_sampled.device
        self.last_sampled = last_sampled
        cuda = device.type == "cuda"
        self.cuda, self.device, self.depth = cuda, device, depth
        self.block_size, self.max_blocks, self.max_tokens = block_size, max_blocks, max_tokens
        r = row_width or max_num_seqs + 1
        self.token_fields = token_fields
        self.max_num_seqs = max_num_seqs
        # rows then tokens in one buffer: a step's inputs are one copy of a prefix of it
        self.rows_len = num_row_fields * r
        n_buf = self.rows_len + token_fields * max_tokens
        self.h_buf = [_pinned((n_buf,), cuda) for _ in range(depth)]
        self.h_rows = [h[: self.rows_len].view(num_row_fields, r) for h in self.h_buf]
        self.h_toks = [h[self.rows_len :] for h in self.h_buf]
        self.h_pairs = [_pinned((2 * 64,), cuda) for _ in range(depth)]
        self._buf_np = [h.numpy() for h in self.h_buf]  # views of the pinned buffers
        self._rows_np = [h.numpy() for h in self.h_rows]
        self._toks_np = [h.numpy() for h in self.h_toks]
        self.d_buf = torch.zeros(n_buf, dtype=torch.int32, device=device)
        self.d_rows = self.d_buf[: self.rows_len].view(num_row_fields, r)
        self.d_toks = self.d_buf[self.rows_len :]
        self.d_pairs = torch.zeros(2 * 64, dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((max_num_seqs, max_blocks), dtype=torch.int32, device=device)
        self.batch_tables = torch.zeros(
            (max_num_seqs, max_blocks), dtype=torch.int32, device=device
        )
        self.sent_blocks = [0] * max_num_seqs  # block ids of a slot already in block_table
        self._k = 0

    def reset_slot(self, slot: int) -> None:
        self.sent_blocks[slot] = 0

    # ---- the device views a step (or a graph of `bucket` rows) reads -------------------------
    def attn_views(
        self, b: int, t: int, max_query_len: int, max_seq_len: int, flat: bool = False
    ) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.d_rows[QSL, : b + 1],
            seq_lens=self.d_rows[SEQ_LENS, :b],
            block_tables=self.batch_tables[:b],
            slot_mapping=self.d_toks[2 * t : 3 * t],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            flat_grid=flat,
        )

    def positions(self, t: int) -> torch.Tensor:
        return self.d_toks[t : 2 * t]

    def graph_rows(self, bucket: int) -> tuple[SampleRows, torch.Tensor]:
        """Sampling rows of a graph of `bucket` decodes (every row generates; padded rows have
        the spare slot, no forced token, no history) and its [bucket] needs-history mask."""
        d = self.d_rows
        rows = SampleRows(
            slot=d[GEN_SLOT, :bucket],
            out_idx=d[GEN_OUT, :bucket],
            key=d[GEN_KEY, :bucket],
            forced_idx=None,
            hist_rows=d[HIST, :0],
            forced_tok=d[GEN_FORCED_TOK, :bucket],
        )
        return rows, d[GEN_HIST, :bucket]

    # ---- preparation -------------------------------------------------------------------------
    def prepare(
        self,
        batch: ScheduledBatch,
        states: list[RequestState],
        bucket: int,
        forced_width: int,
    ) -> StepInputs:
        """`fill` then `send` (the engine calls them apart, to mark the GPU start between)."""
        step = self.fill(batch, states, bucket, forced_width)
        self.send(step)
        return step

    def fill(
        self,
        batch: ScheduledBatch,
        states: list[RequestState],
        bucket: int,
        forced_width: int,
        mixed_rows: int = 0,
    ) -> StepInputs:
        """Host work only: write the pinned buffers of the next ring slot for `batch` (every
        entry's request holds a slot). `bucket` > 0: a pure-decode batch padded to `bucket` rows
        for a CUDA graph; with `mixed_rows` > 0, any batch padded to `bucket` tokens and
        `mixed_rows` sampling rows for a mixed-step graph (engine.mixed_graphs; sequence rows
        are padded over the whole row width in any case).
        `send` then enqueues the device work. Forced tokens go in the rows (`forced_width` is
        used by speculative decoding's override only)."""
        k = self._k
        self._k = (k + 1) % self.depth
        entries = batch.entries
        b = len(entries)
        t_real = batch.shape.num_tokens
        t = bucket or t_real
        bs, mb = self.block_size, self.max_blocks
        rows = self._rows_np[k]
        toks = self._toks_np[k]
        ids, pos, smap = toks[:t], toks[t : 2 * t], toks[2 * t : 3 * t]

        qsl, seq_lens, row_slot = [0], [], []
        logits_idx, g_slot, g_out, g_key, g_forced, hist, g_hist = [], [], [], [], [], [], []
        d_tok, d_id, d_pos, d_smap = [], [], [], []  # decode tokens, written at once
        p_idx, p_blk = [], []  # block-table updates
        tok = 0
        max_q = 1
        for e in entries:
            req = e.req
            st = states[req.index]
            slot = st.slot
            s, n = e.start_pos, e.num_tokens
            blocks = req.block_ids
            sent = self.sent_blocks[slot]
            if len(blocks) > sent:
                base = slot * mb
                p_idx.extend(range(base + sent, base + len(blocks)))
                p_blk.extend(blocks[sent:])
                self.sent_blocks[slot] = len(blocks)
            if e.is_prefill:
                ids[tok : tok + n] = st.token_ids[s : s + n]
                p = np.arange(s, s + n, dtype=np.int32)
                pos[tok : tok + n] = p
                table = np.asarray(blocks[s // bs : (s + n - 1) // bs + 1], dtype=np.int32)
                smap[tok : tok + n] = table[p // bs - s // bs] * bs + p % bs
                max_q = max(max_q, n)
            else:  # one token: its id is the slot's last sampled token, on the device
                assert n == 1, "draft tokens need the speculative-decoding input path"
                d_tok.append(tok)
                d_id.append(-1 - slot)
                d_pos.append(s)
                d_smap.append(blocks[s // bs] * bs + s % bs)
            tok += n
            qsl.append(tok)
            seq_lens.append(s + n)
            row_slot.append(slot)
            if e.generates:
                if req.needs_history:
                    hist.append(len(logits_idx))
                g_hist.append(req.needs_history)
                out_idx = s + n - req.prompt_len
                logits_idx.append(tok - 1)
                g_slot.append(slot)
                g_out.append(out_idx)
                g_key.append(st.key)
                g_forced.append(st.forced[out_idx] if st.forced is not None else -1)
        if d_tok:
            ids[d_tok] = d_id
            pos[d_tok] = d_pos
            smap[d_tok] = d_smap
        self._fill_sequences(rows, ids, pos, smap, t, t_real, qsl, seq_lens, row_slot)
        g, h = len(logits_idx), len(hist)
        rows[LOGITS_IDX, :g] = logits_idx
        rows[GEN_SLOT, :g] = g_slot
        rows[GEN_OUT, :g] = g_out
        rows[GEN_KEY, :g] = g_key
        rows[GEN_FORCED_TOK, :g] = g_forced
        rows[HIST, :h] = hist
        rows[GEN_HIST, :g] = g_hist
        pad = mixed_rows or bucket  # sampling rows of the graph
        if pad > g:  # padded rows of a sampling graph: no forcing, no history, no slot
            rows[GEN_SLOT, g:pad] = self.max_num_seqs  # the sampler's spare slot
            rows[GEN_FORCED_TOK, g:pad] = -1
            rows[GEN_HIST, g:pad] = 0
            rows[LOGITS_IDX, g:pad] = 0  # a mixed graph's logits rows: any real token
        self._stage_pairs(k, p_idx, p_blk)

        max_seq = max(seq_lens)
        cols = min(mb, -(-max_seq // bs))
        return self.views(k, b, t_real, g, h, bucket, t, max_q, max_seq, len(p_idx), cols,
                          mixed_rows)  # fmt: skip

    def views(
        self,
        k: int,
        b: int,
        t_real: int,
        g: int,
        h: int,
        bucket: int,
        t: int,
        max_q: int,
        max_seq: int,
        num_pairs: int,
        table_cols: int,
        mixed_rows: int,
    ) -> StepInputs:
        """A step's device views from its host-known sizes (`fill`; a tensor-parallel worker
        builds the same from rank 0's step header, engine.engine.Engine.serve_step)."""
        d = self.d_rows
        return StepInputs(
            num_reqs=b,
            num_tokens=t_real,
            num_gen=g,
            bucket=bucket,
            ring=k,
            input_ids=self.input_ids[:t],
            positions=self.positions(t),
            attn=self.attn_views(b, t, max_q, max_seq),
            logits_idx=d[LOGITS_IDX, :g],
            rows=SampleRows(
                slot=d[GEN_SLOT, :g],
                out_idx=d[GEN_OUT, :g],
                key=d[GEN_KEY, :g],
                forced_idx=None,
                hist_rows=d[HIST, :h],
                forced_tok=d[GEN_FORCED_TOK, :g],
            ),
            padded_tokens=t,
            num_pairs=num_pairs,
            table_cols=table_cols,
            mixed=mixed_rows,
        )

    def _fill_sequences(
        self,
        rows: np.ndarray,
        ids: np.ndarray,
        pos: np.ndarray,
        smap: np.ndarray,
        t: int,
        t_real: int,
        qsl: list[int],
        seq_lens: list[int],
        row_slot: list[int],
    ) -> None:
        """Per-sequence rows of the pinned staging area, and graph padding: tokens t_real..t
        and sequences b..bucket belong to no request (no query tokens, KV dropped)."""
        if t > t_real:
            ids[t_real:] = 0
            pos[t_real:] = 0
            smap[t_real:] = -1
        b = len(seq_lens)
        rows[QSL, : b + 1] = qsl
        rows[QSL, b + 1 :] = t_real
        rows[SEQ_LENS, :b] = seq_lens
        rows[SEQ_LENS, b:] = 0
        rows[ROW_SLOT, :b] = row_slot

    def _stage_pairs(self, k: int, p_idx: list[int], p_blk: list[int]) -> None:
        """Block-table updates into pinned h_pairs[k]: [flat index (n) | block id (n)]."""
        n = len(p_idx)
        if not n:
            return
        hp = self._pairs_room(k, n)
        hp[:n] = p_idx
        hp[n : 2 * n] = p_blk

    def _pairs_room(self, k: int, n: int) -> np.ndarray:
        """h_pairs[k] (numpy view), grown with d_pairs to hold `n` pairs."""
        if 2 * n > self.h_pairs[k].numel():
            cap = 1 << (2 * n - 1).bit_length()
            self.h_pairs[k] = _pinned((cap,), self.cuda)
            if cap > self.d_pairs.numel():
                self.d_pairs = torch.zeros(cap, dtype=torch.int32, device=self.device)
        return self.h_pairs[k].numpy()

    def host_arrays(self, step: StepInputs) -> tuple[np.ndarray, np.ndarray]:
        """Tensor parallelism, rank 0: the filled pinned host arrays `upload` copies (rows and
        tokens, block-table pairs), as numpy views, for the workers (engine.tp.comm's ring)."""
        k, n = step.ring, step.num_pairs
        m = self.rows_len + self.token_fields * step.padded_tokens
        return self._buf_np[k][:m], self.h_pairs[k].numpy()[: 2 * n]

    def host_shapes(self, step: StepInputs) -> tuple[tuple[int, Any], tuple[int, Any]]:
        """(length, dtype) of `host_arrays` from the step's host-known sizes (a worker)."""
        m = self.rows_len + self.token_fields * step.padded_tokens
        return (m, np.int32), (2 * step.num_pairs, np.int32)

    def stage_host(self, step: StepInputs, buf: np.ndarray, pairs: np.ndarray) -> None:
        """A worker: rank 0's `host_arrays` into this rank's pinned slot `step.ring` (as `fill`
        wrote rank 0's), for `upload`. The slot's previous copy is done: rank 0 sends step s
        only after its step s - depth completed, whose collectives followed this rank's copy
        of step s - depth in stream order."""
        k = step.ring
        self._buf_np[k][: len(buf)] = buf
        if len(pairs):
            self._pairs_room(k, len(pairs) // 2)[: len(pairs)] = pairs

    def send(self, step: StepInputs, finish: bool = True) -> None:
        """Enqueue the step's device work: one host -> device copy of rows and tokens (pinned,
        asynchronous), the block-table update, then (`finish`) the work on the device copies,
        which a CUDA graph that samples does itself (`finish_graph`)."""
        self.upload(step)
        self.apply(step, finish)

    def upload(self, step: StepInputs) -> None:
        """`send`'s copies: rows and tokens, and the block-table updates, to the device."""
        k, n = step.ring, step.num_pairs
        m = self.rows_len + self.token_fields * step.padded_tokens
        self.d_buf[:m].copy_(self.h_buf[k][:m], non_blocking=True)
        if n:
            self.d_pairs[: 2 * n].copy_(self.h_pairs[k][: 2 * n], non_blocking=True)

    def broadcast(self, step: StepInputs, comm) -> None:
        """Tensor parallelism, a step whose `host_arrays` do not fit a ring slot: rank 0's
        uploaded device buffers (`upload`) into every rank's (engine.tp.comm: device
        collectives, enqueued; every rank calls it for the step)."""
        m = self.rows_len + self.token_fields * step.padded_tokens
        comm.broadcast_device(self.d_buf[:m])
        n = step.num_pairs
        if n:
            if 2 * n > self.d_pairs.numel():  # a worker: grow as rank 0's `_stage_pairs` did
                cap = 1 << (2 * n - 1).bit_length()
                self.d_pairs = torch.zeros(cap, dtype=torch.int32, device=self.device)
            comm.broadcast_device(self.d_pairs[: 2 * n])

    def apply(self, step: StepInputs, finish: bool = True) -> None:
        """`send`'s device work on the device copies: the block-table update, then (`finish`)
        input ids and the batch's table rows."""
        t, n = step.padded_tokens, step.num_pairs
        if n:
            flat = self.d_pairs[:n].long()
            self.block_table.view(-1).index_copy_(0, flat, self.d_pairs[n : 2 * n])
        if finish:
            self._finish_ids(t)
            # only the columns this step can read; the rest of a row is never looked at
            b, cols = step.num_reqs, step.table_cols
            self.batch_tables[:b, :cols] = self.block_table[self.d_rows[ROW_SLOT, :b], :cols]

    def finish_graph(self, bucket: int, num_rows: int = 0) -> None:
        """`send`'s device work for a graph of `bucket` tokens and `num_rows` sequence rows
        (default: `bucket` one-token rows): whole table rows (the columns a step reads are not
        fixed); padded rows gather a slot's row they never read (ROW_SLOT past the batch keeps
        earlier steps' slots, all valid)."""
        self._finish_ids(bucket)
        n = num_rows or bucket
        slots = self.d_rows[ROW_SLOT, :n]
        torch.index_select(self.block_table, 0, slots, out=self.batch_tables[:n])

    def _finish_ids(self, t: int) -> None:
        """input_ids[:t] = host ids, with -(slot + 1) replaced by last_sampled[slot]."""
        raw = self.d_toks[:t]
        if self.cuda:  # one launch
            from engine.kernels.sampling import resolve_input_ids

            resolve_input_ids(raw, self.last_sampled, self.input_ids[:t])
            return
        src = (-1 - raw).clamp_(min=0)
        torch.where(raw < 0, self.last_sampled[src], raw, out=self.input_ids[:t])
