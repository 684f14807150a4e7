#!/usr/bin/env bash
# The GPU check that fits the machine we are sometimes lent: one H200, Python 3.12, torch and transformers,
# but no vLLM, Ray or DeepSpeed and no network (bench/README.md, "GPU device check"). It checks the learner
# side of Tandem on CUDA (bench/gpu_check.py, each check its own process) and prints one table:
#   collectives    the learner's group at world size 1 (nccl), all-reduce and broadcast of 64 MiB
#   zero2 / zero3  a real learner step, bf16, sdpa, on the 0.5B-shaped model: tokens/s, MFU, peak memory
#                  (torch.cuda.max_memory_allocated) beside the memory plan's prediction (tandem plan's arithmetic)
#   varlen         the same with flash_attention_2 (varlen), when flash_attn is importable
#   32k            one 32K-token response, gradient checkpointing + chunked log-probs (ZeRO-2)
#   weights        the same-device weight path between two processes (CUDA IPC), every byte checked
# Any failed check fails the script (exit 1) after the table. Not the full stack: bench/gpu_smoke.sh is that.
#
#   bash bench/gpu_device_check.sh --prepare   # here, with pip: DeepSpeed (source) and the wheels it lacks, into .whl/
#   bash bench/gpu_device_check.sh             # there (carry .whl): ~4 min on an H200
#   bash bench/gpu_device_check.sh --cpu       # the same checks on a CPU: tiny shape, short responses (~2 min)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODE=gpu
case "${1:-}" in
  --prepare) MODE=prepare ;;
  --cpu) MODE=cpu ;;
  "") ;;
  -h | --help) sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "gpu_device_check: unknown option $1 (try --help)" >&2; exit 2 ;;
esac
WHEELS="$ROOT/.whl"

if [[ $MODE == prepare ]]; then
  # Versions: the ones Tandem pins or runs with here; Python 3.12 x86-64 wheels for the lent machine.
  mkdir -p "$WHEELS"
  grep -qx '/.whl/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.whl/' >>"$ROOT/.git/info/exclude"
  PIP="${TANDEM_PY:-$ROOT/.venv/bin/python} -m pip download --no-deps -q -d $WHEELS"
  $PIP --no-binary=:all: deepspeed==0.19.8
  $PIP --only-binary=:all: hjson pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5
  $PIP --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 pydantic-core==2.50.5
  du -sh "$WHEELS"
  exit 0
fi

PY="${TANDEM_PY:-}"
if [[ -z $PY ]]; then
  for candidate in "$ROOT/.venv/bin/python" python3 python; do
    if command -v "$candidate" >/dev/null 2>&1; then PY="$candidate"; break; fi
  done
fi
OUT_DIR="${OUT:-/tmp/gpu-device-check}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if ! "$PY" -c "import deepspeed, pydantic" 2>/dev/null; then
  [[ -d $WHEELS ]] || { echo "gpu_device_check: deepspeed/pydantic missing and no .whl/ (run --prepare here, carry .whl)" >&2; exit 1; }
  SITE=/tmp/gpu-check-site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --target "$SITE" \
    "$WHEELS"/*
  export PYTHONPATH="$PYTHONPATH:$SITE"
fi

if [[ $MODE == gpu ]]; then
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: use --cpu'"
  MODEL_ARGS=() TOKENS=8192 LONG=32704 SEQS=2 DTYPE=bfloat16
else
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
  MODEL_ARGS=(--tiny-shape) TOKENS=256 LONG=1984 SEQS=2 DTYPE=bfloat16
fi
MODEL="${GPU_CHECK_MODEL:-/tmp/gpu-check-model-$MODE}"
"$PY" "$ROOT/bench/gpu_model.py" "$MODEL" "${MODEL_ARGS[@]}" --dtype "$DTYPE" >"$OUT_DIR/model.json"

declare -a NAMES=() CMDS=()
add() { NAMES+=("$1"); shift; CMDS+=("$*"); }
STEP="step --model $MODEL --dtype $DTYPE --sequences $SEQS --tokens $TOKENS"
add collectives collectives
add zero2 "$STEP --zero 2 --attention sdpa --offload"
add zero3 "$STEP --zero 3 --attention sdpa --offload"
if "$PY" -c "import flash_attn" 2>/dev/null && [[ $MODE == gpu ]]; then
  add varlen "$STEP --zero 2 --attention flash_attention_2"
fi
add 32k "step --model $MODEL --dtype $DTYPE --sequences 1 --tokens $LONG --zero 2 --attention sdpa --checkpointing --repeats 1"
add weights "weights --model $MODEL --dtype $DTYPE"

failed=0
: >"$OUT_DIR/results.jsonl"
for i in "${!NAMES[@]}"; do
  name="${NAMES[$i]}"
  echo "== $name: bench/gpu_check.py ${CMDS[$i]}" >&2
  start=$(date +%s)
  # shellcheck disable=SC2086
  if "$PY" "$ROOT/bench/gpu_check.py" ${CMDS[$i]} >"$OUT_DIR/$name.log" 2>&1; then
    line=$(grep '^RESULT ' "$OUT_DIR/$name.log" | tail -1 | cut -c8-)
    echo "{\"name\": \"$name\", \"wall_s\": $(($(date +%s) - start)), \"result\": $line}" >>"$OUT_DIR/results.jsonl"
  else
    failed=1
    echo "{\"name\": \"$name\", \"error\": $("$PY" -c 'import json,sys; print(json.dumps(sys.stdin.read()[-1500:]))' <"$OUT_DIR/$name.log")}" \
      >>"$OUT_DIR/results.jsonl"
  fi
done
"$PY" "$ROOT/bench/gpu_check.py" table --results "$OUT_DIR/results.jsonl" --mode "$MODE"
if [[ $failed != 0 ]]; then
  echo "gpu_device_check: FAILED (logs in $OUT_DIR)" >&2
  exit 1
fi
