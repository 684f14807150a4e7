#!/usr/bin/env bash
# GPU smoke test on ONE GPU (an H200 in mind): a random-init model of Qwen2.5-0.5B's shape built here
# (bench/gpu_model.py, no model hub), short real `tandem train` runs of configs/demo.yaml, one per
# weight path, and per run the weight-push time, generation tokens/s and learner tokens/s
# (bench/gpu_summary.py). Installs nothing and needs no network. bench/README.md, "GPU smoke".
#
#   bash bench/gpu_smoke.sh              # ray, distributed (gloo), distributed (nccl, a probe): ~5.5 min
#   bash bench/gpu_smoke.sh --inflight   # ... and rollout.weight_update=inflight: ~+1.5 min
#   bash bench/gpu_smoke.sh --dry-run    # print the plan (every command, its overrides and times); no GPU
#   bash bench/gpu_smoke.sh --cpu        # the same pipeline on a CPU: tiny shape, float32, ray + gloo
#
# One GPU, two processes: the learner rank takes it in Ray's accounting (resources.learner.num_gpus=1)
# and the generation actor reserves none (resources.actors.num_gpus=0: a non-zero value must equal
# tensor_parallel, and a local Ray advertises only the real GPU) but sees the same device:
# RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 keeps Ray from hiding it. vLLM takes engine.
# gpu_memory_utilization (GPU_MEM, 0.3) of it, the learner what it needs beside.
# NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so the distributed channel is measured
# over gloo and the nccl run is a probe whose failure does not fail the script.
#
# Environment: TANDEM_PY (the interpreter; default: the first of .venv/bin/python, python3, python,
# /opt/conda/bin/python, /usr/local/bin/python3, /usr/bin/python3 whose torch sees a GPU),
# OUT (results: logs, copied run files, summary.json; default /tmp/gpu-smoke), GPU_SMOKE_WORK (the model
# and the full run directories; default /tmp/gpu-smoke-work), STEPS (6), MAX_TOKENS (256), GPU_MEM (0.3),
# BUDGET_S (500: a run whose timeout would end past it is skipped), RUN_TIMEOUT_S (180).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-/tmp/gpu-smoke}"
WORK="${GPU_SMOKE_WORK:-/tmp/gpu-smoke-work}"
MODE=gpu
DRY_RUN=0
RUNS="ray dist_gloo dist_nccl"
REQUIRED="ray dist_gloo"  # a failure of these fails the script; the nccl probe may fail

usage() { sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --inflight) RUNS="${RUNS/dist_nccl/inflight dist_nccl}"; REQUIRED="$REQUIRED inflight" ;;
    --no-nccl) RUNS="${RUNS/dist_nccl/}" ;;
    --runs) shift; RUNS="${1//,/ }"; REQUIRED="${RUNS/dist_nccl/}" ;;
    --cpu) MODE=cpu ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_smoke: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
if [[ $MODE == cpu ]]; then
  RUNS="${RUNS/dist_nccl/}"
  REQUIRED="${REQUIRED/dist_nccl/}"
fi
read -r -a RUN_LIST <<<"$RUNS"

if [[ $MODE == gpu ]]; then
  STEPS="${STEPS:-6}" MAX_TOKENS="${MAX_TOKENS:-256}" PROMPTS=32 GROUP=8 DTYPE=bfloat16
  RUN_TIMEOUT_S="${RUN_TIMEOUT_S:-180}" PROBE_STEPS=2 PROBE_TIMEOUT_S=150 EXPECT_RUN_S=100 EXPECT_PROBE_S=70
  MODEL_ARGS=() EXPECT_MODEL_S=40
else
  STEPS="${STEPS:-3}" MAX_TOKENS="${MAX_TOKENS:-16}" PROMPTS=8 GROUP=4 DTYPE=float32
  RUN_TIMEOUT_S="${RUN_TIMEOUT_S:-400}" PROBE_STEPS=2 PROBE_TIMEOUT_S=300 EXPECT_RUN_S=60 EXPECT_PROBE_S=60
  MODEL_ARGS=(--tiny-shape) EXPECT_MODEL_S=15
fi
if [[ $MODE == gpu ]]; then BUDGET_S="${BUDGET_S:-500}"; else BUDGET_S="${BUDGET_S:-1200}"; fi
GPU_MEM="${GPU_MEM:-0.3}"
MODEL="$WORK/model-$MODE"
MANIFEST="$OUT_DIR/runs.tsv"

