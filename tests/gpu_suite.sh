#!/usr/bin/env bash
# The GPU tests, one file at a time, each under a hard time limit, on a GPU host:
#   bash tests/gpu_suite.sh LOGDIR [SECONDS_PER_FILE]
# A file that hangs is killed (SIGKILL: a process stuck in a CUDA call ignores SIGTERM) and
# named, and the next file still runs; each file's output is in LOGDIR/<file>.log even when
# killed. Prints one line per file and a total last; exits 1 if any file failed or hung.
set -uo pipefail
logs=$1; limit=${2:-150}; mkdir -p "$logs"
export PYTHONUNBUFFERED=1
files=${FILES:-$(grep -l "pytest.mark.gpu\|mark.gpu" tests/test_*.py)}  # FILES="a b": these, in order
bad=0
for f in $files; do
  name=$(basename "$f" .py)
  t0=$SECONDS
  timeout -s KILL "$limit" python3 -m pytest "$f" -m gpu -q -p no:cacheprovider -x \
    >"$logs/$name.log" 2>&1
  rc=$?
  last=$(grep -E "passed|failed|error|no tests ran" "$logs/$name.log" | tail -1)
  [ $rc -eq 137 ] && last="KILLED after ${limit} s (hung): $(tail -1 "$logs/$name.log")"
  [ $rc -ne 0 ] && [ $rc -ne 5 ] && bad=1
  printf '%-28s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$last"
done
echo "gpu suite: $([ $bad -eq 0 ] && echo PASS || echo FAIL)"
exit $bad
