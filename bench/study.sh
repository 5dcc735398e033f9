#!/usr/bin/env bash
# The scheduling study of docs/benchmarks.md: a random-weight Llama on the CPU backend, the bundled ShareGPT
# trace scaled to the model, the four policies side by side at one QPS, then each policy's capacity under
# a P99 TBT SLO of 5x the measured batch-32 decode step. Results in bench/out/study, plots in docs/plots.
# About 10 minutes on a 2-core VM. Extra arguments go to `bench compare` (e.g. --policies sarathi,vllm).
set -euo pipefail
cd "$(dirname "$0")/.."
# One BLAS thread: on a small shared VM, OpenBLAS's worker threads spin against the other processes
# (measured here: 2-6x slower steps with the default thread count).
export OPENBLAS_NUM_THREADS=1
MODEL=${MODEL:-/tmp/minisarathi-study-model}
QPS=${QPS:-1.5}
python -m minisarathi bench random-model "$MODEL" --hidden-size 512 --num-layers 4 --num-heads 8 \
    --num-kv-heads 4 --intermediate-size 1408 --max-position-embeddings 2048 --seed 0
python -m minisarathi bench compare --model "$MODEL" --max-model-len 2048 \
    --policies sarathi,vllm,orca,simple_chunking --chunk-sizes 64,128 \
    --lengths trace --trace-scale 0.125 --num-requests 24 --qps "$QPS" --workload-seed 0 \
    --capacity --granularity 0.25 --max-trials 6 --trial-seconds 40 \
    --out bench/out/study --plots docs/plots "$@"
