#!/usr/bin/env bash
# Soak ckptfs with the model-based test (tests/integration/test_model.py): run it again
# and again with new seeds until a time or an example count is reached, then print the
# total example count, the duration and every failure with its seed and the command
# that reproduces it.
#
# Usage: tools/soak.sh [LIMIT] [STORES] [DURABILITIES]
#   LIMIT         30m, 2h, 90s (time) or a bare number (examples); default 10m
#   STORES        local, s3 or local,s3 (s3 = the SeaweedFS fixture); default local,s3
#   DURABILITIES  sync, async or sync,async; default sync,async
# Environment: EXAMPLES_PER_RUN (default 10), STEPS (default 25), SEED (first seed;
#   default random), SHRINK=0 (skip shrinking a failure), PYTHON (default .venv/bin/python),
#   SOAK_DIR (logs; default /tmp/ckptfs-soak-<date>).
set -uo pipefail
cd "$(dirname "$0")/.."

limit=${1:-10m}
stores=${2:-local,s3}
durabilities=${3:-sync,async}
per_run=${EXAMPLES_PER_RUN:-10}
steps=${STEPS:-25}
python=${PYTHON:-.venv/bin/python}
soak_dir=${SOAK_DIR:-/tmp/ckptfs-soak-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$soak_dir"
report="$soak_dir/runs.jsonl"
: > "$report"

max_seconds=0
max_examples=0
case "$limit" in
    *[0-9]s) max_seconds=${limit%s} ;;
    *[0-9]m) max_seconds=$(( ${limit%m} * 60 )) ;;
    *[0-9]h) max_seconds=$(( ${limit%h} * 3600 )) ;;
    *[!0-9]*|"") echo "soak: LIMIT must be like 30m, 2h, 90s or a number of examples" >&2; exit 2 ;;
    *) max_examples=$limit ;;
esac

seed=${SEED:-$(( (RANDOM << 15 | RANDOM) ))}
start=$(date +%s)
runs=0
failures=()

examples_so_far() {
    "$python" - "$report" <<'PY'
import json, sys
print(sum(json.loads(l)["examples"] for l in open(sys.argv[1]) if l.strip()))
PY
}

echo "soak: limit $limit, stores $stores, durability $durabilities, $per_run examples x" \
     "$steps steps per run, first seed $seed, logs in $soak_dir"
while :; do
    elapsed=$(( $(date +%s) - start ))
    done_examples=$(examples_so_far)
    if (( max_seconds && elapsed >= max_seconds )); then break; fi
    if (( max_examples && done_examples >= max_examples )); then break; fi
    runs=$((runs + 1))
    log="$soak_dir/run-$runs-seed-$seed.log"
    lines_before=$(wc -l < "$report")
    CKPTFS_MODEL_SEED=$seed CKPTFS_MODEL_EXAMPLES=$per_run CKPTFS_MODEL_STEPS=$steps \
    CKPTFS_MODEL_STORES=$stores CKPTFS_MODEL_DURABILITY=$durabilities \
    CKPTFS_MODEL_SHRINK=${SHRINK:-1} CKPTFS_MODEL_REPORT=$report \
        "$python" -m pytest tests/integration/test_model.py -q -p no:cacheprovider \
        --basetemp "$soak_dir/tmp-run-$runs" >"$log" 2>&1
    status=$?
    # A failed run keeps its temp dir: the first failing example's daemon logs are in
    # its first-failure/ (test_model.py); a passed run's goes.
    if (( status == 0 )); then rm -rf "$soak_dir/tmp-run-$runs"; fi
    if [ "$(wc -l < "$report")" -eq "$lines_before" ]; then
        echo "soak: run $runs (seed $seed) ran no model test (exit $status); log $log:" >&2
        tail -20 "$log" >&2
        exit 2
    fi
    if (( status != 0 )); then
        failed=$(grep -o 'test_model\[[^]]*\]' "$log" | sort -u | tr '\n' ' ')
        failures+=("seed $seed: ${failed:-see log} -> $log")
        echo "soak: run $runs (seed $seed) FAILED: ${failed:-exit $status}; log $log"
        grep -E 'ModelFailure: |Flaky|Error: ' "$log" | sort -u | head -3 \
            | sed 's/^/    /'
        find "$soak_dir/tmp-run-$runs" -maxdepth 3 -name first-failure -type d \
            | sed 's/^/    daemon logs of the first failure: /'
    else
        echo "soak: run $runs (seed $seed) passed ($(tail -1 "$log"))"
    fi
    seed=$((seed + 1))
done

elapsed=$(( $(date +%s) - start ))
echo
echo "soak: $runs run(s), $(examples_so_far) example(s) in ${elapsed}s over $stores ($durabilities)"
if ((${#failures[@]})); then
    echo "soak: ${#failures[@]} failing run(s):"
    for f in "${failures[@]}"; do echo "  $f"; done
    echo "reproduce one with:  CKPTFS_MODEL_SEED=<seed> CKPTFS_MODEL_EXAMPLES=$per_run" \
         "CKPTFS_MODEL_STEPS=$steps CKPTFS_MODEL_STORES=$stores CKPTFS_MODEL_DURABILITY=<d>" \
         "$python -m pytest tests/integration/test_model.py -k '<store>-<d>'"
    echo "(each failure's log ends with hypothesis's minimal step list and a" \
         "@reproduce_failure blob)"
    exit 1
fi
echo "soak: no failure"
