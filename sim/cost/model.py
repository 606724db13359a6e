"""`CostModel`: how long each CPU phase and GPU pass of one engine step takes, for one config.

The narrow interface the simulator's step loop calls (several times per simulated step, so
every method is a few float operations on constants folded in `__init__`):

  gpu_pass_ms(shape)            forward + sampling kernels of one step on the GPU stream
  draft_gpu_ms(shape)           the n-gram GPU proposer kernel (0 unless spec.method=ngram-gpu)
  cpu_phase_ms(phase, shape)    one CPU phase (bubblesim.core.phases.CPU_PHASES), seed terms
  included;
                                for `launch` only the residual around the forward's issue
  launch_ms(shape, cuda_graphs) CPU time to issue the forward: the launch phase's time is
                                cpu_phase_ms("launch", s) + launch_ms(s, config.cuda_graphs)
  d2h_sync_ms(shape)            CPU cost of a D2H result copy once the GPU is done (no wait)
  alloc_objects(phase, shape)   net tracked objects a phase leaves behind (GC model input)
  gc_pause_ms(generation, n)    one collection of `generation` scanning n objects

gpu_pass_ms assumes a shape with at least one query token; CPU phases accept an empty shape
(a schedule that found nothing to run).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from bubblesim.core.config import Config
from bubblesim.core.gpus import get_gpu
from bubblesim.core.graph_buckets import decode_graph_rows, mixed_graph_rows, mixed_graph_tokens
from bubblesim.core.models import get_model, with_context
from bubblesim.core.phases import CPU_PHASES, SAMPLE
from bubblesim.core.shape import BatchShape
from sim.stream import IdleStart

from .collective import Collectives
from .linear import (
    PROGRAM_KEYS,
    TAIL_KEYS,
    Derived,
    LinearFn,
    add_linear,
    add_to_model,
    branches,
    compile_linear,
    compile_model,
)
from .mixedsplits import MIXED_DERIVED, mixed_derived
from .profile import (
    ALLREDUCE_KEY,
    GPU_FIT_KINDS,
    MIXED_GRID_KEY,
    TP_KEY,
    ProfileError,
    load_profile,
    resolve_profile,
    validate_profile,
)
from .roofline import Roofline
from .sampling import SAMPLING_KEY, eager_host_ms, mode_of, mode_tables
from .splits import num_sms, program_keys_fn, tail_keys_fn
from .table import SPLINE_KEY
from .terms import BROADCAST_TERM, GPU_TARGET, active_terms, term_target


class CostModel:
    def __init__(self, config: Config, profile: Mapping[str, Any] | None = None):
        """`profile`: a validated, possibly partial profile laid over the defaults."""
        self.config = config
        self.model = with_context(get_model(config.model), config.max_model_len)
        self.gpu = get_gpu(config.gpu)
        where = config.profile or None
        if profile is not None:
            validate_profile(profile, where)
        self.profile = resolve_profile(profile)  # effective parameters, for run outputs
        _check_identity(self.profile, config, self.model.name, self.gpu.name, where)
        prof = self.profile
        terms = active_terms(config)
        self.active_terms = terms

        # GPU pass: a fitted model per batch kind if the profile has one (decode: linear or the
        # larger of linear branches, with piecewise terms, docs/cost-model.md), else the roofline.
        # With tensor parallelism: one rank's pass (the ranks run in lockstep); the roofline's
        # weights, KV and FLOPs are a rank's, plus the pass's collectives (sim.cost.collective);
        # a fitted model was measured at the config's degree (_check_identity) and holds them.
        tp = config.tensor_parallel_size
        self.tp = tp
        gp = prof["gpu_pass"]
        self.roofline = Roofline(self.model, self.gpu, config.dtype, gp["roofline"], tp)
        self.collectives = Collectives(
            self.gpu, tp, gp["allreduce"], gp.get(f"allreduce_{config.tp_allreduce}"),
            config.tp_allreduce,
        )  # fmt: skip
        self._collective_model = self.collectives.pass_model(self.model, config.dtype)
        # tp_allreduce "oneshot"/"fused": passes whose all-reduce message is small enough take
        # that kernel's model instead (None with "nccl": one linear model, as before)
        self._oneshot = self.collectives.oneshot_pass(self.model, config.dtype)
        # fitted GPU models hold the collectives of their runs' algorithm (profile key
        # tp_allreduce, absent: nccl); another algorithm in the config is a what-if: the fits
        # get (this algorithm's collectives) - (theirs), the same piecewise rule on each side
        fit_algorithm = prof.get(ALLREDUCE_KEY, "nccl")
        self._fit_collectives = (
            Collectives(
                self.gpu, tp, gp["allreduce"], gp.get(f"allreduce_{fit_algorithm}"), fit_algorithm
            )  # fmt: skip
            if tp > 1 and fit_algorithm != config.tp_allreduce
            else None
        )
        gpu_extra = add_linear(*(prof["terms"][t] for t in terms if term_target(t) == GPU_TARGET))
        decode = prof["gpu_pass"].get("decode")
        derived = self._decode_derived(decode, where) if decode is not None else {}
        self._gpu_decode = self._gpu_fn(decode, gpu_extra, derived, self._decode_message_tokens)
        # spec verify steps (decode with drafts) run another attention kernel (paged_attention):
        # a `verify` model, if the profile has one, takes them from the decode model
        verify = prof["gpu_pass"].get("verify")
        if verify is not None:
            plain, derived_v = self._gpu_decode, self._decode_derived(verify, where)
            checked = self._gpu_fn(verify, gpu_extra, derived_v)
            self._gpu_decode = _ByDrafts(checked, plain)
        self._gpu_decode = self._with_history(self._gpu_decode, prof["gpu_pass"]["history"])
        # `cuda_graphs_mixed` (engine.mixed_graphs): steps with a prefill replay a graph
        # captured for a bucket of tokens (`mixed_graph_tokens`); padded tokens cost the fitted
        # per-token time (no attention: they belong to no sequence). The graph also computes
        # and samples a fixed number of logits rows (bubblesim.core.graph_buckets.mixed_graph_rows:
        # 16,
        # or min(max_num_seqs, bucket)): the rows past the step's cost the roofline's lm-head
        # GEMM + logits traffic per row. Speculative decoding leaves those steps eager, as the
        # engine does.
        self._mixed_graphs = (
            config.cuda_graphs and config.cuda_graphs_mixed and not config.spec.enabled
        )
        mixed = prof["gpu_pass"].get("mixed")
        # the grid rule the mixed fit was made with (absent: the mean chunk's, of older files)
        longest = prof.get(MIXED_GRID_KEY, "mean") == "longest"
        derived_m = self._mixed_derived(mixed, where, longest) if mixed is not None else {}
        # a graphed mixed step all-reduces its bucket's tokens: the bucket picks the algorithm
        message = _mixed_message_tokens if self._mixed_graphs else None
        self._gpu_mixed = self._gpu_fn(mixed, gpu_extra, derived_m, message)
        self._mixed_ms_per_token = self._per_token_ms(mixed)
        # the same with the one-shot model, for buckets it takes (never when self._oneshot is None)
        self._oneshot_tokens = 0 if self._oneshot is None else self._oneshot.max_tokens
        self._mixed_ms_per_token_oneshot = self._per_token_ms(mixed, oneshot=True)
        self._mixed_ms_per_row = self.roofline.lm_ms_per_row + self.roofline.logits_ms_per_row
        self._max_rows = config.max_num_seqs
        # random sampling (sim.cost.sampling): its mode's measured cost over greedy at the
        # step's sampled rows, on the GPU pass and (a sampling outside a graph) in the sample
        # phase; greedy (temperature 0) wraps nothing, to the bit
        sp = config.sampling
        vocab = self.model.vocab_size
        self.sampling_mode = mode_of(sp.temperature, sp.top_k, sp.top_p, vocab)
        self._sampling = mode_tables(prof[SAMPLING_KEY], self.sampling_mode, vocab)
        if self._sampling is not None:
            self._gpu_decode = PlusRows(self._gpu_decode, self._sampling_gpu_ms)
            self._gpu_mixed = PlusRows(self._gpu_mixed, self._sampling_gpu_ms)
        self._draft_gpu = compile_linear(self._ngram_gpu_model(prof["ngram_gpu"]))
        # a graphed pass that starts on an idle GPU runs shorter (sim.stream.gpu_pass; the
        # defaults change nothing)
        self.idle_start = IdleStart.from_table(
            prof["gpu_pass"]["idle_start"], verify=config.spec.enabled
        )
        # the shapes the fitted GPU models were measured on (sim.cost.envelope), if recorded
        self.envelope: dict[str, Any] | None = prof.get("envelope")

        # config.host_scale: every CPU phase's time x this (1.0: the profile's numbers as they
        # are, to the bit)
        hs = float(config.host_scale)

        def host(ms: float) -> float:
            return ms if hs == 1.0 else ms * hs

        def scaled(model: Mapping[str, float]) -> Mapping[str, float]:
            return model if hs == 1.0 else {k: v * hs for k, v in model.items()}

        # Launch: constant per mode; graphs only for pure decode of <= graph_max_tokens.
        la = prof["launch"]
        nodes = la["kernels_per_layer"] * self.model.num_layers + la["kernels_fixed"]
        self._graph_launch_ms = host(la["graph_ms"] + la["graph_ms_per_node"] * nodes)
        self._eager_launch_ms = host(la["eager_ms"] + la["eager_ms_per_kernel"] * nodes)
        self.eager_lag_s = host(float(la["eager_lag_ms"])) / 1e3  # sim.stream.gpu_pass
        self._graph_max_tokens = int(la["graph_max_tokens"])
        # with speculative decoding only uniform verify batches replay a graph (k drafts per
        # request): the engine captures k + 1 query tokens per row (engine.graphs), as vLLM's
        # full decode graphs need a uniform query length
        self._graph_drafts = config.spec.k if config.spec.enabled else 0

        # CPU phases: base model + active terms targeting the phase, folded into one function.
        self._phase_fn: dict[str, LinearFn] = {}
        self._alloc_fn: dict[str, LinearFn] = {}
        for phase in CPU_PHASES:
            mine = [t for t in terms if term_target(t) == phase]
            fn = compile_linear(
                scaled(
                    add_linear(prof["cpu_phases"].get(phase, {}), *(prof["terms"][t] for t in mine))
                )
            )
            if phase == SAMPLE:
                fn = self._with_history_host(fn, prof["history_host"], host)
                if self._sampling is not None:  # an eager sampling's launches
                    fn = PlusRows(fn, self._sampling_host_fn(host))
            self._phase_fn[phase] = fn
            allocs = [prof["alloc_terms"][t] for t in mine if t in prof["alloc_terms"]]
            self._alloc_fn[phase] = compile_linear(
                add_linear(prof["alloc_objects"].get(phase, {}), *allocs)
            )
        self._sync = compile_linear(prof["sync"])
        self._broadcast = compile_linear(
            scaled(prof["terms"][BROADCAST_TERM] if BROADCAST_TERM in terms else {})
        )
        # a host that waits for a GPU event resumes this long after it (sim.clock.StepClock)
        self.sync_wake_s = float(prof["sync_wait"]["wake_ms"]) / 1e3
        # taking n > 0 new requests in costs the host intake_s + n x intake_per_request_s
        # before the next schedule (sim.loop.SimLoop.intake); both 0: free, to the bit
        intake = prof["intake"]
        self.intake_s = host(float(intake["ms"])) / 1e3
        self.intake_per_request_s = host(float(intake["ms_per_request"])) / 1e3
        # an idle loop's sleep until the next arrival overshoots it by this much
        # (sim.loop.SimLoop._idle; not x host_scale: the OS's timer, not the host's Python)
        self.idle_wake_s = float(intake["wake_ms"]) / 1e3
        self._gc_a = tuple(float(x) for x in prof["gc"]["pause_ms"])
        self._gc_b = tuple(float(x) for x in prof["gc"]["pause_ms_per_object"])

    # ---- GPU ---------------------------------------------------------------------------------
    def gpu_pass_ms(self, shape: BatchShape) -> float:
        if shape.num_prefill_reqs:
            if self._mixed_graphs:  # the graph's padding tokens and rows run the GEMMs too
                bucket = mixed_graph_tokens(shape.num_tokens)
                gen = shape.decode_tokens + shape.num_prefill_reqs  # the roofline's rows
                rows = mixed_graph_rows(gen, bucket, self._max_rows) - gen
                per_token = (
                    self._mixed_ms_per_token_oneshot
                    if bucket <= self._oneshot_tokens
                    else self._mixed_ms_per_token
                )
                return (
                    self._gpu_mixed(shape)
                    + per_token * (bucket - shape.num_tokens)
                    + self._mixed_ms_per_row * max(rows, 0)
                )
            return self._gpu_mixed(shape)
        return self._gpu_decode(shape)

    def draft_gpu_ms(self, shape: BatchShape) -> float:
        return self._draft_gpu(shape)

    # ---- CPU ---------------------------------------------------------------------------------
    def cpu_phase_ms(self, phase: str, shape: BatchShape) -> float:
        try:
            fn = self._phase_fn[phase]
        except KeyError:
            raise ValueError(f"unknown CPU phase {phase!r}, expected one of {CPU_PHASES}") from None
        return fn(shape)

    def graphed(self, shape: BatchShape, cuda_graphs: bool) -> bool:
        """The forward is one CUDA graph replay: pure decode within the captured sizes, every
        request with k drafts under speculative decoding (a CPU proposer that finds fewer for
        some request makes the step eager); with `cuda_graphs_mixed` (and no speculative
        decoding), every step with a prefill too."""
        if shape.num_prefill_reqs:
            return cuda_graphs and self._mixed_graphs
        graphable = shape.decode_tokens <= self._graph_max_tokens
        uniform = shape.draft_tokens == self._graph_drafts * shape.num_reqs
        return cuda_graphs and graphable and uniform

    def launch_ms(self, shape: BatchShape, cuda_graphs: bool) -> float:
        if self.graphed(shape, cuda_graphs):
            return self._graph_launch_ms
        return self._eager_launch_ms

    def d2h_sync_ms(self, shape: BatchShape) -> float:
        return self._sync(shape)

    def broadcast_ms(self, shape: BatchShape) -> float:
        """Rank 0 sending the step's inputs to the other ranks (bubblesim.core.phases.BROADCAST; 0
        with
        one GPU): part of cpu_phase_ms("launch", shape), which it precedes."""
        return self._broadcast(shape)

    # ---- the same, as plain functions (the fast-forward's loops call them per step) ---------
    def phase_ms_fn(self, phase: str) -> LinearFn:
        """`cpu_phase_ms(phase, ·)` without the dispatch."""
        return self._phase_fn[phase]

    def alloc_objects_fn(self, phase: str) -> LinearFn:
        """`alloc_objects(phase, ·)` without the dispatch and the rounding: alloc_objects is
        round(alloc_objects_fn(phase)(shape))."""
        return self._alloc_fn[phase]

    def gpu_decode_ms_fn(self) -> LinearFn:
        """`gpu_pass_ms` for shapes without a prefill request, without the dispatch (but the
        verify model's, which reads draft_tokens: constant for a fast-forward's cost key)."""
        return self._gpu_decode

    def draft_gpu_ms_fn(self) -> LinearFn:
        """`draft_gpu_ms` without the dispatch."""
        return self._draft_gpu

    # ---- GC ----------------------------------------------------------------------------------
    def alloc_objects(self, phase: str, shape: BatchShape) -> int:
        try:
            fn = self._alloc_fn[phase]
        except KeyError:
            raise ValueError(f"unknown CPU phase {phase!r}, expected one of {CPU_PHASES}") from None
        return round(fn(shape))

    def gc_pause_ms(self, generation: int, objects_scanned: int) -> float:
        return self._gc_a[generation] + self._gc_b[generation] * objects_scanned

    # ---- construction helpers ----------------------------------------------------------------
    def _gpu_fn(
        self,
        fit: Mapping[str, Any] | None,
        extra: Mapping[str, float],
        derived: Derived | None = None,
        message: Callable[[Any], int] | None = None,
    ) -> LinearFn:
        """A GPU pass model: the fit (which holds the collectives it was measured with, plus
        the difference to the config's algorithm when that is another) plus `extra`, else the
        roofline plus `extra` plus the pass's collectives. With one-shot or fused all-reduces
        those are piecewise: the kernel's model for a pass whose all-reduce message
        (`message(shape)` tokens, default num_tokens) is within the rule's limit."""
        if fit is not None:
            fitted = compile_model(add_to_model(fit, extra), derived)
            if self._fit_collectives is None:
                return fitted
            now = self._collectives_fn(self.collectives, message)
            then = self._collectives_fn(self._fit_collectives, message)
            return lambda s: fitted(s) + (now(s) - then(s))
        ring = add_linear(extra, self._collective_model)
        if self._oneshot is None:  # one linear model (tp_allreduce "nccl", one GPU)
            if not ring:
                return self.roofline
            return _sum(self.roofline, compile_linear(ring))
        roof, add_ring = self.roofline, compile_linear(ring)
        add_one = compile_linear(add_linear(extra, self._oneshot.model))
        limit = self._oneshot.max_tokens
        if message is None:
            return lambda s: roof(s) + (add_one(s) if s.num_tokens <= limit else add_ring(s))
        tokens = message
        return lambda s: roof(s) + (add_one(s) if tokens(s) <= limit else add_ring(s))

    def _collectives_fn(
        self, coll: Collectives, message: Callable[[Any], int] | None
    ) -> Callable[[Any], float]:
        """A pass's collectives (ms) under `coll`'s algorithm: the one-kernel model for a
        message of at most its limit in tokens (`message(shape)`, default num_tokens), the
        ring's above."""
        ring = compile_linear(coll.pass_model(self.model, self.config.dtype))
        small = coll.oneshot_pass(self.model, self.config.dtype)
        if small is None:
            return ring
        one, limit = compile_linear(small.model), small.max_tokens
        tokens = message or _num_tokens
        return lambda s: one(s) if tokens(s) <= limit else ring(s)

    def _decode_message_tokens(self, s: Any) -> int:
        """Tokens of a pure decode pass's all-reduce messages, which pick their algorithm: a
        graph's captured rows x query tokens (engine.graphs pads the batch to its bucket),
        else the batch's. (The cost itself follows the batch's tokens, as the roofline's.)"""
        c = self.config
        if not self.graphed(s, c.cuda_graphs):
            return int(s.num_tokens)
        q = 1 + self._graph_drafts
        cap = max(c.max_num_batched_tokens, c.max_num_seqs)  # engine.graphs: its input rows
        return decode_graph_rows(s.num_reqs, c.max_num_seqs, cap, q) * q

    def _with_history(self, decode: LinearFn, params: Mapping[str, Any]) -> LinearFn:
        """`decode` plus the penalties of steps with needs-history rows (defaults.py
        `gpu_pass.history`): all or nothing per step, as the engine picks the graph variant,
        and per padded graph row. Unchanged (history_tokens never read, so the fast-forward's
        per-batch-size constants stay) when the term is 0 or the sampling has no penalties."""
        fixed_ms, per_row_ms = float(params["ms"]), float(params["ms_per_row"])
        v_ms, v_per_row = float(params["verify_ms"]), float(params["verify_ms_per_row"])
        c = self.config
        if not c.sampling.has_penalties or not any((fixed_ms, per_row_ms, v_ms, v_per_row)):
            return decode
        own_verify = v_ms != 0 or v_per_row != 0  # else verify steps take the decode term
        q = 1 + (c.spec.k if c.spec.enabled else 0)
        cap = max(c.max_num_batched_tokens, c.max_num_seqs)  # engine.graphs: its input rows

        def rows(s: BatchShape) -> int:
            if self.graphed(s, c.cuda_graphs):
                return decode_graph_rows(s.num_reqs, c.max_num_seqs, cap, q)
            return s.num_reqs

        def term(s: Any) -> tuple[float, float]:  # (ms, the rows' ms): what a step adds
            if own_verify and s.draft_tokens:
                return v_ms, v_per_row * s.num_reqs  # every row taken to need it
            return fixed_ms, per_row_ms * rows(s)

        return _WithHistory(decode, term)

    def _with_history_host(
        self, sample: LinearFn, params: Mapping[str, Any], host: Callable[[float], float]
    ) -> LinearFn:
        """`sample` plus the host side of the penalties on a step with history rows under
        speculative decoding (defaults.py `history_host`; every step samples through the
        verify path then), all or nothing per step. Unchanged when the term is 0, without
        speculative decoding, or when the sampling has no penalties."""
        extra = host(float(params["spec_sample_ms"]))  # x host_scale, as every CPU phase
        c = self.config
        if not extra or not c.sampling.has_penalties or not c.spec.enabled:
            return sample

        def with_host(s: BatchShape) -> float:
            base = sample(s)
            if s.history_tokens > 0:
                return base + extra
            return base

        return with_host

    def _sampled_rows(self, s: BatchShape) -> int:
        """The rows the engine samples in a step: speculative decoding's verification k + 1 a
        generating request (Sampler.choose); a decode graph its bucket's rows, a mixed graph
        its captured rows; an eager step its generating rows (every request: the shape does
        not say which prompt chunk is a prompt's last)."""
        c = self.config
        if c.spec.enabled:
            return s.num_reqs * (1 + c.spec.k)
        if s.num_prefill_reqs:
            if self._mixed_graphs:  # (cuda_graphs and cuda_graphs_mixed, no spec)
                bucket = mixed_graph_tokens(s.num_tokens)
                return mixed_graph_rows(s.num_reqs, bucket, self._max_rows)
            return s.num_reqs
        if self.graphed(s, c.cuda_graphs):
            cap = max(c.max_num_batched_tokens, c.max_num_seqs)  # engine.graphs: its input rows
            return decode_graph_rows(s.num_reqs, c.max_num_seqs, cap)
        return s.num_reqs

    def _sampling_gpu_ms(self, s: BatchShape) -> float:
        """The sampling mode's GPU ms over greedy in a step (sim.cost.sampling)."""
        assert self._sampling is not None
        key = "spec_gpu_ms" if self.config.spec.enabled else "gpu_ms"
        return self._sampling[key](self._sampled_rows(s))

    def _sampling_host_fn(self, host: Callable[[float], float]) -> Callable[[BatchShape], float]:
        """The sampling mode's host ms over greedy in a step's sample phase: a step whose
        sampling runs in no graph (every speculative step: verification samples after the
        graph), x host_scale; a graphed step's sampling is inside its graph (0)."""
        tables = self._sampling
        assert tables is not None
        c = self.config
        spec_k = c.spec.k if c.spec.enabled else None

        def extra(s: BatchShape) -> float:
            if s.num_reqs == 0 or (spec_k is None and self.graphed(s, c.cuda_graphs)):
                return 0.0
            return host(eager_host_ms(tables, s.num_reqs, spec_k))

        return extra

    def _sms(self, kind: str, term: str, where: str | None) -> int:
        """The GPU's SM count, which derived split terms need: one ProfileError if unknown."""
        sms = num_sms(self.gpu.name)
        if sms is None:
            name = f" '{where}'" if where else ""
            raise ProfileError(
                f"cost profile{name}: key 'gpu_pass.{kind}': term '{term}' needs the "
                f"GPU's SM count, unknown for {self.gpu.name!r} (sim.cost.splits.NUM_SMS)"
            )
        return sms

    def _decode_derived(self, decode: Mapping[str, Any], where: str | None) -> Derived:
        """`program_keys` / `tail_keys` (sim.cost.splits) if the decode model uses them: they
        need the GPU's SMs."""
        used = [t for t in (PROGRAM_KEYS, TAIL_KEYS) if any(b.get(t) for b in branches(decode))]
        if not used:
            return {}
        sms = self._sms("decode", used[0], where)
        heads = self.model.kv_heads_per_rank(self.tp)  # one rank's
        out: dict[str, Callable[[BatchShape], float]] = {}
        if PROGRAM_KEYS in used:
            keys = program_keys_fn(heads, sms)
            out[PROGRAM_KEYS] = lambda s: keys(s.num_reqs, s.max_kv_tokens)
        if TAIL_KEYS in used:
            tail = tail_keys_fn(heads, sms)
            out[TAIL_KEYS] = lambda s: tail(s.num_reqs, s.kv_read_tokens, s.max_kv_tokens)
        return out

    def _mixed_derived(self, mixed: Mapping[str, Any], where: str | None, longest: bool) -> Derived:
        """`mixed_keys` / `grid_blocks` (sim.cost.mixedsplits) if the mixed model uses them; a
        mixed-step graph runs the flat grid (no empty blocks per sequence); `longest`: the
        grid from the longest chunk (profile key mixed_grid)."""
        used = [t for t in MIXED_DERIVED if any(b.get(t) for b in branches(mixed))]
        if not used:
            return {}
        sms = self._sms("mixed", used[0], where)
        heads = (self.model.num_heads // self.tp, self.model.kv_heads_per_rank(self.tp))
        return mixed_derived(*heads, sms, self._mixed_graphs, longest)  # one rank's heads

    def _per_token_ms(self, fit: Mapping[str, Any] | None, oneshot: bool = False) -> float:
        """GPU ms per query token of a mixed step: the fitted num_tokens (+ prefill_tokens)
        coefficient (+ a token spline's mean slope over its knots), else the roofline's
        marginal cost of one more prefill token plus the collectives' (`oneshot`: the one-shot
        model's, if there is one)."""
        if fit is not None:
            first: Mapping[str, Any] = branches(fit)[0]  # a max form's: the GEMMs' (mixedfit)
            per = float(first.get("num_tokens", 0.0)) + float(first.get("prefill_tokens", 0.0))
            sp = first.get(SPLINE_KEY)
            if sp is not None and sp["x"] in ("num_tokens", "prefill_tokens"):
                per += (sp["ms"][-1] - sp["ms"][0]) / (sp["knots"][-1] - sp["knots"][0])
            return per  # a fit at the config's degree holds the collectives
        one = BatchShape(num_reqs=1, num_prefill_reqs=1, prefill_tokens=512, kv_read_tokens=512)
        two = BatchShape(num_reqs=1, num_prefill_reqs=1, prefill_tokens=1024, kv_read_tokens=512)
        roof = (self.roofline(two) - self.roofline(one)) / 512
        coll_model = self._collective_model
        if oneshot and self._oneshot is not None:
            coll_model = self._oneshot.model
        coll = coll_model.get("num_tokens")  # padded tokens are all-reduced too
        return roof + coll if coll is not None else roof

    def _ngram_gpu_model(self, params: Mapping[str, Any]) -> dict[str, float]:
        """Linear in num_reqs: max_model_len and the number of n values are config constants."""
        spec = self.config.spec
        if spec.method != "ngram-gpu":
            return {}
        n_values = spec.max_n - spec.min_n + 1
        mem_eff = self.profile["gpu_pass"]["roofline"]["mem_efficiency"]
        ms_per_byte = 1e3 / (self.gpu.hbm_gb_per_s * 1e9 * mem_eff)
        per_req_bytes = self.model.max_context * n_values * params["bytes_per_position"]
        return {"intercept": n_values * params["ms_per_n"], "num_reqs": per_req_bytes * ms_per_byte}


def _num_tokens(s: Any) -> int:
    return int(s.num_tokens)


def _mixed_message_tokens(s: Any) -> int:
    """Tokens of a graphed mixed step's all-reduce messages: its graph's bucket."""
    return mixed_graph_tokens(s.num_tokens)


def _check_identity(
    prof: Mapping[str, Any], config: Config, model: str, gpu: str, where: str | None
) -> None:
    """A profile that names its GPU, model or dtype applies only to that one."""
    for key, want in (
        ("gpu", (gpu, config.gpu)),
        ("model", (model, config.model)),
        ("dtype", (config.dtype,)),
    ):
        have = prof.get(key)
        if have is not None and have not in want:
            name = f" '{where}'" if where else ""
            raise ProfileError(
                f"cost profile{name}: key '{key}': the profile is for {have!r}, "
                f"the config's {key} is {want[-1]!r}"
            )
    # Fitted GPU times are per (model, GPU, degree): a rank's pass at another degree reads
    # other shards and waits on other collectives, so no scaling rule carries them over.
    fitted = any(k in prof["gpu_pass"] for k in GPU_FIT_KINDS)
    tp, have_tp = config.tensor_parallel_size, prof.get(TP_KEY)
    if have_tp is None and fitted:
        have_tp = 1  # every profile fitted before tensor parallelism: one GPU
    if have_tp is not None and have_tp != tp:
        name = f" '{where}'" if where else ""
        raise ProfileError(
            f"cost profile{name}: key '{TP_KEY}': the profile's GPU fits are for "
            f"tensor_parallel_size={have_tp}, the config's is {tp} (fitted GPU times do not "
            f"carry across degrees: calibrate on tensor_parallel_size={tp} runs, or drop the "
            "profile's gpu_pass fits to use the roofline)"
        )


def load_cost_model(config: Config) -> CostModel:
    """The cost model for `config`: defaults, with `config.profile` (a JSON file) on top."""
    profile = load_profile(config.profile) if config.profile else None
    return CostModel(config, profile)


def _sum(roof: Callable[[Any], float], add: Callable[[Any], float]) -> LinearFn:
    """`roof(s) + add(s)`, with `keyed(shape, fixed)` (sim.stepcosts.StepCosts takes it for a
    run of steps whose `fixed` fields are `shape`'s) where both parts have one: the sum of
    their keyed forms, each the same value to the bit, so the sum is too."""

    def fn(s: Any) -> float:
        return roof(s) + add(s)

    def keyed(shape: Any, fixed: Collection[str]) -> Callable[[Any], float]:
        rk, ak = getattr(roof, "keyed", None), getattr(add, "keyed", None)
        if rk is None or ak is None:
            return fn
        r, a = rk(shape, fixed), ak(shape, fixed)
        return lambda s: r(s) + a(s)

    setattr(fn, "keyed", keyed)  # noqa: B010
    return fn


class PlusRows:
    """`base(s) + extra(s)`, where `extra` reads only fields a fast-path cache key fixes (the
    batch size, query and draft tokens: sim.stepcosts.KEY_FIELDS): `keyed` folds `extra`'s
    value in once, beside `base`'s own specialisation, with the same floats in the same order."""

    __slots__ = ("base", "extra")

    def __init__(self, base: Callable[[Any], float], extra: Callable[[Any], float]) -> None:
        self.base = base
        self.extra = extra

    def __call__(self, s: Any) -> float:
        return self.base(s) + self.extra(s)

    def keyed(self, shape: Any, fields: Collection[str]) -> Callable[[Any], float]:
        assert set(fields) >= _EXTRA_READS, "PlusRows.extra reads more than the key fixes"
        keyed = getattr(self.base, "keyed", None)
        base = self.base if keyed is None else keyed(shape, fields)
        add = self.extra(shape)
        return lambda s: base(s) + add


# the fields `PlusRows.extra` (CostModel._sampled_rows, graphed) reads
_EXTRA_READS = frozenset(
    ("num_reqs", "num_prefill_reqs", "num_tokens", "decode_tokens", "draft_tokens")
)


class _ByDrafts:
    """A decode pass: `verify(s)` for a step with drafts, else `plain(s)`. `keyed`: the one
    the key's draft tokens pick, in its own keyed form."""

    __slots__ = ("verify", "plain")

    def __init__(self, verify: LinearFn, plain: LinearFn) -> None:
        self.verify = verify
        self.plain = plain

    def __call__(self, s: Any) -> float:
        return self.verify(s) if s.draft_tokens else self.plain(s)

    def keyed(self, shape: Any, fields: Collection[str]) -> Callable[[Any], float]:
        assert "draft_tokens" in fields, "_ByDrafts picks by draft_tokens"
        fn = self.verify if shape.draft_tokens else self.plain
        keyed = getattr(fn, "keyed", None)
        return fn if keyed is None else keyed(shape, fields)


class _WithHistory:
    """`decode(s)`, plus on a step with history rows (history_tokens > 0) `term(s)`'s two
    parts, added in this order (CostModel._with_history). `term` reads only fields a fast-path
    key fixes (sim.stepcosts.KEY_FIELDS): `keyed` takes it once."""

    __slots__ = ("decode", "term")

    def __init__(
        self, decode: Callable[[Any], float], term: Callable[[Any], tuple[float, float]]
    ) -> None:
        self.decode = decode
        self.term = term

    def __call__(self, s: Any) -> float:
        base = self.decode(s)
        if s.history_tokens <= 0:
            return base
        ms, rows_ms = self.term(s)
        return base + ms + rows_ms

    def keyed(self, shape: Any, fields: Collection[str]) -> Callable[[Any], float]:
        assert set(fields) >= _EXTRA_READS, "_WithHistory.term reads more than the key fixes"
        keyed = getattr(self.decode, "keyed", None)
        decode = self.decode if keyed is None else keyed(shape, fields)
        ms, rows_ms = self.term(shape)

        def fn(s: Any) -> float:
            base = decode(s)
            if s.history_tokens <= 0:
                return base
            return base + ms + rows_ms

        return fn