# --- the interpreter ---------------------------------------------------------------------------------
pick_python() {  # TANDEM_PY, else the first candidate whose torch sees a GPU (CPU mode: has torch), else python3
  if [[ -n ${TANDEM_PY:-} ]]; then echo "$TANDEM_PY"; return; fi
  local py test='import sys, torch; sys.exit(not torch.cuda.is_available())'
  [[ $MODE == cpu ]] && test='import torch'
  for py in "$ROOT/.venv/bin/python" python3 python /opt/conda/bin/python /usr/local/bin/python3 /usr/bin/python3; do
    if command -v "$py" >/dev/null && timeout 60 "$py" -c "$test" >/dev/null 2>&1; then
      echo "$py"
      return
    fi
  done
  echo python3
}

# The packages a run imports, checked in one go: one line naming all that is missing, or the versions (JSON).
check_packages() {
  timeout -k 10 120 "$1" - "$MODE" <<'PY'
import importlib, json, sys
mode = sys.argv[1]
need = ["torch", "vllm", "ray", "deepspeed", "transformers", "tokenizers", "safetensors", "pydantic", "yaml", "numpy"]
missing, versions = [], {"python": sys.version.split()[0], "executable": sys.executable}
for name in need:
    try:
        versions[name] = getattr(importlib.import_module(name), "__version__", "?")
    except ModuleNotFoundError:
        missing.append(name)
    except Exception as exc:  # an import that fails is as missing as an absent package
        missing.append(f"{name} (import fails: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:80]})")
if "torch" in versions:
    import torch
    versions["torch_cuda"] = torch.version.cuda
    versions["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if versions["gpus"]:
        versions["gpu"] = torch.cuda.get_device_name(0)
        versions["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    if mode == "gpu" and not versions["gpus"]:
        missing.append(f"a CUDA GPU visible to torch {versions['torch']} (torch.version.cuda={torch.version.cuda})")
if missing:
    print("missing: " + ", ".join(missing))
    sys.exit(3)
print(json.dumps(versions))
PY
}

# --- the runs ----------------------------------------------------------------------------------------
common_overrides() {
  local label=$1 steps=$2
  local -a o=(
    "model.path=$MODEL" model.build_tiny=false "model.dtype=$DTYPE"
    "rollout.prompts_per_step=$PROMPTS" "rollout.group_size=$GROUP" "rollout.max_tokens=$MAX_TOKENS"
    "rollout.prompts_per_request=$PROMPTS"
    "run.name=$label" "run.output_dir=$WORK/runs/$label" "run.steps=$steps"
    run.save_final=false run.checkpoint_every=0 "run.trackers=[jsonl]" run.live=false run.log_samples=2
    run.startup_timeout_s=300 run.data_timeout_s=180 run.weights_timeout_s=180 weights.push_timeout_s=60
  )
  if [[ $MODE == gpu ]]; then
    o+=(
      resources.actors.num_gpus=0 resources.actors.num_cpus=4 resources.learner.num_gpus=1
      resources.learner.num_cpus=4 "engine.gpu_memory_utilization=$GPU_MEM" engine.enforce_eager=true
      learner.token_budget=16384
    )
  fi
  printf '%s\n' "${o[@]}"
}

run_overrides() {
  local label=$1 steps=$STEPS
  [[ $label == dist_nccl ]] && steps=$PROBE_STEPS
  common_overrides "$label" "$steps"
  case "$label" in
    ray) printf '%s\n' weights.backend=ray ;;
    dist_gloo) printf '%s\n' weights.backend=distributed weights.process_group=gloo ;;
    dist_nccl) printf '%s\n' weights.backend=distributed weights.process_group=nccl ;;
    inflight) printf '%s\n' weights.backend=ray rollout.weight_update=inflight "rollout.max_inflight_prompts=$PROMPTS" ;;
    *) echo "gpu_smoke: unknown run '$label' (ray, dist_gloo, dist_nccl, inflight)" >&2; return 2 ;;
  esac
}

run_timeout() { if [[ $1 == dist_nccl ]]; then echo "$PROBE_TIMEOUT_S"; else echo "$RUN_TIMEOUT_S"; fi; }
run_expect() { if [[ $1 == dist_nccl ]]; then echo "$EXPECT_PROBE_S"; else echo "$EXPECT_RUN_S"; fi; }

