#!/usr/bin/env bash
# The CUDA backend's first run on a GPU (an H200 or any sm_80+ card), conclusive in one run: correctness
# (every op, the samplers and whole models against the NumPy backend), then CUDA graphs and overlap against
# eager, then speed; one process per section, each with its own limit (bench/gpu_check.py --list).
# A full run stops within 500 s, --quick within 285 s; typical runs take far less.
# Installs nothing: needs CuPy (cupy-cuda13x or cupy-cuda12x) and the repository's core dependencies.
# $OUT gets four files: summary.txt (the engine's fallback, each section's status and first failing call,
# every row), summary.json (the same, machine-readable), log.txt (all output, tracebacks and stacks) and
# environment.txt. The summaries are rewritten after every section, so a kill keeps what finished.
# Without CuPy or a GPU the summary says what is missing, and the exit code is 2.
#   bash bench/gpu_check.sh [--quick] [--section NAME ...]     # results under $OUT (default ./gpu_check_out)
#   PYTHON=/path/to/python bash bench/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-$PWD/gpu_check_out}"
LIMIT=500
[[ " $* " == *" --quick "* ]] && LIMIT=285
mkdir -p "$OUT"
{
  date -u
  nvidia-smi || echo "nvidia-smi not available"
  "$PYTHON" -c "import cupy; print('cupy', cupy.__version__, 'CUDA runtime', cupy.cuda.runtime.runtimeGetVersion())" \
    || echo "CuPy not importable by $PYTHON"
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"
set -o pipefail
timeout -k 5 "$LIMIT" "$PYTHON" bench/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
  echo "gpu_check.py ran past $LIMIT s; sections finished so far:"
  cat "$OUT/summary.txt" 2>/dev/null
fi
exit "$status"
