#!/usr/bin/env bash
# The fast numeric tests under environments that change the order of floating-point reductions, one
# variable at a time from this machine's default plus one row far from it: a test that fails in some row
# compares a float32 sum whose order is not fixed at a tolerance it has not derived (docs/testing.md,
# "Tests that hold on any machine"). Prints one line per row (row, passed, failed, seconds); exits 1 if
# any row failed. Each row's pytest log is kept in OUT_DIR.
#   bench/numerics_matrix.sh [OUT_DIR] [-- TEST_PATH...]      (11 rows, 1 to 4 min each on 2 cores)
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-/tmp/tandem-numerics-matrix}"
shift $(($# > 0 ? 1 : 0))
[[ ${1:-} == -- ]] && shift
FILES=("$@")
if ((${#FILES[@]} == 0)); then
  FILES=(
    tests/algorithms tests/test_learner_group.py tests/test_returns.py tests/test_episode_returns.py
    tests/test_packing.py tests/test_pipeline_parts.py tests/test_attention.py tests/test_critic.py
    tests/test_lora.py tests/test_collectives.py tests/test_engine_weights.py tests/test_turns.py
    tests/test_tiny_model.py tests/test_math_example_parts.py tests/test_evaluation.py tests/test_report.py
    tests/test_reward_model.py tests/test_rewards.py tests/test_tasks.py
  )
fi
# name | arguments to env(1): what each changes is in docs/testing.md. torch caps OMP_NUM_THREADS at the
# machine's cores, so MATRIX_TORCH_THREADS sets its intra-op threads with torch.set_num_threads instead.
ROWS=(
  "default|"
  "threads=1|OMP_NUM_THREADS=1 MATRIX_TORCH_THREADS=1"
  "threads=2|OMP_NUM_THREADS=2 MATRIX_TORCH_THREADS=2"
  "threads=3|OMP_NUM_THREADS=3 MATRIX_TORCH_THREADS=3"
  "no-openblas-coretype|-u OPENBLAS_CORETYPE"
  "openblas=Haswell|OPENBLAS_CORETYPE=Haswell"
  "aten=default|ATEN_CPU_CAPABILITY=default"
  "aten=avx2|ATEN_CPU_CAPABILITY=avx2"
  "mkl=compatible|MKL_CBWR=COMPATIBLE"
  "mkl=sse4_2|MKL_ENABLE_INSTRUCTIONS=SSE4_2"
  "far|-u OPENBLAS_CORETYPE OMP_NUM_THREADS=1 MATRIX_TORCH_THREADS=1 ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 MKL_CBWR=COMPATIBLE"
)
# pytest, after torch.set_num_threads($MATRIX_TORCH_THREADS) when the row sets it
PYTEST='import os, sys, torch
if os.environ.get("MATRIX_TORCH_THREADS"):
    torch.set_num_threads(int(os.environ["MATRIX_TORCH_THREADS"]))
import pytest
sys.exit(pytest.main(sys.argv[1:]))'
mkdir -p "$OUT"
cd "$ROOT"
count() {  # $1: outcome word, $2: pytest's summary line -> the number before the word, or 0
  local n
  n=$(grep -oE "[0-9]+ $1" <<<"$2" | grep -oE "^[0-9]+")
  echo "${n:-0}"
}
bad=0
printf "%-22s %7s %7s %8s\n" row passed failed seconds
for row in "${ROWS[@]}"; do
  name="${row%%|*}" args="${row#*|}"
  log="$OUT/${name//[^A-Za-z0-9_.-]/_}.log"
  start=$SECONDS
  # shellcheck disable=SC2086  # args is a list of env(1) words
  env $args "$ROOT/.venv/bin/python" -c "$PYTEST" -m "not slow" -p no:cacheprovider -q "${FILES[@]}" >"$log" 2>&1
  rc=$?
  summary=$(grep -E "(passed|failed|error)" "$log" | tail -1)
  passed=$(count passed "$summary")
  failed=$(($(count failed "$summary") + $(count "errors?" "$summary")))
  ((rc != 0 && failed == 0)) && failed=1  # pytest itself failed (collection, a crash)
  printf "%-22s %7s %7s %8s\n" "$name" "$passed" "$failed" $((SECONDS - start))
  if ((failed > 0)); then
    bad=1
    grep -E "^FAILED|^ERROR" "$log" | sed 's/^/    /'
  fi
done
echo "logs: $OUT"
exit "$bad"
