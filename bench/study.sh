#!/usr/bin/env bash
# The scheduling study of docs/benchmarks.md: a random-weight Llama on the CPU backend, the bundled ShareGPT
# trace scaled to the model, the four policies side by side at one QPS, then each policy's capacity under
# a P99 TBT SLO of 5x the measured batch-32 decode step. Results in bench/out/study, plots in docs/plots.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-/tmp/minisarathi-study-model}
QPS=${QPS:-0.5}
python -m minisarathi bench random-model "$MODEL" --hidden-size 512 --num-layers 4 --num-heads 8 \
    --num-kv-heads 4 --intermediate-size 1408 --max-position-embeddings 2048 --seed 0
python -m minisarathi bench compare --model "$MODEL" --max-model-len 2048 \
    --policies sarathi,vllm,orca,simple_chunking --chunk-sizes 256 \
    --lengths trace --trace-scale 0.25 --num-requests 40 --qps "$QPS" --workload-seed 0 \
    --capacity --granularity 0.15 --max-trials 6 \
    --out bench/out/study --plots docs/plots "$@"
