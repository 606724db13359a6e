"""Default cost parameters: plausible numbers for a compact Python engine (nano-vllm kind) on a
datacenter GPU, with their sources. They are placeholders for `replay calibrate`, which fits
the same keys from measured runs. docs/cost-model.md explains each number.

Units: milliseconds (`*_ms`, and every linear-model coefficient of a time), bytes, objects.
The structure is exactly the profile-file format (`profile.py` validates both).
"""

from __future__ import annotations

import copy
from typing import Any

PROFILE_VERSION = 1

US = 1e-3  # one microsecond in ms
NS = 1e-6  # one nanosecond in ms

_SAMPLING_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024]

DEFAULTS: dict[str, Any] = {
    "version": PROFILE_VERSION,
    "notes": "built-in defaults (public data points and estimates), not a calibration",
    # A host blocked on a GPU event (the token copy, accepted counts) resumes `wake_ms` after
    # the event: the result's D2H copy on the copy stream and the waiter's wake-up. Measured on
    # an H100 host (2026-11-26, llama3.2-1b, depths 1-3): median 0.47-0.53 ms between a decode
    # step's GPU end and the end of the host's wait for its tokens. 0 = resume at the event.
    "sync_wait": {"wake_ms": 0.0},
    # Taking new requests in: the engine loop's host time between a step's last CPU phase and
    # the next schedule when requests arrived meanwhile (engine.Engine.run: add_request, which
    # validates each request and builds its state), in no phase: `ms` once per intake with any
    # request, + `ms_per_request` each. Measured on H100 and H200 hosts (2026-11-27, llama3.2-1b
    # and llama3-8b): 0.14-0.29 ms + 0.03-0.10 ms per request (reports/fidelity/README.md
    # section G). `wake_ms`: an idle loop, sleeping until the next arrival, resumes this long
    # after it (0.13-0.28 ms on the 1b runs) and takes in all that arrived meanwhile. 0 = free;
    # `replay calibrate` fits all three from the runs' gaps.
    "intake": {"ms": 0.0, "ms_per_request": 0.0, "wake_ms": 0.0},
    # The host side of the sampling penalties under speculative decoding: every step samples
    # through the verify path, which applies them eagerly after the forward (the drafts'
    # counts, the penalised targets, the accepted tokens' counts: a few dozen small ops), all or
    # nothing per step with any history row, in the `sample` phase. Fitted on an H100 host
    # (2026-11-27, llama3.2-1b, ngram-gpu k=3): 0.707 ms (reports/fidelity/README.md section
    # C). 0 = none; `replay calibrate` fits it from runs with such steps.
    "history_host": {"spec_sample_ms": 0.0},
    # Random sampling's cost over greedy per step, by mode, at the step's sampled rows
    # (sim.cost.sampling: GPU ms per row count, host ms of an eager call after engine-like
    # work). Measured on an H200 (2026-11-27 14:10 UTC, `python -m replay sampling --set
    # model=llama3.2-1b`, the Llama 3 vocabulary: reports/fidelity/gen/sampling-h200.parquet,
    # README section H); other vocabularies x their size, other GPUs as measured there until a
    # profile holds their own (`replay calibrate --sampling-sweep`).
    "sampling": {
        "vocab": 128256,
        "rows": _SAMPLING_ROWS,
        "random": {
            "gpu_ms": [
                0.0978,
                0.1048,
                0.1136,
                0.1454,
                0.1997,
                0.3656,
                0.7169,
                1.3178,
                2.5097,
                3.7032,
                4.9045,
                7.3048,
                9.6898,
            ],
            "host_ms": [0.531] * 13,
            "spec_gpu_ms": [
                0.0659,
                0.072,
                0.0808,
                0.1137,
                0.1689,
                0.3366,
                0.6879,
                1.2866,
                2.484,
                3.6777,
                4.8735,
                7.269,
                9.6575,
            ],
            "spec_host_ms": [0.5115] * 13,
        },
        "top_k": {
            "gpu_ms": [
                0.1281,
                0.1325,
                0.1365,
                0.1376,
                0.1519,
                0.1691,
                0.2394,
                0.3547,
                0.5702,
                0.7741,
                0.9731,
                1.3745,
                1.7501,
            ],
            "host_ms": [0.6752] * 13,
            "spec_gpu_ms": [
                0.096,
                0.1003,
                0.1046,
                0.106,
                0.1211,
                0.1394,
                0.2105,
                0.3235,
                0.5441,
                0.749,
                0.9468,
                1.3365,
                1.7168,
            ],
            "spec_host_ms": [0.6848] * 13,
        },
        "top_p": {
            "gpu_ms": [
                0.1972,
                0.3892,
                0.4147,
                0.4903,
                0.6408,
                1.0003,
                1.7029,
                3.5571,
                5.7199,
                9.1412,
                11.2262,
                16.6267,
                22.0331,
            ],
            "host_ms": [0.8803] * 13,
            "spec_gpu_ms": [
                0.166,
                0.3578,
                0.3803,
                0.4585,
                0.6093,
                0.9704,
                1.6739,
                3.5267,
                5.6958,
                9.1174,
                11.1986,
                16.5891,
                21.993,
            ],
            "spec_host_ms": [0.7817] * 13,
        },
        "top_k_top_p": {
            "gpu_ms": [
                0.135,
                0.1385,
                0.1448,
                0.1488,
                0.1631,
                0.1779,
                0.2497,
                0.3656,
                0.581,
                0.7875,
                0.9843,
                1.3835,
                1.7598,
            ],
            "host_ms": [0.7843] * 13,
            "spec_gpu_ms": [
                0.1035,
                0.1061,
                0.1123,
                0.1175,
                0.1318,
                0.1473,
                0.2208,
                0.3351,
                0.5557,
                0.7623,
                0.958,
                1.3501,
                1.7259,
            ],
            "spec_host_ms": [0.7141] * 13,
        },
    },
    "gpu_pass": {
        # A CUDA graph that starts on an idle GPU (idle >= min_idle_ms before its launch)
        # runs shorter than one queued behind other work by min(shrink_per_ms x (idle -
        # shrink_after_ms), shrink_max_fraction x pass) (`verify_` keys: speculative decoding's
        # verify graphs), or `scale` x its time (the older one-ratio law). 1.0 / 0 = no effect.
        # The savings once fitted here (0.84 ms per ms of idle on llama3.2-1b, H100) were the
        # GPU clock's drift against the host's (engine.hooks, reports/fidelity/README.md
        # section 0): on clock-correct runs and in `replay idlegap` no saving is measured,
        # and `replay calibrate` keeps a law only where it fits better than none.
        "idle_start": {
            "scale": 1.0,
            "min_idle_ms": 0.05,
            "shrink_per_ms": 0.0,
            "shrink_after_ms": 0.0,
            "shrink_max_fraction": 0.0,
            "verify_shrink_per_ms": 0.0,
            "verify_shrink_after_ms": 0.0,
            "verify_shrink_max_fraction": 0.0,
        },
        # Sampling penalties (engine.sampler.sample_graph): a pure decode step with any row
        # whose sampling needs the output history (history_tokens > 0, penalties on) replays
        # the decode graph's penalties variant, which applies them to every row of the bucket
        # (a vocab-wide gather and a few elementwise passes per row): `ms` + `ms_per_row` x
        # the graph's rows (eager: the batch's rows). 0 = free; `replay calibrate` fits it
        # from a sweep's decode(history) rows against their pairs without history.
        # Spec verify steps apply the penalties only to the rows that need them, at each
        # sampled position: `verify_ms` + `verify_ms_per_row` x the step's rows (the shape
        # has no count of history rows: every row is taken to need it, exact where a trace's
        # requests all do or none do); both 0 = not measured, verify steps take the decode term.
        "history": {"ms": 0.0, "ms_per_row": 0.0, "verify_ms": 0.0, "verify_ms_per_row": 0.0},
        # Analytic roofline over bubblesim/core/models.py shapes and bubblesim/core/gpus.py
        # datasheet ceilings.
        "roofline": {
            # Decode at batch 1 reaches ~70-85% of HBM bandwidth (vLLM/TRT-LLM Llama-8B H100
            # ~5-6 ms/token for 15 GB of weights read at 3.35 TB/s).
            "mem_efficiency": 0.80,
            # Large-prefill GEMMs reach ~50-70% of the dense bf16 peak.
            "matmul_efficiency": 0.60,
            # FlashAttention-2/3 forward: ~35-75% of peak on H100; take the lower middle.
            "attn_efficiency": 0.45,
            # max(memory, compute) smoothed: (m^p + c^p)^(1/p), 19% above max where m == c.
            "pnorm": 4.0,
            # Per pass: embedding gather, final norm, sampling kernels; per layer: ~10 kernel
            # boundaries (ramp-up, tail and gap of ~0.5 us each under a CUDA graph).
            "overhead_ms": 40 * US,
            "overhead_ms_per_layer": 5 * US,
            # Floor: small kernels cost a few us each even with nothing to read, so a layer's
            # kernel group never runs under ~15 us; tiny models stay launch/CPU bound.
            "min_ms": 30 * US,
            "min_ms_per_layer": 15 * US,
            # Logits traffic per sampled row and vocabulary entry: bf16 write, fp32 cast,
            # softmax/penalties read and write, sampler read (~16 bytes).
            "logits_bytes_per_vocab": 16.0,
        },
        # Tensor parallelism (sim.cost.collective): each of a pass's 2 x num_layers activation
        # all-reduces and its logits all-gather costs latency_ms + latency_ms_per_peer x
        # (n - 1) + the ring's bytes per link / (bubblesim.core.gpus link_gb_per_s x bw_efficiency).
        # Measured (reports/tp/, 2 x H100 SXM, NCCL 2.2x from a CUDA graph, 2026-11-26):
        # 11-12 us up to 128 KiB, busbw 113 GB/s at 4 MiB and 295 GB/s at 256 MiB; the fit
        # over 1 KiB-256 MiB gives 12.3 us and 0.55 of the link (rms error 13 %). The per-peer
        # latency is not identifiable from one degree: 1.5 us is nccl-tests' small-message
        # growth from 2 to 8 GPUs (~7-20 us). Added to roofline passes only: a fitted GPU model
        # measured at the same degree holds them. `replay allreduce-fit` fits the three from
        # `replay allreduce` (an NCCL sweep) on the GPUs at hand.
        "allreduce": {
            "latency_ms": 10.8 * US,
            "latency_ms_per_peer": 1.5 * US,
            "bw_efficiency": 0.55,
        },
        # tp_allreduce = "oneshot" (sim.cost.collective): a message the shared rule sends to the
        # one-shot kernel (bubblesim.core.collectives: up to 2 MiB on 2 GPUs, 512 KiB on 4-8)
        # costs latency_ms + (n - 1) x bytes / (link_gb_per_s x bw_efficiency), every rank
        # reading the n - 1 peers' copies. ESTIMATES, not measured here, until `replay
        # allreduce-fit` fits them from a sweep's "oneshot" rows: 6 us is the upper end of
        # SGLang's one-shot custom all-reduce on H100 at 512 B (3.7 / 4.8 / 5.9 us on 2 / 4 / 8
        # GPUs, eager, sgl-project/sglang PR 2904; NCCL there: 9-10 us); 0.5 of the link is a
        # placeholder (the same table's 32 KiB -> 512 KiB rise on 2 GPUs, 8 us for 480 KiB read,
        # includes a copy of the input into the shared buffer and implies ~0.15: an optimistic
        # default for the largest one-shot messages).
        "allreduce_oneshot": {
            "latency_ms": 6.0 * US,
            "bw_efficiency": 0.5,
        },
        # tp_allreduce = "fused": the all-reduce fused with the residual add and RMSNorm after
        # it (engine.kernels.reduce_norm), (n - 1) x bytes pushed to the peers per rank, the
        # same form. Measured on 2 x H100 (reports/tp/allreduce-fused-h100x2.parquet, `replay
        # allreduce --modes graph,fused`, 2026-11-27, fitted by `replay allreduce-fit`: 12
        # rows of 1 KiB .. 2 MiB, rms 4.9 %): 5.3 us + (n - 1) x bytes at 0.468 of the link.
        # The norm's own time is inside it; the roofline still counts the norm's bytes (a few
        # KB a layer at decode). 4-8 GPUs: the 2-GPU fit until a sweep there.
        "allreduce_fused": {
            "latency_ms": 5.3 * US,
            "bw_efficiency": 0.468,
        },
        # Optional fitted linear models that replace the roofline (see linear.py), per kind:
        # "decode": pure-decode steps (no prefill request), "mixed": any step with a prefill.
    },
    "launch": {
        # CUDA graph replay: ~30 us of Python copying inputs into the static buffers, then
        # cudaGraphLaunch ~2.5 us + ~1 ns per node (NVIDIA CUDA 12.6 graph blog).
        "graph_ms": 32.5 * US,
        "graph_ms_per_node": 1 * NS,
        "graph_max_tokens": 512,  # larger or mixed batches run eagerly (nano-vllm captures <= 512)
        # Eager: every op is a Python -> ATen -> cudaLaunchKernel dispatch of ~5-20 us.
        "eager_ms": 50 * US,  # forward() entry, attention-metadata context
        "eager_ms_per_kernel": 8 * US,
        # An eager pass ends this long after its launch at the earliest (the tail after the
        # last kernel is issued). `replay calibrate` fits it as the mean over the runs' eager
        # steps whose kernels end before the launch (H100, llama3.2-1b calibration runs: 0.42 ms,
        # median 0.17: a few slow tails). With tensor
        # parallelism and a launch spread the other ranks' own eager launches, drawn from the
        # spread, add to it (sim.clock.StepClock) and calibrate fits no constant.
        "eager_lag_ms": 0.0,
        # Llama layer: add+rmsnorm, qkv, rotary, kv store, attention, o_proj, add+rmsnorm,
        # gate_up, silu*mul, down. Fixed: embedding, final norm, lm_head, logits gather, ...
        "kernels_per_layer": 10,
        "kernels_fixed": 6,
    },
    # Base CPU phase models, a + b*num_reqs + c*num_tokens (+ other shape fields), for the
    # fast (after-change) code paths; seed and spec terms below are added per config.
    "cpu_phases": {
        # ENGINE-NOTES 3: vLLM ~12.7 us/req all-decode; a nano-vllm scheduler is simpler.
        "schedule": {
            "intercept": 50 * US,
            "num_reqs": 10 * US,
            "new_reqs": 20 * US,  # block allocation, prefix hashing
            "prefill_tokens": 0.05 * US,  # a block per 16 tokens
        },
        # Python lists of ids/positions/slot mapping, padded block tables, ~6 pinned H2D copies.
        "prepare_inputs": {
            "intercept": 150 * US,
            "num_reqs": 18 * US,
            "prefill_tokens": 0.1 * US,
            "context_tokens": 2 * NS,  # block-table entries (one per 16 tokens, ~30 ns each)
        },
        "launch": {},  # launch_ms() carries the launch cost; a fit may add a residual here
        # Sampler launches (temperature, softmax, sample, ~6 ops) and per-request params.
        "sample": {"intercept": 60 * US, "num_reqs": 1 * US},
        "draft": {},  # only spec terms (below)
        # Append tokens, check stop conditions, free finished requests' blocks, build outputs
        # (V0's _process_model_outputs was 3.4 ms at bs32 for Llama-70B, RFC #6913).
        "process_outputs": {
            "intercept": 50 * US,
            "num_reqs": 8 * US,
            "draft_tokens": 1 * US,  # accepted-token bookkeeping (upper bound: every draft)
            "finished_reqs": 30 * US,
        },
    },
    # Seed and speculative-decoding terms, each a linear model added to its target phase
    # (`<phase>.<name>`) or to the GPU pass (`gpu.<name>`) when its condition holds
    # (terms.py lists the conditions).
    "terms": {
        # Seed 3 (PR 42938): list.index(-1) from the front scans each history;
        # `list.index(-1)` over a list of ints compares each element: 13 ns per element measured
        # here (CPython 3.11); the PR's end-to-end numbers (TPOT 65 -> 10 ms at 128 x ~30k
        # average history) imply ~14 ns. (An earlier reading of its "10.9 ms" as per step at
        # 128 x 60k gave 1.4 ns, ten times too cheap: reports/whatif.md.)
        "sample.forward_placeholder_scan": {"history_tokens": 13.0 * NS},
        "sample.reverse_placeholder_scan": {"num_reqs": 0.3 * US},  # O(1) per request
        # Seed 2 (PR 38372): cat + sentinel + argmax ~6 launches vs (ids != -1).sum ~3.
        "sample.accept_count_cat": {"intercept": 6 * 8 * US},
        "sample.accept_count_sum": {"intercept": 3 * 8 * US},
        # Seed 1 (PR 41043): micro-benchmark 2.1-3.2 us (list + np.array) vs 0.7-2.2 us
        # (preallocated) for 1-4 requests: the get_token_id loop is shared, the difference
        # is ~1.5 us per step.
        "draft.backup_tokens_list": {"intercept": 1.7 * US, "num_reqs": 0.4 * US},
        "draft.backup_tokens_prealloc": {"intercept": 0.2 * US, "num_reqs": 0.4 * US},
        # Seed 4 (PR 29184) before: CPU n-gram (KMP-style) lookup over each request's tokens,
        # ~2 ns per context token plus a per-request Python/numba call.
        "draft.ngram_cpu": {"intercept": 20 * US, "num_reqs": 8 * US, "context_tokens": 2 * NS},
        # After: launching a torch.compile'd n-gram kernel (guards + ~5 Triton launches) and
        # scattering the drafts, no CUDA graph.
        "draft.ngram_gpu_launch": {"intercept": 100 * US},
        # Tensor parallelism (tensor_parallel_size > 1): rank 0 sends each step's inputs to the
        # other ranks after prepare_inputs (bubblesim.core.phases.BROADCAST), charged to the
        # `launch`
        # phase, which it precedes (the sim records no phase of its own for it). Measured on
        # 2 x H100 (reports/tp/, bench/engine_decode.py --tp 2) with a shared-memory ring header
        # (as vLLM V1, PR 9856) + two NCCL broadcasts of the device inputs: 144-187 us at batch
        # 1 and 240-280 us at batch 64 a step, 90 % of it the NCCL enqueue. The engine now sends
        # the host input arrays through the ring instead (each rank copies its own; ~6 us to
        # write on a CPU host), not yet measured on a GPU: these defaults are the measured,
        # older path until a TP run is calibrated (`replay calibrate` fits this term).
        "launch.tp_broadcast": {
            "intercept": 163 * US,
            "num_reqs": 1.5 * US,
            "prefill_tokens": 5 * NS,
        },
        # Seed 5 (PR 32951): ~4 small correction kernels launched before the forward.
        "prepare_inputs.optimistic_fix": {"intercept": 4 * 8 * US},
        # GPU side of the same changes.
        "gpu.rejection_sample": {"intercept": 15 * US},
        "gpu.accept_count_cat": {"intercept": 6 * 2 * US},
        "gpu.accept_count_sum": {"intercept": 3 * 2 * US},
        "gpu.optimistic_fix": {"intercept": 4 * 3 * US},
    },
    # Seed 4 after: n-gram kernel over the padded [num_reqs, max_model_len] token buffer for
    # each n in [min_n, max_n] (unfold, compare, reduce): time = n_values * ms_per_n +
    # num_reqs * max_model_len * n_values * bytes_per_position / (HBM bandwidth * efficiency).
    "ngram_gpu": {"ms_per_n": 8 * US, "bytes_per_position": 12.0},
    # CPU cost of a device-to-host result copy once the GPU is done (event wake-up, cudaMemcpy,
    # .tolist()); the waiting itself is the simulator's business.
    "sync": {"intercept": 15 * US, "num_reqs": 0.05 * US, "draft_tokens": 0.05 * US},
    # Python GC pause per collection of generation g: pause_ms[g] + pause_ms_per_object[g] * n
    # (n = unfrozen objects in generations 0..g). SGLang #30596: gen0 0.07 ms (~700 objects),
    # gen1 0.46 ms (~7.7k), gen2 ~400 ms at ~2.5M objects.
    "gc": {
        "pause_ms": [5 * US, 5 * US, 5 * US],
        "pause_ms_per_object": [0.1 * US, 0.06 * US, 0.16 * US],
    },
    # Net tracked-container objects (allocations minus frees, as CPython's gen-0 counter
    # sees them) left by each phase; temporaries freed within the phase count 0.
    "alloc_objects": {
        "schedule": {"new_reqs": 4.0},  # request state: sequence object, token and block lists
        "prepare_inputs": {},
        "launch": {},
        "sample": {},
        "draft": {},
        # a step record and an output list retained by the run recorder; a finished request
        # frees its state (-4) and leaves an output record (+2)
        "process_outputs": {"intercept": 2.0, "finished_reqs": -2.0},
    },
    # Allocation terms, same names and conditions as `terms`. Seed 1's temporaries (a list
    # from .tolist() and one from the comprehension) are freed in the call: net 0 (ENGINE-NOTES
    # 6 caveat). Set > 0 in a profile to test the GC explanation of PR 41043.
    "alloc_terms": {
        "draft.backup_tokens_list": {},
    },
}


def default_profile() -> dict[str, Any]:
    """A deep copy of the built-in defaults (a complete, valid profile)."""
    return copy.deepcopy(DEFAULTS)
