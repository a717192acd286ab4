#!/usr/bin/env bash
# One prepared run on a machine with an NVIDIA GPU (issues 34 and 46), < 8 minutes per part:
#   1. install mlx with its CUDA backend (mlx[cuda13], else mlx[cuda12]) and this project
#      into a fresh venv (.cache/venv-gpu),
#   exactness (issue 46; first, since identity is the first promise):
#   2. `melix-fsm verify` on both embedded checkpoints (stdlib-tiny, stdlib-hybrid) in
#      float32, bfloat16 (cast) and 4-bit (`convert -q`), each report's JSON kept,
#   3. the qa gallery under the device's own rounding (melix_mlx.tools.qa.gallery on
#      stdlib-tiny in bfloat16 and 4-bit): the control and melix must raise no false
#      alarm, every planted bug class (tests/adapters/qa_planted_target.py) must be found,
#   4. exactness.json (melix_mlx.tools.qa.collect): every verdict, divergence rate and
#      near-tie of steps 2-3 in one file,
#   speed (issue 34):
#   5. build the widened checkpoints (presets stdlib-hybrid-wide, stdlib-tiny-wide; ~1.4 and
#      ~1.0 GB float32) into a cache folder,
#   6. run the widening identity tests, the realistic-size (slow-marked) ones included,
#   7. time t_1 / t_verify / the head step on both, and run `melix-fsm bench` on both
#      (single sequence and batch 1 / 4, k = 1, 2, greedy),
#   8. write everything under the results folder (RESULTS, default
#      benchmarks/results/gpu-<UTC time>; archived to $OUT/gpu-results.tgz when OUT is set,
#      with summary.txt and exactness.json beside it).
# Every step has its own time limit and the run goes on past a failed step, so the results
# folder always gets the logs and summary.txt says which steps failed. Both parts together
# take more than one device call allows: run `--only exactness` and `--only speed` as two
# calls (GPU_SH_BUDGET, default 460 s, bounds each).
#
# Usage: bash benchmarks/gpu.sh [--no-install] [--quick] [--only exactness|speed]
#   --no-install  use the python already on PATH (mlx, mlx-lm and the project installed):
#                 the CPU dry run, or a machine prepared by hand
#   --quick       tiny settings (a smoke run of the plumbing, minutes on a CPU): verify at
#                 its smoke profile, the gallery's planted target only, small bench
#   --only PART   run one part (exactness: steps 2-4; speed: steps 5-7); default both
# Offline machines: WHEELHOUSE=/path/to/wheels makes pip install from that folder only
# (mlx, mlx-cuda-13 or mlx-cuda-12, mlx-lm and their dependencies, msgspec,
# python-statemachine, pytest, hypothesis, tqdm, matplotlib, and hatchling to install this
# project).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
INSTALL=1
QUICK=0
ONLY=all
while [ $# -gt 0 ]; do
  case "$1" in
    --no-install) INSTALL=0 ;;
    --quick) QUICK=1 ;;
    --only)
      shift
      case "${1:-}" in
        exactness | speed) ONLY="$1" ;;
        *) echo "gpu.sh: --only takes exactness or speed" >&2; exit 2 ;;
      esac
      ;;
    *) echo "gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
RESULTS="${RESULTS:-$ROOT/benchmarks/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)}"
export MELIX_FSM_CACHE="${MELIX_FSM_CACHE:-$ROOT/.cache/widened}"  # /.cache/ is git-ignored
export PYTHONUNBUFFERED=1
mkdir -p "$RESULTS" "$MELIX_FSM_CACHE"
SUMMARY="$RESULTS/summary.txt"
: >"$SUMMARY"
START=$SECONDS
BUDGET="${GPU_SH_BUDGET:-460}"  # seconds for all steps: 8 minutes less the copy-out and slack

# step NAME LIMIT_S COMMAND...: run with a time limit (cut to what is left of BUDGET),
# log to RESULTS/NAME.log, record rc (124: timed out or skipped for want of time)
step() {
  local name="$1" limit="$2"
  shift 2
  local t0=$SECONDS left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 15 ]; then
    echo "$name rc=124 skipped (budget spent)" | tee -a "$SUMMARY" >&2
    return 124
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s)" >&2
  timeout "$limit" "$@" >"$RESULTS/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$SUMMARY" >&2
  return $rc
}

PIP_SRC=()
if [ -n "${WHEELHOUSE:-}" ]; then
  PIP_SRC=(--no-index --find-links "$WHEELHOUSE")
fi

install() {
  python3 -m venv "$ROOT/.cache/venv-gpu" || return 1
  # shellcheck disable=SC1091
  . "$ROOT/.cache/venv-gpu/bin/activate"
  python -m pip install -q "${PIP_SRC[@]}" --upgrade pip >/dev/null 2>&1 || true
  # the CUDA backend first; the project's own [mlx] extra would pull mlx[cpu] on Linux
  python -m pip install -q "${PIP_SRC[@]}" "mlx[cuda13]" || python -m pip install -q "${PIP_SRC[@]}" "mlx[cuda12]" \
    || return 1
  python -m pip install -q "${PIP_SRC[@]}" "mlx-lm>=0.32,<0.33" msgspec "python-statemachine>=3.2,<4" \
    pytest hypothesis tqdm matplotlib || return 1
  python -m pip install -q "${PIP_SRC[@]}" --no-deps --no-build-isolation -e "$ROOT" \
    || python -m pip install -q "${PIP_SRC[@]}" --no-deps -e "$ROOT"
}

