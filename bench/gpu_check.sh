#!/usr/bin/env bash
# The CUDA backend on a real GPU (an H200 or any sm_80+ card): kernels and models against the NumPy
# backend, then kernel and decode-step speed against measured copy/matmul ceilings.
# Installs nothing: needs CuPy (cupy-cuda13x or cupy-cuda12x) and the repository's core dependencies.
# About 3-5 minutes; every section is time-boxed and the whole run stops at 450 s (under 8 minutes).
#   bash bench/gpu_check.sh            # results under $OUT (default ./gpu_check_out)
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
{
  date -u
  nvidia-smi || echo "nvidia-smi not available"
  python -c "import cupy; print('cupy', cupy.__version__, 'CUDA runtime', cupy.cuda.runtime.runtimeGetVersion())" \
    || echo "CuPy not importable"
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"
# Correctness first, speed second; each section runs in its own time-limited process, so one failing
# (even with a sticky CUDA error) does not stop the others. The table is printed last, and kept in
# $OUT/summary.txt after every section in case this outer limit has to kill the run.
timeout 450 python bench/gpu_check.py --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
if [ "$status" -eq 124 ]; then
  echo "gpu_check.py ran past 450 s; sections finished so far:"
  cat "$OUT/summary.txt" 2>/dev/null
fi
exit "$status"
