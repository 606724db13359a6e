"""CUDA graphs for prefill and mixed steps (config key `cuda_graphs_mixed`): one whole-step graph
per token bucket (bubblesim.core.graph_buckets: powers of two up to 512, then multiples of 256, up
to the
step token limit), capturing what an eager step launches: input finishing, forward, logits and
sampling. A step of T tokens replays the graph of bucket mixed_graph_tokens(T).

Why whole-step graphs and not piecewise ones (vLLM's: graphs between attention layers, attention
eager): every kernel here already reads its per-step metadata from device buffers, and the only
grid that depended on the batch, the mixed attention's (sequences x query blocks of the longest
sequence), has a flat form whose size is fixed by the token count and a bound on the sequences
(engine.kernels.paged_attention, `flat`): programs past the real work exit at once. So one
launch per step, where piecewise graphs would still issue two attention launches per layer
(~32 for llama3.2-1b at 45-65 us each from Python).

A bucket of T tokens has S = min(max_num_seqs, T) sequence rows (a step cannot hold more
sequences than tokens) and R sampling rows, one graph per R in
bubblesim.core.graph_buckets.mixed_graph_row_options: S, and 16 for steps that sample few tokens
(the
padded logits rows of a prefill chunk's step would otherwise cost an lm-head GEMM and sampling
of S rows: ~0.45 ms a step for llama3.2-1b on an H100 at S = 256). Inputs are the
fixed-address views of `InputBuffers`, as the decode graphs' are:
- tokens T_real..T-1 are padding: id 0, position 0, slot -1 (no KV write), in no sequence
  (query_start_loc[b..S] = T_real), so no attention program reads or writes for them;
- sequence rows b..S-1 have no query tokens and seq_len 0; their block-table rows are gathered
  from stale but valid slots and never read;
- sampling rows g..R-1 read token 0's logits and sample into the sampler's spare slot, unforced
  and without history, so they change no request's state; the engine copies tokens[:g] only.
The attention bounds are captured as max_query_len = T and max_seq_len = the model length (the
kernels read real lengths from query_start_loc and seq_lens; the bounds only pick tile sizes and
splits, which any value makes correct).

On CPU (no CUDA graphs) the same padded step runs eagerly (`capture=False`): the CPU tests run
this path against the plain one. With speculative decoding mixed steps stay eager (their inputs
and sampling are engine.spec's; sim.cost.model.CostModel.graphed says the same).

Graphs are captured largest first into one private memory pool, shared with the decode graphs:
a smaller bucket reuses the larger ones' activations. A graph's logits are not kept past its
capture (sampling consumes them inside the graph; `keep_logits` keeps them, for tests): with
[R, vocab] float32 logits per graph that would be ~130 MB a graph for a 128k vocabulary.
Triton compiles during the warm-up runs before each capture, at start-up.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import torch

from bubblesim.core.graph_buckets import (
    mixed_graph_buckets,
    mixed_graph_row_options,
    mixed_graph_rows,
    mixed_graph_tokens,
)
from engine.inputs import LOGITS_IDX, QSL, ROW_SLOT, SEQ_LENS, InputBuffers
from engine.model import LlamaModel
from engine.sampler import Sampler

WARM_RUNS = 2  # eager runs of a bucket before its capture (Triton compiles, cuBLAS loads)
DUMMY_TOKENS = 64  # real tokens of the placeholder step a bucket is captured on


class MixedGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        inputs: InputBuffers,
        sampler: Sampler,
        max_tokens: int,
        max_seq_len: int,
        keep_logits: bool = False,
    ) -> None:
        """Buckets up to mixed_graph_tokens(max_tokens), which `inputs` must hold."""
        self.model, self.kv_cache, self.inputs, self.sampler = model, kv_cache, inputs, sampler
        self.max_seq_len = max_seq_len
        self.keep_logits = keep_logits
        self.buckets = mixed_graph_buckets(max_tokens)
        assert self.buckets[-1] <= inputs.max_tokens, (
            "input buffers shorter than the largest bucket"
        )
        # graphs with needs-history rows (penalties on) apply penalties: a second variant
        self.variants = (False, True) if sampler.penalties else (False,)
        # keys (bucket, sampling rows, with_history)
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int, bool], torch.Tensor] = {}  # only with keep_logits
        self.tokens: dict[tuple[int, int], torch.Tensor] = {}  # [rows] int32, outside the pool
        self.capture_s = 0.0  # start-up cost, reported by bench/mixed_graphs.py
        self.pool_bytes = 0
        self._pool = None
        self._eager: dict[tuple[int, int, bool], Callable[[], torch.Tensor]] = {}  # CPU

    @property
    def max_bucket(self) -> int:
        return self.buckets[-1]

    def seq_rows(self, bucket: int) -> int:
        """Sequence rows of a bucket's graphs."""
        return min(self.inputs.max_num_seqs, bucket)

    def row_options(self, bucket: int) -> list[int]:
        """Sampling rows of a bucket's graphs (one graph each)."""
        return mixed_graph_row_options(bucket, self.inputs.max_num_seqs)

    def rows_for(self, bucket: int, num_gen: int) -> int:
        """Sampling rows of the graph a step of `bucket` tokens sampling num_gen tokens runs."""
        return mixed_graph_rows(num_gen, bucket, self.inputs.max_num_seqs)

    def bucket_for(self, num_tokens: int) -> int:
        """The graph of a step of num_tokens tokens (0: none, larger than every bucket)."""
        b = mixed_graph_tokens(num_tokens)
        i = bisect.bisect_left(self.buckets, b)
        return b if i < len(self.buckets) else 0

    def step_fn(
        self, bucket: int, num_rows: int, with_history: bool = False
    ) -> Callable[[], torch.Tensor]:
        """What a graph captures: the inputs' device work, forward, logits of num_rows sampling
        rows, sampling into `tokens[bucket, num_rows]`. Returns the logits [num_rows, vocab]."""
        inp, model, kv, sampler = self.inputs, self.model, self.kv_cache, self.sampler
        s = self.seq_rows(bucket)
        attn = inp.attn_views(s, bucket, bucket, self.max_seq_len, flat=True)
        ids, pos = inp.input_ids[:bucket], inp.positions(bucket)
        logits_idx = inp.d_rows[LOGITS_IDX, :num_rows]
        rows, hist = inp.graph_rows(num_rows)
        if (bucket, num_rows) not in self.tokens:  # shared by the history variants
            zeros = torch.zeros(num_rows, dtype=torch.int32, device=inp.device)
            self.tokens[bucket, num_rows] = zeros
        tokens = self.tokens[bucket, num_rows]

        def run() -> torch.Tensor:
            inp.finish_graph(bucket, s)
            hidden = model(ids, pos, attn, kv)
            logits = model.compute_logits(torch.index_select(hidden, 0, logits_idx))
            sampler.sample_graph(logits, rows, hist, tokens, with_history)
            return logits

        return run

    def _dummy_inputs(self, bucket: int) -> None:
        """A placeholder step: one sequence of min(bucket, DUMMY_TOKENS, max_seq_len) tokens
        from position 0, the rest padding; no KV is written; rows sample into the spare slot."""
        inp = self.inputs
        d, s = inp.d_rows, self.seq_rows(bucket)
        n = min(bucket, DUMMY_TOKENS, self.max_seq_len)
        d[QSL, 0] = 0
        d[QSL, 1 : s + 1] = n
        d[SEQ_LENS, :s] = 0
        d[SEQ_LENS, 0] = n
        d[ROW_SLOT, :s] = 0
        d[LOGITS_IDX, :s] = 0
        inp.batch_tables[:s].zero_()
        inp.d_toks[: 2 * bucket].zero_()
        inp.d_toks[bucket : bucket + n] = torch.arange(n, dtype=torch.int32, device=d.device)
        inp.d_toks[2 * bucket : 3 * bucket].fill_(-1)
        rows, hist = inp.graph_rows(s)
        rows.slot.fill_(inp.max_num_seqs)
        assert rows.forced_tok is not None
        rows.forced_tok.fill_(-1)
        hist.zero_()

    @torch.no_grad()  # not inference_mode: the static logits are updated in place (penalties)
    def capture(self, pool=None, mode: str = "global") -> None:
        """Capture every bucket (largest first) into `pool` (default: a new private pool);
        `mode`: the capture error mode ("thread_local" with tensor parallelism)."""
        t0 = time.perf_counter()
        dev = self.inputs.device
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_reserved(dev)
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        side = torch.cuda.Stream(dev)
        for key in self.keys():
            bucket, num_rows, hist = key
            run = self.step_fn(*key)
            self._dummy_inputs(bucket)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARM_RUNS):
                    run()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                logits = run()
            if self.keep_logits:
                self.logits[key] = logits
            del logits  # else its pool memory is free for the next (smaller) captures
            graph.replay()  # the first replay uploads the graph: paid here, not by a step
            self.graphs[key] = graph
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0
        self.pool_bytes = torch.cuda.memory_reserved(dev) - before
        self._pool = pool

    @property
    def pool(self):
        """The private memory pool (after `capture`), for the decode graphs to share."""
        return self._pool

    def keys(self) -> list[tuple[int, int, bool]]:
        """Every graph, in capture order: largest bucket and row count first."""
        return [
            (bucket, rows, hist)
            for bucket in reversed(self.buckets)
            for rows in reversed(self.row_options(bucket))
            for hist in self.variants
        ]

    def replay(self, bucket: int, num_rows: int, with_history: bool = False) -> torch.Tensor | None:
        """Run the step's graph (CUDA) or the same padded step eagerly (no graphs captured).
        The sampled tokens are in `tokens[bucket, num_rows]`; returns the logits when they are
        kept (eagerly: always)."""
        key = (bucket, num_rows, with_history and len(self.variants) > 1)
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self._eager:
                self._eager[key] = self.step_fn(*key)
            return self._eager[key]()
        graph.replay()
        return self.logits.get(key)
