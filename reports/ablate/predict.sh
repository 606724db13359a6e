#!/usr/bin/env bash
# The simulator's predictions for the ablation report, each from a profile calibrated on the
# measured BEFORE side of the switch only (the after side stays out of sample):
#   [TAG=c] bash reports/ablate/predict.sh MEASURED [OUT]   (TAG: into reports/ablate/TAG/<seed>/)
# MEASURED holds the unpacked folders of `gpu_runs.sh seeds` (seed3/ seed4/ seed5/ seed12/,
# optionally seed5-8b/); OUT (default runs/ablate-predict) gets the predicted runs, and
# reports/ablate/<seed>/ the ablate.json, profile and fit report of each. The base profile holds what a before side cannot show, the engine's own
# cost of the after side's parts (reports/ablate/engine-terms.json, from
# `bench/spec_parts.py --profile` on the same GPU); every other number is fitted on the before
# side. The --set values must be the measured runs' (replay ablate checks them).
set -euo pipefail
m=$1; out=${2:-runs/ablate-predict}
base=${BASE_PROFILE:-reports/ablate/engine-terms.json}
pred() {  # name trace switches [--set ...]
  local name=$1 trace=$2 sw=$3; shift 3
  [ -d "$m/$name" ] || { echo "skip $name: no $m/$name"; return 0; }
  echo "== $name"
  python -m replay ablate "$trace" --switches "$sw" --measured "$m/$name" --calibrate-on off \
    --set profile="$base" -q -o "$out/$name" "$@"
  local dest="reports/ablate/${TAG:+$TAG/}$name"
  mkdir -p "$dest"
  cp "$out/$name/ablate.json" "$out/$name/"*.profile*.json "$dest/"
}
S="--set model=llama3.2-1b --set num_kv_blocks=20000"
SPEC="--set spec.method=ngram-gpu --set spec.k=3"
pred seed3 traces/fidelity/seed3_scaled.parquet reverse_placeholder_scan \
  --set model=llama3.2-1b --set num_kv_blocks=82000
pred seed4 traces/seed4_ngram.parquet spec.method $S --set spec.k=3
pred seed12 traces/seed1_backup_tokens.parquet preallocated_backup_tokens,accepted_count_by_sum \
  $S $SPEC
pred seed5 traces/fidelity/seed5_2s.parquet optimistic_spec_decode $S $SPEC
pred seed5-8b traces/fidelity/seed5_2s.parquet optimistic_spec_decode --set model=llama3-8b \
  --set num_kv_blocks=20000 $SPEC
# what reports/ablate.md cites beside the verdicts: host pace per repeat, seed 5's waits, seed 3
python reports/ablate/diagnose.py "$m" "$out"
