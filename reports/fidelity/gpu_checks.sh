#!/usr/bin/env bash
# Measured runs of the generalization protocol (reports/fidelity/README.md), on a GPU host:
#   bash reports/fidelity/gpu_checks.sh PART MODEL OUTDIR PACKDIR
# PART: calib (the one short calibration run: traces/fidelity/azure45x4, depth 2, then a
# `replay sampling` sweep on the same host, sampling-calib-<tag>.parquet: random sampling's host
# term from the lease the CPU phases come from; reports/fidelity/README.md section I),
# calib-ramp (the CPU phases' envelope: every batch size in one short run), calib-ramp-long
# (the same with long prompts),
# calib-spec (a short ngram-gpu run for the spec CPU phases), calib-specpen (the same with
# penalties on every other request), mixed-ab (cuda_graphs_mixed off/on),
# checks-a, checks-b (the out-of-sample checks of traces/checks/, made by make_checks.py:
# never used in a fit), checks2 (the second, fresh set of traces/checks2/: every run, or the
# names in $CHECKS2), checks-d3 (azure_mid and longout_hi of traces/checks2/ at depth 3, or the
# names in $CHECKSD3), checks3 (traces/checks3/, or the names in $CHECKS3), checks4
# (traces/checks4/: high arrival rates, or the names in $CHECKS4), checks5 (the second set's
# workloads sampled at random, or the names in $CHECKS5), sampling (each random sampling mode
# against greedy per sampled row, `python -m replay sampling`), sweep (the clean-GPU envelope sweep, `python -m replay shapes`),
# sweep-spec (the verify-width sweep: ngram-gpu, k=3, decode shapes, cut at $SPEC_SWEEP_S s),
# idlegap / idlegap-spec (decode / verify graphs timed after set GPU idle gaps: the idle-start
# law for `replay calibrate --idle-sweep`).
# Each run folder is packed into PACKDIR/<model>-<name>.tgz (without timeline.json) as soon as
# it is done, so a cut call still brings back what finished. Every run fixes num_kv_blocks so
# the simulator can be given the same KV budget.
set -uo pipefail
part=$1; model=$2; out=$3; pack=$4; mkdir -p "$out" "$pack"
export PYTHONUNBUFFERED=1
case $model in
  llama3.2-1b) tag=1b; blocks=40000 ;;
  llama3-8b) tag=8b; blocks=20000 ;;
  *) echo "unknown model $model"; exit 2 ;;
