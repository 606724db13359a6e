#!/usr/bin/env bash
# Measured runs for the fidelity and ablation reports, on a GPU host (one call of the lease).
#   bash reports/fidelity/gpu_runs.sh PART OUTDIR [PACKDIR]
# PART: 1b, 1bx (llama3.2-1b on the fidelity windows, and depth 1/3), 8b (llama3-8b),
# c1b, c8b (set C: every workload of a model in one call, plus the clean-GPU shape sweep),
# h100-1b, h100-8b (H100 profiles; depth 2 and 1 alternated on one host), gaps (profiler
# timelines at depth 2 and 1),
# seeds (measured ablations of the five switches), seeds5-8b (seed 5 on llama3-8b).
# PACKDIR: each run's or ablation's folder (without timeline.json, which the calibration does
# not read) is packed into PACKDIR/<name>.tgz as soon as it is done (shape sweeps copied), so
# the device call's $OUT (few files, two folders deep) brings them back even if a later one is
# cut.
# Every run fixes num_kv_blocks so the simulator can be given the same KV budget.
set -uo pipefail
part=$1; out=$2; pack=${3:-}; mkdir -p "$out" ${pack:+"$pack"}
SEEDS_BUDGET_S=${SEEDS_BUDGET_S:-520}  # the seeds part ends within this many seconds
export PYTHONUNBUFFERED=1
W=traces/fidelity
log() { echo "[$(date +%T)] $*"; }
replay() {  # name trace model blocks repeat [extra --set ...]
  local name=$1 trace=$2 model=$3 blocks=$4 rep=$5; shift 5
  log "replay $name"
  python3 -m replay run "$trace" --set model="$model" --set num_kv_blocks="$blocks" \
    --repeat "$rep" -q -o "$out/$name" "$@" 2>&1 | tail -12
  packrun "$name"
}
packrun() {  # with PACKDIR: the run folder without timeline.json, packed as soon as it is done
  [ -n "$pack" ] || return 0
  find "$out/$1" -name timeline.json -delete
  tar czf "$pack/$1.tgz" -C "$out" "$1" && log "packed $pack/$1.tgz"
}
shapes() {  # tag model blocks: clean GPU timings of synthetic batches (replay/gpu/shapes.py)
  log "shapes $1"
  python3 -m replay shapes --set model="$2" --set num_kv_blocks="$3" -o "$out/shapes-$1.parquet" \
    2>&1 | tail -6
  [ -z "$pack" ] || cp "$out/shapes-$1.parquet" "$pack/"
}
ablate() {  # name trace switches repeat [extra --set ...]
  local name=$1 trace=$2 sw=$3 rep=$4; shift 4
  log "ablate $name"
  python3 -m replay ablate "$trace" --switches "$sw" --repeat "$rep" --no-predict -q \
    -o "$out/$name" "$@" 2>&1 | tail -14
  packrun "$name"
}
case $part in
  1b)
    for w in azure45 azure45x4 reasoning45; do
      replay "1b-$w" "$W/$w.parquet" llama3.2-1b 40000 2
    done
    ;;
  1bx)
    replay "1b-mooncake45" "$W/mooncake45.parquet" llama3.2-1b 40000 2
    replay "1b-azure45x4-depth1" "$W/azure45x4.parquet" llama3.2-1b 40000 1 --set batches_in_flight=1
    replay "1b-azure45x4-depth3" "$W/azure45x4.parquet" llama3.2-1b 40000 1 --set batches_in_flight=3
    ;;
  8b)
    for w in azure45 azure45x4 reasoning45; do
      replay "8b-$w" "$W/$w.parquet" llama3-8b 20000 2
    done
    ;;
  c1b)  # set C, llama3.2-1b: every workload in one device call (one host: the eager launch
    # cost the calibration fits is the host's), then the clean-GPU shape sweep (~8 minutes)
    replay "1b-azure45x4" "$W/azure45x4.parquet" llama3.2-1b 40000 2
    shapes 1b llama3.2-1b 40000
    for w in azure45 mooncake45 reasoning45; do
      replay "1b-$w" "$W/$w.parquet" llama3.2-1b 40000 1
    done
    replay "1b-azure45x4-depth1" "$W/azure45x4.parquet" llama3.2-1b 40000 1 --set batches_in_flight=1
    replay "1b-azure45x4-depth3" "$W/azure45x4.parquet" llama3.2-1b 40000 1 --set batches_in_flight=3
    ;;
  h100-1b)  # an H100 profile for llama3.2-1b, and depth 2 / depth 1 alternated (d2, d1, d2, d1)
    # on one host, to tell a depth effect from host drift over a call (~8 minutes)
    replay "1b-azure45x4" "$W/azure45x4.parquet" llama3.2-1b 40000 1
    replay "1b-azure45x4-depth1" "$W/azure45x4.parquet" llama3.2-1b 40000 1 --set batches_in_flight=1
    replay "1b-azure45x4-b" "$W/azure45x4.parquet" llama3.2-1b 40000 1
    replay "1b-azure45x4-depth1-b" "$W/azure45x4.parquet" llama3.2-1b 40000 1 --set batches_in_flight=1
    shapes 1b llama3.2-1b 40000
    replay "1b-azure45" "$W/azure45.parquet" llama3.2-1b 40000 1
    ;;
  h100-8b)  # an H100 profile for llama3-8b (~5 minutes)
    replay "8b-azure45x4" "$W/azure45x4.parquet" llama3-8b 20000 1
    shapes 8b llama3-8b 20000
    replay "8b-azure45" "$W/azure45.parquet" llama3-8b 20000 1
    ;;
  gaps)  # kernel timelines at depth 2 and 1 (torch.profiler, the first 6 s of azure45x4 in
    # traces/fidelity/azure6.parquet) and their idle gaps; tables to PACKDIR (~2 minutes)
    for d in 2 1; do
      log "profile depth $d"
      python3 -c "
