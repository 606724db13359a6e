#!/usr/bin/env bash
# Measured runs for the fidelity and ablation reports, on a GPU host (one call of the lease).
#   bash reports/fidelity/gpu_runs.sh PART OUTDIR
# PART: 1b, 1bx (llama3.2-1b on the fidelity windows, and depth 1/3), 8b (llama3-8b),
# seeds (measured ablations of the five switches).
# Every run fixes num_kv_blocks so the simulator can be given the same KV budget.
set -uo pipefail
part=$1; out=$2; mkdir -p "$out"
export PYTHONUNBUFFERED=1
W=traces/fidelity
log() { echo "[$(date +%T)] $*"; }
replay() {  # name trace model blocks repeat [extra --set ...]
  local name=$1 trace=$2 model=$3 blocks=$4 rep=$5; shift 5
  log "replay $name"
  python3 -m replay run "$trace" --set model="$model" --set num_kv_blocks="$blocks" \
    --repeat "$rep" -q -o "$out/$name" "$@" 2>&1 | tail -12
}
ablate() {  # name trace switches repeat [extra --set ...]
  local name=$1 trace=$2 sw=$3 rep=$4; shift 4
  log "ablate $name"
  python3 -m replay ablate "$trace" --switches "$sw" --repeat "$rep" --no-predict -q \
    -o "$out/$name" "$@" 2>&1 | tail -14
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
  history)  # A/B: the same reasoning window with and without penalties (needs_history)
    for w in reasoning45 reasoning45nh; do
      replay "8b-$w-ab" "$W/$w.parquet" llama3-8b 20000 1 --max-seconds 30
    done
    ;;
  seeds)
    S="--set model=llama3.2-1b"
    ablate seed3 "$W/seed3_scaled.parquet" reverse_placeholder_scan 1 $S --set num_kv_blocks=82000
    ablate seed4 traces/seed4_ngram.parquet spec.method 3 $S --set num_kv_blocks=20000 --set spec.k=3
    ablate seed12 traces/seed1_backup_tokens.parquet preallocated_backup_tokens,accepted_count_by_sum 3 \
      $S --set num_kv_blocks=20000 --set spec.method=ngram-gpu --set spec.k=3
    ablate seed5 traces/seed5_optimistic.parquet optimistic_spec_decode 3 $S \
      --set num_kv_blocks=20000 --set spec.method=ngram-gpu --set spec.k=3
    ;;
  seeds-tail)  # seeds 1, 2 and 5 again, 3 repeats a side: the median drops the first repeat,
    # which pays Triton compiles of shapes the warm-up did not meet (2 repeats left a 26 % spread)
    S="--set model=llama3.2-1b"
    ablate seed12r3 traces/seed1_backup_tokens.parquet preallocated_backup_tokens,accepted_count_by_sum 3 \
      $S --set num_kv_blocks=20000 --set spec.method=ngram-gpu --set spec.k=3
    ablate seed5r3 traces/seed5_optimistic.parquet optimistic_spec_decode 3 $S \
      --set num_kv_blocks=20000 --set spec.method=ngram-gpu --set spec.k=3
    ;;
esac
find "$out" -name timeline.json -size +4M -delete
log done