if [ "$INSTALL" = 1 ]; then
  step install 150 install
  # shellcheck disable=SC1091
  [ -f "$ROOT/.cache/venv-gpu/bin/activate" ] && . "$ROOT/.cache/venv-gpu/bin/activate"
fi

step device 30 python - <<'EOF'
import json, platform
import mlx.core as mx
info = {"python": platform.python_version(), "mlx": mx.__version__, "default_device": str(mx.default_device())}
try:
    info["cuda_available"] = bool(mx.cuda.is_available())
except AttributeError:
    info["cuda_available"] = None
print(json.dumps(info))
EOF
cp "$RESULTS/device.log" "$RESULTS/device.json" 2>/dev/null

exactness() {
  # verify: both embedded checkpoints in float32, bfloat16 and 4-bit (each report's JSON kept)
  # limits per verify run and for the gallery: GPU_SH_VERIFY_LIMIT, GPU_SH_GALLERY_LIMIT (a
  # CPU dry run under load needs more)
  local work="$MELIX_FSM_CACHE/qa-gallery" profile=(--profile quick --draws 200)
  local limit="${GPU_SH_VERIFY_LIMIT:-45}"
  [ "$QUICK" = 1 ] && profile=(--profile smoke --draws 100)
  mkdir -p "$RESULTS/verify" "$work"
  local model dtype target
  for model in stdlib-tiny stdlib-hybrid; do
    [ -f "$work/$model-q4/config.json" ] \
      || step "convert-$model" 30 melix-fsm convert -q "$model" "$work/$model-q4"
    for dtype in float32 bfloat16 q4; do
      if [ "$dtype" = q4 ]; then target=("$work/$model-q4"); else target=("$model" --dtype "$dtype"); fi
      step "verify-$model-$dtype" "$limit" melix-fsm verify --model "${target[@]}" "${profile[@]}" \
        --seed 1 --quiet --out "$RESULTS/verify/$model-$dtype.json"
    done
  done
  # the gallery under this device's rounding: no false alarm, every planted class found
  local targets=(mlx-lm melix planted) examples=(--max-examples 5)
  [ "$QUICK" = 1 ] && targets=(planted) && examples=()
  step gallery "${GPU_SH_GALLERY_LIMIT:-150}" python -m melix_mlx.tools.qa.gallery --models stdlib-tiny --regimes bfloat16 q4 \
    --targets "${targets[@]}" "${examples[@]}" --work "$work" --out "$RESULTS/gallery.json"
  step exactness 30 python -m melix_mlx.tools.qa.collect "$RESULTS"
}

speed() {
step widen 60 bash -c 'melix-fsm widen --preset stdlib-hybrid-wide && melix-fsm widen --preset stdlib-tiny-wide'

PROMPTS=()
if [ "$QUICK" = 1 ]; then
  # plumbing only: a few tests, short prompts (a 450-700-token prefill of a 1.4 GB model
  # takes seconds per run on a CPU)
  TESTS=(-m "not slow" -k "logits or cli")
  ROUNDS=3; TOKENS=8; REPEATS=1; BATCHES=(1); KS=(2)
  # small widenings (hidden 256): the same code paths, seconds instead of minutes on a CPU
  MODELS=("$MELIX_FSM_CACHE/quick-hybrid" "$MELIX_FSM_CACHE/quick-tiny")
  step widen-quick 60 bash -c "melix-fsm widen stdlib-hybrid ${MODELS[0]} --hidden 256 --force \
    && melix-fsm widen stdlib-tiny ${MODELS[1]} --hidden 256 --force"
  echo '["def main(argv=None):\n    parser = ", "The cache keeps the most recent entries and"]' \
    >"$RESULTS/quick-prompts.json"
  PROMPTS=(--prompts "$RESULTS/quick-prompts.json")
else
  TESTS=(-m "slow or not slow")  # the realistic presets' greedy identity is slow-marked
  ROUNDS=15; TOKENS=64; REPEATS=3; BATCHES=(1 4); KS=(1 2)
  MODELS=(stdlib-hybrid-wide stdlib-tiny-wide)
fi
step identity 120 python -m pytest -q -p no:cacheprovider tests/adapters/test_widen.py "${TESTS[@]}"

step sizes 45 python benchmarks/bench_widen_sizes.py "${MODELS[@]}" --rounds "$ROUNDS"
cp "$RESULTS/sizes.log" "$RESULTS/sizes.jsonl" 2>/dev/null

for model in "${MODELS[@]}"; do
  # --regime current: this process's device (the GPU when mlx found it); no A/A control
  # to stay inside the time budget; the draft-model cell uses the embedded draft model.
  name="$(basename "$model")"
  step "bench-$name" 120 melix-fsm bench "${PROMPTS[@]}" --model "$model" --regime current --no-progress \
    --no-aa-control --batch-sizes "${BATCHES[@]}" --ks "${KS[@]}" --temps 0 --max-tokens "$TOKENS" \
    --repeats "$REPEATS" --out "$RESULTS/bench-$name"
done
}

[ "$ONLY" = speed ] || exactness
[ "$ONLY" = exactness ] || speed

echo "total $((SECONDS - START))s" >>"$SUMMARY"
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  # the device tool brings back at most 8 files: one archive, the summary and exactness.json
  tar -czf "$OUT/gpu-results.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")" && cp "$SUMMARY" "$OUT/"
  [ -f "$RESULTS/exactness.json" ] && cp "$RESULTS/exactness.json" "$OUT/"
fi
cat "$SUMMARY"
! grep -q "rc=[1-9]" "$SUMMARY"