from pathlib import Path
from bubblesim.core.config import load_config
from replay.gpu.kernels import profile_kernels
cfg = load_config(None, ['model=llama3.2-1b', 'num_kv_blocks=40000', 'batches_in_flight=$d'])
profile_kernels(cfg, '$W/azure6.parquet', Path('$out/kernels-d$d'))" 2>&1 | tail -2
      python3 reports/fidelity/kernel_gaps.py "$out/kernels-d$d/trace.json" "depth $d"
      [ -z "$pack" ] || cp "$out/kernels-d$d/kernels.txt" "$pack/kernels-d$d.txt"
    done
    ;;
  c8b)  # set C, llama3-8b (~7 minutes)
    replay "8b-azure45x4" "$W/azure45x4.parquet" llama3-8b 20000 2
    shapes 8b llama3-8b 20000
    for w in azure45 reasoning45; do
      replay "8b-$w" "$W/$w.parquet" llama3-8b 20000 1
    done
    ;;
  history)  # A/B: the same reasoning window with and without penalties (needs_history)
    for w in reasoning45 reasoning45nh; do
      replay "8b-$w-ab" "$W/$w.parquet" llama3-8b 20000 1 --max-seconds 30
    done
    ;;
  seeds)  # all five switches, run folders kept for `replay ablate --measured DIR --calibrate-on
    # off` (reports/ablate/predict.sh); fits 9 minutes on one H100/H200: seeds 4, 5, 3 first,
    # then seeds 1 and 2 with as many repeats as the time left allows (their effects are at the
    # edge of the run-to-run spread, which falls as 1/sqrt(N))
    S="--set model=llama3.2-1b --set num_kv_blocks=20000"
    SPEC="--set spec.method=ngram-gpu --set spec.k=3"
    t0=$SECONDS
    ablate seed4 traces/seed4_ngram.parquet spec.method 3 $S --set spec.k=3
    per_run=$(( (SECONDS - t0 + 5) / 6 ))  # six runs of ~1-2 s, engine start-ups included
    ablate seed5 "$W/seed5_2s.parquet" optimistic_spec_decode 3 $S $SPEC
    ablate seed3 "$W/seed3_scaled.parquet" reverse_placeholder_scan 1 \
      --set model=llama3.2-1b --set num_kv_blocks=82000
    rep=$(( (SEEDS_BUDGET_S - (SECONDS - t0) - 20) / (4 * per_run) ))
    rep=$(( rep < 2 ? 2 : rep > 9 ? 9 : rep ))
    log "seed12: $rep repeats a side (${per_run} s a run, $((SECONDS - t0)) s gone)"
    ablate seed12 traces/seed1_backup_tokens.parquet preallocated_backup_tokens,accepted_count_by_sum \
      "$rep" $S $SPEC
    ;;
  seeds-c)  # set C session: seed 5 on llama3-8b, then one more off/on pair of seed 3 (~8 min)
    ablate seed5-8b "$W/seed5_2s.parquet" optimistic_spec_decode 3 --set model=llama3-8b \
      --set num_kv_blocks=20000 --set spec.method=ngram-gpu --set spec.k=3
    ablate seed3 "$W/seed3_scaled.parquet" reverse_placeholder_scan 1 \
      --set model=llama3.2-1b --set num_kv_blocks=82000
    ;;
  seeds5-8b)  # seed 5 where the GPU step (~5 ms) outlasts the CPU's, as in the PR (9 ms TPOT):
    # the wait for accepted counts is then on the critical path (~4 min)
    ablate seed5-8b "$W/seed5_2s.parquet" optimistic_spec_decode 3 --set model=llama3-8b \
      --set num_kv_blocks=20000 --set spec.method=ngram-gpu --set spec.k=3
    ;;
esac
find "$out" -name timeline.json -size +4M -delete
log done
