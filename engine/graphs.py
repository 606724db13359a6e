"""CUDA graphs for pure-decode batches: model forward + logits, one graph per batch-size bucket.

A batch of B decodes (one query token each) replays the graph of the smallest bucket >= B.
Padded rows B..bucket-1 own no query tokens (query_start_loc stays at B) and their tokens write
slot -1, so they touch no KV and their logits rows are ignored. Inputs are the fixed-address views
of `InputBuffers` (engine.inputs); the attention bounds are captured as max_query_len = 1 and
max_seq_len = max_model_len (the kernel reads the real lengths from seq_lens). Mixed and prefill
batches run eagerly, or replay engine.mixed_graphs' graphs (config key `cuda_graphs_mixed`).
With speculative decoding (`query_len` = k + 1) a bucket serves B decodes of k drafts each:
B * (k + 1) query tokens, laid out row after row, and logits for all of them.

Without drafts a graph also does the step's device-side input work (decode ids from the last
sampled tokens, the batch's block-table rows) and samples (`Sampler.sample_graph`) into its
static `tokens[bucket]`: a decode step is then one input copy, one graph, one token copy
(engine.engine). With drafts the sampler runs eagerly after the graph (engine.spec.decoder).

Graphs are captured after a warm-up run of each bucket (Triton compiles then), largest first, in
one shared memory pool; every graph's logits and tokens live in that pool and are valid until
the next replay, which stream order puts after this step's use of them.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from bubblesim.core.graph_buckets import decode_buckets
from engine.inputs import QSL, ROW_SLOT, SEQ_LENS, InputBuffers
from engine.model import LlamaModel
from engine.sampler import Sampler


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        inputs: InputBuffers,
        max_num_seqs: int,
        max_seq_len: int,
        query_len: int = 1,
        sampler: Sampler | None = None,
    ) -> None:
        """`sampler`: capture input finishing and sampling too (plain decoding only)."""
        self.model, self.kv_cache, self.inputs = model, kv_cache, inputs
        self.max_seq_len = max_seq_len
        self.query_len = query_len  # query tokens per row: 1, or k + 1 with drafts
        assert sampler is None or query_len == 1, "graphs sample only without drafts"
        self.sampler = sampler
        self.buckets = decode_buckets(min(max_num_seqs, inputs.max_tokens // query_len))
        # key (bucket, with_history): graphs that sample have a second variant for batches
        # with needs-history rows when penalties are on (engine.sampler.sample_graph)
        self.variants = (False, True) if sampler is not None and sampler.penalties else (False,)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}
        self.tokens: dict[int, torch.Tensor] = {}  # [bucket] int32, graphs that sample

    @property
    def samples(self) -> bool:
        """Do the graphs finish the inputs and sample (`InputBuffers.send(finish=False)`)?"""
        return self.sampler is not None

    @property
    def max_bucket(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_reqs: int) -> int:
        """Smallest bucket >= num_reqs, or 0 when the batch is too large for a graph."""
        i = bisect.bisect_left(self.buckets, num_reqs)
        return self.buckets[i] if i < len(self.buckets) else 0

    def forward_fn(self, bucket: int) -> Callable[[], torch.Tensor]:
        """The eager computation a bucket's graph captures: logits [bucket * query_len, vocab]."""
        inp, q = self.inputs, self.query_len
        t = bucket * q
        attn = inp.attn_views(bucket, t, q, self.max_seq_len)
        ids, pos = inp.input_ids[:t], inp.positions(t)

        def run() -> torch.Tensor:
            return self.model.compute_logits(self.model(ids, pos, attn, self.kv_cache))

        return run

    def step_fn(self, bucket: int, with_history: bool = False) -> Callable[[], torch.Tensor]:
        """What a bucket's graph captures: `forward_fn`, preceded by the inputs' device work and
        followed by sampling into `tokens[bucket]` when the graphs sample."""
        forward, sampler, inp = self.forward_fn(bucket), self.sampler, self.inputs
        if sampler is None:
            return forward
        rows, hist = inp.graph_rows(bucket)
        if bucket not in self.tokens:  # shared by the bucket's graph variants
            self.tokens[bucket] = torch.zeros(bucket, dtype=torch.int32, device=inp.device)
        tokens = self.tokens[bucket]

        def run() -> torch.Tensor:
            inp.finish_graph(bucket)
            logits = forward()
            sampler.sample_graph(logits, rows, hist, tokens, with_history)
            return logits

        return run

    def _dummy_inputs(self, bucket: int) -> None:
        """Decode-shaped placeholders: each row one token at position 0, writing no KV."""
        inp = self.inputs
        d, q = inp.d_rows, self.query_len
        t = bucket * q
        d[QSL, : bucket + 1] = torch.arange(0, t + 1, q, dtype=torch.int32, device=d.device)
        d[SEQ_LENS, :bucket] = q
        inp.batch_tables[:bucket].zero_()
        inp.d_toks[: 2 * t].zero_()
        inp.d_toks[2 * t : 3 * t].fill_(-1)
        inp.input_ids[:t].zero_()
        if self.sampler is not None:  # rows that sample into the spare slot, unforced
            rows, hist = inp.graph_rows(bucket)
            rows.slot.fill_(inp.max_num_seqs)
            d[ROW_SLOT, :bucket] = 0
            assert rows.forced_tok is not None
            rows.forced_tok.fill_(-1)
            hist.zero_()

    @torch.no_grad()  # not inference_mode: the static logits are updated in place (penalties)
    def capture(self, pool=None, mode: str = "global") -> None:
        """Capture every bucket into `pool` (default: a new private pool); `mode`: the capture
        error mode ("thread_local" with tensor parallelism, engine.engine)."""
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        side = torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            for hist in self.variants:
                run = self.step_fn(bucket, hist)
                self._dummy_inputs(bucket)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        run()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                    self.logits[bucket, hist] = run()
                # a graph's first replay uploads it to the device (slower than later ones):
                # paid here, on these placeholder inputs, not by the first real step
                graph.replay()
                self.graphs[bucket, hist] = graph
        torch.cuda.synchronize()

    def replay(self, bucket: int, with_history: bool = False) -> torch.Tensor:
        """Run the bucket's graph on the current stream; logits [bucket * query_len, vocab].
        `with_history`: the variant that applies penalties (graphs that sample, penalties on)."""
        key = (bucket, with_history and len(self.variants) > 1)
        self.graphs[key].replay()
        return self.logits[key]