# The environment of every step: offline, no usage reports, the repository importable, and (GPU) Ray
# leaving CUDA_VISIBLE_DEVICES alone so that the actor, which reserves no GPU, sees the one there is.
run_env() {
  local -a e=(
    "PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}" "TANDEM_CACHE=$WORK/cache" HF_HUB_OFFLINE=1
    TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 RAY_USAGE_STATS_ENABLED=0
    TOKENIZERS_PARALLELISM=false
  )
  if [[ $MODE == gpu ]]; then
    e+=(RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0)
  fi
  printf '%s\n' "${e[@]}"
}

quoted() { printf '%q ' "$@"; }

train_command() {  # the argv of one run, after `env ...`
  local label=$1
  local -a overrides
  mapfile -t overrides < <(run_overrides "$label")
  printf '%s\n' "$PY" -m launch.cli train --config configs/demo.yaml "${overrides[@]}"
}

# --- the plan ----------------------------------------------------------------------------------------
print_plan() {
  local -a envs cmd
  mapfile -t envs < <(run_env)
  local shape total=$((15 + EXPECT_MODEL_S + 5)) i=3
  shape="$({ command -v "$PY" >/dev/null && "$PY" "$ROOT/bench/gpu_model.py" --describe "${MODEL_ARGS[@]}"; } 2>/dev/null ||
    python3 "$ROOT/bench/gpu_model.py" --describe "${MODEL_ARGS[@]}" 2>/dev/null || echo '(no python to describe it)')"
  echo "gpu_smoke plan ($MODE mode): runs: ${RUN_LIST[*]} (required: $REQUIRED); results in $OUT_DIR, model and full run dirs in $WORK"
  echo "interpreter: $PY (TANDEM_PY overrides)"
  echo "model: Qwen2.5-0.5B shape, random init, $DTYPE: $shape"
  echo "environment: $(quoted "${envs[@]}")"
  echo "[1] check packages (torch with CUDA, vllm, ray, deepspeed, transformers, ...): timeout 120 s, expected ~15 s"
  echo "[2] build the model: $(quoted "$PY" bench/gpu_model.py "$MODEL" --dtype "$DTYPE" "${MODEL_ARGS[@]}")"
  echo "    timeout 300 s, expected ~${EXPECT_MODEL_S} s (reused when already built)"
  for label in "${RUN_LIST[@]}"; do
    mapfile -t cmd < <(train_command "$label")
    echo "[$i] run $label: timeout $(run_timeout "$label") s, expected ~$(run_expect "$label") s; log $OUT_DIR/$label.log"
    echo "    $(quoted "${cmd[@]}")"
    echo "OVERRIDES $label: ${cmd[*]:6}"
    total=$((total + $(run_expect "$label")))
    i=$((i + 1))
  done
  echo "[$i] summarise: $(quoted "$PY" bench/gpu_summary.py "$MANIFEST" --model "$MODEL" --out "$OUT_DIR/summary.json")"
  echo "    prints a table and one 'RESULT <run>: weight push ... | generation ... tok/s | learner ... tok/s' line per run"
  echo "expected total: ~${total} s; budget ${BUDGET_S} s (BUDGET_S): a run that could end past it is skipped"
}

