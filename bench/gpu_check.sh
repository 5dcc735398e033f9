#!/usr/bin/env bash
# The CUDA backend on a real GPU (an H200 or any sm_80+ card): kernels and models against the NumPy
# backend, then kernel, attention and Llama-3-8B-shaped step speed against measured copy/matmul ceilings.
# Installs nothing: needs CuPy (cupy-cuda13x or cupy-cuda12x) and the repository's core dependencies.
# Fits the GPU machine: under 7 minutes in all (NVRTC compiles included; every section is time-boxed and
# gpu_check.py stops at 395 s), at most 5 files under $OUT (scratch files go to a temporary folder).
# Without CuPy or a GPU it still writes $OUT/summary.txt saying what is missing, and exits non-zero.
#   bash bench/gpu_check.sh                   # results under $OUT (default ./gpu_check_out)
#   PYTHON=/path/to/python bash bench/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-$PWD/gpu_check_out}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
mkdir -p "$OUT"
{
  date -u
  nvidia-smi || echo "nvidia-smi not available"
  "$PYTHON" -c "import cupy; print('cupy', cupy.__version__, 'CUDA runtime', cupy.cuda.runtime.runtimeGetVersion())" \
    || echo "CuPy not importable by $PYTHON"
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"
# Correctness first, speed second; each section runs in its own time-limited process, so one failing
# (even with a sticky CUDA error) does not stop the others. The table is printed last, and kept in
# $OUT/summary.txt after every section in case this outer limit has to kill the run.
timeout -k 5 395 "$PYTHON" bench/gpu_check.py --out "$OUT" --work "$WORK" 2>&1 | tee "$OUT/log.txt"
status=${PIPESTATUS[0]}
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
  echo "gpu_check.py ran past 395 s; sections finished so far:"
  cat "$OUT/summary.txt" 2>/dev/null
fi
rm -rf "$WORK"
exit "$status"
