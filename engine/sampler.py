"""Sampling on the GPU, with per-slot token state that never round-trips through the CPU.

Per-slot state (slot = a running request's row, see engine.requests.SlotPool), all on the device:
- `last_sampled[s]`: the newest token sampled for slot s. The next decode step reads its input id
  from here, so the CPU can launch step j+1 before step j's tokens reach the host.
- `forced[s, i]`: the trace's output token i for forced decoding (a row of -1 = not forced).
- `counts[s, v]`: how often token v was sampled for slot s; `prompt_mask[s, v]`: v is in the
  prompt. Both feed the penalties of needs-history requests and are updated by scatter_add as
  tokens are sampled (stream order keeps them exact with any number of batches in flight).
A slot handed to a new request is re-initialised by device ops enqueued before that request's
first batch, so a previous owner's in-flight batches (enqueued earlier) never leak into it.

Randomness is a counter-based Gumbel-max: the noise for (seed, request key, output index, token)
is a hash, so a request's samples do not depend on batch composition, slot or step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bubblesim.core.config import SamplingConfig

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: products of 32-bit values stay inside int64
_GOLD = 0x9E3779B1


@dataclass(slots=True)
class SampleRows:
    """Per generating row g (one per entry that emits a token), device int32 views of length G."""

    slot: torch.Tensor  # request slot
    out_idx: torch.Tensor  # output index of the token being sampled
    key: torch.Tensor  # stable request key (Request.index) for the noise
    forced_idx: torch.Tensor | None  # flat index into `forced`, or -1 (speculative decoding)
    hist_rows: torch.Tensor  # [H] rows g whose request needs its history (penalties)
    forced_tok: torch.Tensor | None = None  # the forced token itself, or -1 (plain decoding)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (int64 tensors holding values in [0, 2**32))."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


def gumbel_noise(seed: int, key: torch.Tensor, out_idx: torch.Tensor, ids: torch.Tensor):
    """Gumbel(0, 1) noise [G, N] for token ids `ids` ([N] or [G, N]) of rows (key, out_idx)."""
    row = _hash32((key.long() + (seed * _GOLD & _M32)) & _M32)
    row = _hash32((row + out_idx.long()) & _M32)
    if ids.dim() == 1:
        ids = ids[None, :]
    h = _hash32((row[:, None] + ids.long() * _GOLD) & _M32)
    u = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    return -torch.log(-torch.log(u))


class Sampler:
    def __init__(
        self,
        cfg: SamplingConfig,
        seed: int,
        num_slots: int,
        vocab: int,
        device: torch.device,
        last_sampled: torch.Tensor | None = None,
    ) -> None:
        """`last_sampled`: an int32 [num_slots] device buffer to use (speculative decoding puts
        it in front of the draft table, so one gather resolves every input id)."""
        self.cfg, self.seed, self.vocab, self.device = cfg, seed, vocab, device
        self.pinned = device.type == "cuda"
        # one spare slot (index num_slots): the padded rows of a sampling CUDA graph write there
        if last_sampled is None:
            last_sampled = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)
        self.last_sampled = last_sampled
        self.forced = torch.full((num_slots, 1), -1, dtype=torch.int32, device=device)
        self.counts = torch.zeros((num_slots + 1, vocab), dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros((num_slots + 1, vocab), dtype=torch.bool, device=device)
        self._vocab_ids = torch.arange(vocab, device=device)
        # Triton greedy sampling of plain decoding (CUDA only): `sample` / `sample_graph` rows
        # are <= num_slots + 1 (one per request, padded graph rows in the spare slot); spec
        # verification's k + 1 rows per request go through `choose`, never through it
        self.greedy_ws = None
        if device.type == "cuda" and cfg.temperature == 0:
            from engine.kernels.sampling import GreedyWorkspace

            self.greedy_ws = GreedyWorkspace(num_slots + 1, vocab, device)
        # neutral penalties change no logit: then the history is neither applied nor counted
        self.penalties = cfg.has_penalties

    @property
    def forced_width(self) -> int:
        return self.forced.shape[1]

    # ---- slots -------------------------------------------------------------------------------
    def _upload(self, ids: np.ndarray) -> torch.Tensor:
        """int32 ids to the device without a hidden sync (pinned staging on CUDA; the caching
        host allocator keeps the staging alive until the copy is done)."""
        t = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int32))
        if self.pinned:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def ensure_forced_width(self, n: int) -> None:
        """Widen `forced` to hold n tokens per slot (device copy, stream ordered)."""
        if n <= self.forced_width:
            return
        wider = torch.full((self.forced.shape[0], n), -1, dtype=torch.int32, device=self.device)
        wider[:, : self.forced_width] = self.forced
        self.forced = wider

    def init_slot(
        self,
        slot: int,
        history: tuple[np.ndarray, np.ndarray] | None,
        forced: np.ndarray | None,
    ) -> None:
        """Prepare `slot` for a request: history = (prompt ids, confirmed output ids) when its
        sampling needs them; forced = its trace output ids."""
        if history is not None:
            prompt, outputs = history
            ids = self._upload(np.concatenate([prompt, outputs]))
            self.prompt_mask[slot].zero_()
            self.prompt_mask[slot].index_fill_(0, ids[: len(prompt)].long(), True)
            self.counts[slot].zero_()
            if len(outputs):
                out = ids[len(prompt) :].long()
                self.counts[slot].scatter_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        if forced is not None:
            self.ensure_forced_width(len(forced))
            self.forced[slot].fill_(-1)
            self.forced[slot, : len(forced)].copy_(self._upload(forced))
        elif self.forced_width:
            self.forced[slot].fill_(-1)

    # ---- sampling ----------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, rows: SampleRows, out: torch.Tensor) -> None:
        """logits float32 [G, V] (may be modified in place) -> out int32 [G]; updates the slot
        state. Host reads nothing: every size is a Python int known before the launch."""
        h = rows.hist_rows
        if self.greedy_ws is not None and rows.forced_tok is not None:
            if self.penalties and h.numel():
                self._apply_penalties(logits, rows)
            self._greedy(logits, rows, out)
            tok = out
        else:
            tok = self.choose(logits, rows)
            self.last_sampled[rows.slot] = tok
            out.copy_(tok)
        if self.penalties and h.numel():
            self.count_tokens(rows.slot[h], tok[h])

    def _greedy(self, logits: torch.Tensor, rows: SampleRows, out: torch.Tensor) -> None:
        """Argmax, forced tokens, `out` and `last_sampled` in two launches (CUDA)."""
        from engine.kernels.sampling import greedy_sample

        assert self.greedy_ws is not None and rows.forced_tok is not None
        greedy_sample(logits, rows.forced_tok, rows.slot, out, self.last_sampled, self.greedy_ws)

    def sample_graph(
        self,
        logits: torch.Tensor,
        rows: SampleRows,
        hist: torch.Tensor,
        out: torch.Tensor,
        with_history: bool,
    ) -> None:
        """`sample` with every size fixed, for capture in a decode CUDA graph: all rows of the
        bucket are sampled (padded rows write the spare slot). `with_history` (a batch with
        needs-history rows, penalties on): the penalties apply and count where the 0/1 mask
        `hist` says. Same tokens as `sample` for the real rows; `logits` unchanged."""
        x = logits
        if with_history:
            x = torch.where(hist[:, None].bool(), self._penalised(logits, rows.slot, None), x)
        if self.greedy_ws is not None:
            self._greedy(x, rows, out)
        else:
            tok = self._choose_token(x, rows)
            self.last_sampled[rows.slot] = tok
            out.copy_(tok)
        if with_history:
            self.count_tokens(rows.slot, out, weight=hist)

    def choose(
        self, logits: torch.Tensor, rows: SampleRows, extra_counts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The token of each row (penalties, greedy or seeded random, forced ids), without
        touching the slot state: int32 [G]. `extra_counts` int32 [H, V] adds tokens to the
        history of the H history rows (a verification row's preceding drafts)."""
        if self.penalties and rows.hist_rows.numel():
            self._apply_penalties(logits, rows, extra_counts)
        return self._choose_token(logits, rows)

    def _choose_token(self, logits: torch.Tensor, rows: SampleRows) -> torch.Tensor:
        """Greedy or seeded random choice of every row, then forced ids: int32 [G]."""
        if self.cfg.temperature == 0:
            tok = logits.argmax(dim=-1).to(torch.int32)
        else:
            tok = self._sample_random(logits, rows).to(torch.int32)
        if rows.forced_tok is not None:
            return torch.where(rows.forced_tok >= 0, rows.forced_tok, tok)
        if rows.forced_idx is None:
            return tok
        forced = self.forced.view(-1)[rows.forced_idx.clamp(min=0)]
        return torch.where(rows.forced_idx >= 0, forced, tok)

    def count_tokens(self, slots: torch.Tensor, tok: torch.Tensor, weight=None) -> None:
        """counts[slot, tok] += weight (1 by default) for each pair (history of penalties)."""
        flat = slots.long() * self.vocab + tok.long()
        if weight is None:
            weight = torch.ones_like(flat, dtype=torch.int32)
        self.counts.view(-1).scatter_add_(0, flat, weight.to(torch.int32))

    def _apply_penalties(
        self, logits: torch.Tensor, rows: SampleRows, extra: torch.Tensor | None = None
    ) -> None:
        """vLLM semantics on the history rows: repetition over prompt + output tokens, frequency
        and presence over output tokens."""
        h = rows.hist_rows.long()
        logits.index_copy_(0, h, self._penalised(logits[h], rows.slot[h], extra))

    def _penalised(
        self, x: torch.Tensor, slots: torch.Tensor, extra: torch.Tensor | None
    ) -> torch.Tensor:
        """Logits rows x of requests in `slots` with the penalties applied (a new tensor)."""
        c = self.cfg
        counts = self.counts[slots]
        if extra is not None:
            counts = counts + extra
        seen = counts > 0
        r = c.repetition_penalty
        if r != 1.0:
            penalised = torch.where(x > 0, x / r, x * r)
            x = torch.where(seen | self.prompt_mask[slots], penalised, x)
        if c.frequency_penalty:
            x = x - c.frequency_penalty * counts
        if c.presence_penalty:
            x = x - c.presence_penalty * seen
        return x

    def _sample_random(self, logits: torch.Tensor, rows: SampleRows) -> torch.Tensor:
        c = self.cfg
        x = logits / c.temperature
        ids: torch.Tensor = self._vocab_ids
        if c.top_k > 0 or c.top_p < 1.0:
            if 0 < c.top_k < self.vocab:
                x, ids = x.topk(c.top_k, dim=-1)  # sorted, descending
            else:
                x, ids = x.sort(dim=-1, descending=True)
            if c.top_p < 1.0:
                probs = x.softmax(dim=-1)
                drop = probs.cumsum(dim=-1) - probs > c.top_p  # keeps the first token always
                x = x.masked_fill(drop, float("-inf"))
        choice = (x + gumbel_noise(self.seed, rows.key, rows.out_idx, ids)).argmax(dim=-1)
        if ids.dim() == 1:
            return choice
        return ids.gather(1, choice[:, None])[:, 0]