# --- doing it ----------------------------------------------------------------------------------------
wait_gpu_free() {  # the previous run's processes have let go of the GPU (up to 30 s)
  command -v nvidia-smi >/dev/null || return 0
  local _
  for _ in $(seq 30); do
    [[ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null || true)" ]] && return 0
    sleep 1
  done
  echo "gpu_smoke: warning: GPU processes still alive 30 s after the run: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')" >&2
}

copy_run_files() {  # the small files of each run directory into $OUT (the checkpoint-free part)
  local src=$1 dest=$2 dir name
  for dir in "$src"/*/; do
    [[ -d $dir ]] || continue
    name="$(basename "$dir")"
    mkdir -p "$dest/$name"
    for f in metrics.jsonl timeline.jsonl summary.json config.yaml samples.jsonl processes.json; do
      [[ -f $dir/$f ]] && cp -p "$dir/$f" "$dest/$name/"
    done
    [[ -d $dir/logs ]] && cp -rp "$dir/logs" "$dest/$name/"
  done
  return 0
}

run_one() {
  local label=$1 limit start rc=0 wall note=""
  local -a cmd
  limit="$(run_timeout "$label")"
  if ((SECONDS + limit > BUDGET_S)); then
    echo "== $label: skipped: ${SECONDS} s used, its ${limit} s timeout would pass BUDGET_S=${BUDGET_S}"
    printf '%s\t%s\t%s\t%s\t%s\n' "$label" -1 0 "runs/$label" "" >>"$MANIFEST"
    return 0
  fi
  mapfile -t cmd < <(train_command "$label")
  rm -rf "${WORK:?}/runs/$label"
  mkdir -p "$WORK/runs/$label" "$OUT_DIR/runs/$label"
  echo "== $label: $(quoted "${cmd[@]:6}")"
  start=$SECONDS
  (cd "$ROOT" && timeout -k 20 "$limit" "${cmd[@]}") >"$OUT_DIR/$label.log" 2>&1 || rc=$?
  wall=$((SECONDS - start))
  copy_run_files "$WORK/runs/$label" "$OUT_DIR/runs/$label"
  printf '%s\t%s\t%s\t%s\t%s\n' "$label" "$rc" "$wall" "runs/$label" "$label.log" >>"$MANIFEST"
  ((rc == 124 || rc == 137)) && note="timed out after ${limit} s; "
  echo "== $label: exit $rc in ${wall} s (${note}last line: $(grep -v '^[[:space:]]*$' "$OUT_DIR/$label.log" | tail -n 1 | cut -c1-200))"
  wait_gpu_free
}

fail_early() {  # one line, and a summary.json that says it
  echo "gpu_smoke: $1" >&2
  printf '{"error": %s}\n' "$(printf '%s' "$1" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))' 2>/dev/null || echo '"see the log"')" >"$OUT_DIR/summary.json"
  exit "${2:-2}"
}

main() {
  PY="$(pick_python)"
  if ((DRY_RUN)); then
    print_plan
    exit 0
  fi
  mkdir -p "$OUT_DIR" "$WORK"
  : >"$MANIFEST"
  print_plan >"$OUT_DIR/plan.txt"
  command -v "$PY" >/dev/null || fail_early "interpreter '$PY' not found; set TANDEM_PY=/path/to/python (with torch+CUDA, vllm, ray, deepspeed, transformers)"
  local kv envs_json rc=0
  while read -r kv; do export "${kv?}"; done < <(run_env)
  envs_json="$(check_packages "$PY" 2>/dev/null)" || rc=$?
  envs_json="$(printf '%s\n' "$envs_json" | tail -n 1)"  # the verdict; libraries may print warnings first
  if ((rc != 0)); then
    [[ -z ${TANDEM_PY:-} && $MODE == gpu ]] && envs_json="$envs_json (no .venv/bin/python, python3, python, /opt/conda/bin/python, /usr/local/bin/python3 or /usr/bin/python3 has a torch that sees a GPU)"
    fail_early "cannot run with $PY: ${envs_json:-the package check failed or timed out (exit $rc)}; set TANDEM_PY=/path/to/python (with torch+CUDA, vllm, ray, deepspeed, transformers); nothing is installed by this script" 3
  fi
  echo "$envs_json" >"$OUT_DIR/env.json"
  echo "== packages: $envs_json"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader | sed 's/^/== gpu: /' || true
  echo "== /dev/shm: $(df -h /dev/shm 2>/dev/null | awk 'NR==2 {print $2 " (Ray object store)"}')"

  local start=$SECONDS
  if ! (cd "$ROOT" && timeout -k 10 300 "$PY" bench/gpu_model.py "$MODEL" --dtype "$DTYPE" "${MODEL_ARGS[@]}") >"$OUT_DIR/model.log" 2>&1; then
    fail_early "building the model failed: $(tail -n 1 "$OUT_DIR/model.log")"
  fi
  echo "== model: $(tail -n 1 "$OUT_DIR/model.log" | cut -c1-300) ($((SECONDS - start)) s)"
  wait_gpu_free

  for label in "${RUN_LIST[@]}"; do
    run_one "$label"
  done

  echo "== summary ($((SECONDS)) s so far)"
  (cd "$ROOT" && timeout 120 "$PY" bench/gpu_summary.py "$MANIFEST" --model "$MODEL" \
    --out "$OUT_DIR/summary.json" --extra "$envs_json") 2>&1 | tee "$OUT_DIR/summary.txt" || true
  local failed=""
  for label in $REQUIRED; do
    awk -F'\t' -v l="$label" '$1 == l && $2 == 0 {ok = 1} END {exit !ok}' "$MANIFEST" || failed="$failed $label"
  done
  echo "gpu_smoke: done in ${SECONDS} s; results in $OUT_DIR (summary.json, summary.txt, <run>.log, runs/)"
  if [[ -n $failed ]]; then
    echo "gpu_smoke: FAILED:$failed (see $OUT_DIR/<run>.log)" >&2
    exit 1
  fi
}

main
