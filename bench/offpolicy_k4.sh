#!/usr/bin/env bash
# Off-policy corrections side by side at max_staleness 4 with in-flight updates (issue 30): plain TIS
# (truncate), band masking (IcePop-style, [0.5, 2]) and sequence rejection (mean k3 <= 0.02 on top of
# truncation), on the demo task and on the math example; one report per task overlays the three runs
# (reward curves, the importance-sampling and rejection panels).
#   bench/offpolicy_k4.sh [demo|math|both] [OUT_DIR]      (demo: ~6 min on 2 cores; math: ~20 min)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WHICH="${1:-demo}" OUT="${2:-/tmp/tandem-offpolicy-k4}"
TANDEM="$ROOT/.venv/bin/tandem"
COMMON=(run.max_staleness=4 rollout.weight_update=inflight)
declare -A CORRECTION=(
  [truncate]="algorithm.tis.mode=truncate"
  [band]="algorithm.tis.mode=band algorithm.tis.low=0.5 algorithm.tis.high=2.0"
  [seqreject]="algorithm.tis.reject=[{level: sequence, divergence: k3, reduce: mean, high: 0.02}]"
)
run_task() {  # $1: demo | math
  local task="$1" dir="$OUT/$1"
  mkdir -p "$dir"
  for name in truncate band seqreject; do
    local -a extra
    if [[ $name == seqreject ]]; then extra=("${CORRECTION[$name]}"); else read -ra extra <<<"${CORRECTION[$name]}"; fi
    echo "== $task / $name" >&2
    if [[ $task == demo ]]; then
      "$TANDEM" train --config "$ROOT/configs/demo.yaml" "${COMMON[@]}" "${extra[@]}" \
        run.output_dir="$dir/runs" run.name="$name" >"$dir/$name.log" 2>&1
    else
      "$TANDEM" example math "${COMMON[@]}" "${extra[@]}" run.output_dir="$dir/runs" run.name="$name" \
        >"$dir/$name.log" 2>&1
    fi
    tail -2 "$dir/$name.log" | head -1 >&2
  done
  "$TANDEM" report "$dir"/runs/{truncate,band,seqreject}-* --out "$dir/report" >/dev/null  # not the eval-* runs
  echo "report: $dir/report/report.html" >&2
}
case "$WHICH" in
  demo | math) run_task "$WHICH" ;;
  both) run_task demo; run_task math ;;
  *) echo "usage: $0 [demo|math|both] [OUT_DIR]" >&2; exit 2 ;;
esac
