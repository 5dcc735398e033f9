#!/usr/bin/env bash
# The SLO-driven scheduling study of docs/benchmarks.md: the study model (bench/study.sh's random-weight
# Llama) on the CPU backend, the bundled ShareGPT trace scaled by 1/8. Steps, each its own folder under $OUT:
#   capacity-3x, capacity-8x   capacity under P99 TBT <= 3x and 8x the batch-32 decode step: sarathi with
#                              fixed budgets 64..512, vllm, and sarathi-slo (--tbt-slo-ms = the SLO)
#   hol-fcfs, hol-fair         5% of the prompts 16x the median: TTFT of short and long ones, without / with
#                              the fair partial-prefill limits
#   priority                   20% high-priority requests above capacity
#   timeline                   the cost model's predictions and the budget over a changing load (the plots of
#                              docs/scheduling.md)
# Usage: bench/slo_study.sh [step ...] (default: all). Run it niced on a shared machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export OPENBLAS_NUM_THREADS=1   # see bench/study.sh
MODEL=${MODEL:-/tmp/minisarathi-study-model}
OUT=${OUT:-bench/out/slo-study}
STEPS=${*:-capacity hol priority timeline}
[ -d "$MODEL" ] || python -m minisarathi bench random-model "$MODEL" --hidden-size 512 --num-layers 4 \
    --num-heads 8 --num-kv-heads 4 --intermediate-size 1408 --max-position-embeddings 2048 --seed 0
COMMON=(--model "$MODEL" --max-model-len 2048 --lengths trace --workload-seed 0)
# The SLOs: 3x and 8x the batch-32 decode step, measured once (`bench capacity` prints it; 121 ms here on
# 2026-12-01 05:33 UTC) and given explicitly, so that both SLOs and every variant use the same figure.
DECODE_STEP_MS=${DECODE_STEP_MS:-121}
CAPACITY=(--trace-scale 0.125 --num-requests 40 --qps 1 --granularity 0.3 --max-trials 4 --trial-seconds 15)
for step in $STEPS; do
  case $step in
    capacity)
      for scale in 3 8; do
        slo_ms=$((scale * DECODE_STEP_MS)); slo_s=$(python -c "print($slo_ms / 1000)")
        for chunk in 64 128 256 512; do
          python -m minisarathi bench capacity "${COMMON[@]}" "${CAPACITY[@]}" --slo-tbt "$slo_s" \
              --chunk-size "$chunk" --out "$OUT/capacity-${scale}x/sarathi-$chunk"
        done
        python -m minisarathi bench capacity "${COMMON[@]}" "${CAPACITY[@]}" --slo-tbt "$slo_s" \
            --scheduler vllm --out "$OUT/capacity-${scale}x/vllm"
        python -m minisarathi bench capacity "${COMMON[@]}" "${CAPACITY[@]}" --slo-tbt "$slo_s" \
            --tbt-slo-ms "$slo_ms" --chunk-size 8192 --out "$OUT/capacity-${scale}x/sarathi-slo"
      done ;;
    hol)
      HOL=(--trace-scale 0.0625 --long-fraction 0.05 --long-factor 16 --num-requests 80 --qps 2 --chunk-size 256)
      python -m minisarathi bench run "${COMMON[@]}" "${HOL[@]}" --label fcfs --out "$OUT/hol"
      python -m minisarathi bench run "${COMMON[@]}" "${HOL[@]}" --label fair --max-partial-prefills 2 \
          --long-prefill-threshold 256 --out "$OUT/hol" ;;
    priority)
      python -m minisarathi bench run "${COMMON[@]}" --trace-scale 0.125 --num-requests 80 --qps 4 \
          --chunk-size 256 --high-priority-fraction 0.2 --priority-aging-s 60 --label priority \
          --time-limit 240 --out "$OUT/priority" ;;
    timeline)
      python -m bench.slo_timeline --model "$MODEL" --out "$OUT/timeline" --plots docs/plots ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
