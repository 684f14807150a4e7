#!/usr/bin/env bash
# The tools example end to end (`tandem example tools`), on both weight-update engines: the warm-start
# (built once, cached under ~/.cache/tandem/models/tiny-tools) and its held-out success, then GRPO's
# held-out eval success by step, between requests and in flight, one after the other.
#   bench/tools_example.sh [OUT_DIR] [extra overrides ...]       (~12 min on 2 cores)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-/tmp/tandem-tools-example}"
shift || true
TANDEM="$ROOT/.venv/bin/tandem"
mkdir -p "$OUT"
for engine in between_requests inflight; do
  echo "== $engine" >&2
  start=$(date +%s)
  "$TANDEM" example tools rollout.weight_update="$engine" run.output_dir="$OUT/runs" run.name="tools-$engine" \
    run.live=false "$@" >"$OUT/$engine.log" 2>&1 || { tail -20 "$OUT/$engine.log" >&2; exit 1; }
  echo "$engine: $(( $(date +%s) - start ))s" >&2
done
echo
grep -h "^warm-start:" "$OUT/between_requests.log" || echo "warm-start: cached (see ~/.cache/tandem/models/tiny-tools/*/warm-start.json)"
for engine in between_requests inflight; do
  printf '%-17s %s\n' "$engine" "$(grep -h '^eval success' "$OUT/$engine.log")"
  grep -h "^completed in" "$OUT/$engine.log" | sed "s/^/                  /"
done