esac
C=traces/checks
C2=traces/checks2
log() { echo "[$(date +%T)] $*"; }
replay() {  # name trace [extra --set ...]
  local name=$tag-$1 trace=$2; shift 2
  log "replay $name"
  python3 -m replay run "$trace" --set model="$model" --set num_kv_blocks="$blocks" \
    --repeat 1 -q -o "$out/$name" "$@" 2>&1 | tail -4
  find "$out/$name" -name timeline.json -delete
  tar czf "$pack/$name.tgz" -C "$out" "$name" && log "packed $name"
}
sampling_sweep() {  # file stem: each random sampling mode against greedy per sampled row
  log "sampling $1"
  python3 -m replay sampling --set model="$model" -q -o "$out/$1.parquet" 2>&1 | tail -22
  cp "$out/$1.parquet" "$pack/"
}
case $part in
  calib)
    replay calib traces/fidelity/azure45x4.parquet
    sampling_sweep "sampling-calib-$tag"
    ;;
  checks-a)
    replay longout $C/longout.parquet
    replay longprompt $C/longprompt.parquet
    replay burst $C/burst.parquet
    replay reasoning $C/reasoning.parquet
    ;;
  checks-b)
    replay specdec $C/specdec.parquet --set spec.method=ngram-gpu --set spec.k=3
    replay azure_late-d1 $C/azure_late.parquet --set batches_in_flight=1
    replay azure_late-d3 $C/azure_late.parquet --set batches_in_flight=3
    replay asap $C/asap.parquet --set arrival=asap
    ;;
  checks2)
    for n in ${CHECKS2:-azure_mid azure_d1 longout_hi longprompt2 burst2 reasoning2 specdec2 asap2}; do
      case $n in
        azure_d1) replay "$n" $C2/$n.parquet --set batches_in_flight=1 ;;
        specdec2) replay "$n" $C2/$n.parquet --set spec.method=ngram-gpu --set spec.k=3 ;;
        asap2) replay "$n" $C2/$n.parquet --set arrival=asap ;;
        *) replay "$n" $C2/$n.parquet ;;
      esac
    done
    ;;
  checks-d3)  # depth 3 on the fresh set's workloads (three batches in flight; $CHECKSD3 names)
    for n in ${CHECKSD3:-azure_mid longout_hi}; do
      replay "$n-d3" $C2/$n.parquet --set batches_in_flight=3
    done
    ;;
  checks3)  # the third set (traces/checks3/: penalties on every request, make_checks.py 3)
    for n in ${CHECKS3:-specpen reasoning3}; do
      case $n in
        specpen) replay "$n" traces/checks3/$n.parquet --set spec.method=ngram-gpu --set spec.k=3 ;;
        *) replay "$n" traces/checks3/$n.parquet ;;
      esac
    done
    ;;
  checks4)  # the fourth set (traces/checks4/: high arrival rates, make_checks.py 4)
    for n in ${CHECKS4:-highrate azure_x10}; do
      replay "$n" traces/checks4/$n.parquet
    done
    ;;
  checks5)  # the fifth set: the second set's workloads sampled at random (sim.cost.sampling),
    # and one of them greedy on the same host (the measured effect of sampling at random)
    S=(--set sampling.temperature=0.8)
    for n in ${CHECKS5:-longout_hi-topp azure_mid-topk specdec2-topp burst2-random longout_hi-greedy}; do
      case $n in
        longout_hi-topp) replay "$n" $C2/longout_hi.parquet "${S[@]}" --set sampling.top_p=0.95 ;;
        azure_mid-topk) replay "$n" $C2/azure_mid.parquet "${S[@]}" --set sampling.top_k=40 ;;
        specdec2-topp) replay "$n" $C2/specdec2.parquet --set spec.method=ngram-gpu --set spec.k=3 \
          "${S[@]}" --set sampling.top_p=0.95 ;;
        burst2-random) replay "$n" $C2/burst2.parquet --set sampling.temperature=1.0 ;;
        longout_hi-greedy) replay "$n" $C2/longout_hi.parquet ;;
        *) echo "unknown check $n"; exit 2 ;;
      esac
    done
    ;;
  calib-spec)  # the short calibration run for speculative decoding's CPU phases (bundled
    # traces/specdec.parquet; the check traces/checks/specdec.parquet is another workload)
    replay calib-spec traces/specdec.parquet --set spec.method=ngram-gpu --set spec.k=3
    ;;
  calib-ramp)  # the CPU phases' envelope run (make_checks.py ramp): queued at once, the batch
    # fills to max_num_seqs and drains to one row (reports/fidelity/README.md section N)
    replay calib-ramp traces/fidelity/ramp.parquet --set arrival=asap
    ;;
  calib-ramp-long)  # the same with ~1.9k-token prompts (make_checks.py ramp_long): per-context
    # costs told from per-row ones at large batches
    replay calib-ramp-long traces/fidelity/ramp_long.parquet --set arrival=asap
    ;;
  calib-specpen)  # spec decoding with penalties on every other request (make_checks.py calib):
    # the host work of the penalties on verify steps (history_host)
    replay calib-specpen traces/fidelity/specdec_pen.parquet --set spec.method=ngram-gpu --set spec.k=3
    ;;
  mixed-ab)  # prefill/mixed steps as CUDA graphs: the same check off and on, back to back
    replay burst-mgoff $C/burst.parquet
    replay burst-mgon $C/burst.parquet --set cuda_graphs_mixed=true
    ;;
  sweep)
    log "shapes $tag"
    python3 -m replay shapes --set model="$model" --set num_kv_blocks="$blocks" \
      -o "$out/shapes-$tag.parquet" 2>&1 | tail -8
    cp "$out/shapes-$tag.parquet" "$pack/"
    ;;
  sweep-spec)
    log "shapes $tag spec"
    python3 -m replay shapes --set model="$model" --set num_kv_blocks="$blocks" \
      --set spec.method=ngram-gpu --set spec.k=3 --kinds decode \
      --max-seconds "${SPEC_SWEEP_S:-70}" -o "$out/shapes-$tag-spec.parquet" 2>&1 | tail -8
    cp "$out/shapes-$tag-spec.parquet" "$pack/"
    ;;
  sampling)  # each random sampling mode against greedy per sampled row (replay sampling)
    sampling_sweep "sampling-$tag"
    ;;
  idlegap|idlegap-spec)
    extra=(); sfx=""
    if [ "$part" = idlegap-spec ]; then extra=(--set spec.method=ngram-gpu --set spec.k=3); sfx=-spec; fi
    log "idlegap $tag$sfx"
    python3 -m replay idlegap --set model="$model" --set num_kv_blocks="$blocks" "${extra[@]}" \
      --shapes "${IDLEGAP_SHAPES:-16}" --repeats "${IDLEGAP_REPEATS:-6}" -q \
      -o "$out/idlegap-$tag$sfx.parquet" 2>&1 | grep -v -e leaked -e nanobind -e "skipped rem" | tail -16
    cp "$out/idlegap-$tag$sfx.parquet" "$pack/"
    ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
log done
