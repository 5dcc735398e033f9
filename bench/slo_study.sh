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
#   table                      prints the capacity tables from the capacity step's results
#   repeat                     3x again for sarathi-64 and sarathi-slo (run-to-run noise), and sarathi-slo
#                              with a 250 ms target under the 363 ms SLO
# Usage: bench/slo_study.sh [step ...] (default: all). Run it niced on a shared machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export OPENBLAS_NUM_THREADS=1   # see bench/study.sh
MODEL=${MODEL:-/tmp/minisarathi-study-model}
OUT=${OUT:-bench/out/slo-study}
STEPS=${*:-capacity table repeat hol priority timeline}
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
    repeat)   # run-to-run noise at 3x, and the SLO-driven mode with a target below the SLO
      slo_ms=$((3 * DECODE_STEP_MS)); slo_s=$(python -c "print($slo_ms / 1000)")
      python -m minisarathi bench capacity "${COMMON[@]}" "${CAPACITY[@]}" --slo-tbt "$slo_s" --chunk-size 64 \
          --out "$OUT/repeat-3x/sarathi-64"
      python -m minisarathi bench capacity "${COMMON[@]}" "${CAPACITY[@]}" --slo-tbt "$slo_s" \
          --tbt-slo-ms "$slo_ms" --chunk-size 8192 --out "$OUT/repeat-3x/sarathi-slo"
      python -m minisarathi bench capacity "${COMMON[@]}" "${CAPACITY[@]}" --slo-tbt "$slo_s" \
          --tbt-slo-ms 250 --chunk-size 8192 --out "$OUT/repeat-3x/sarathi-slo-250" ;;
    hol)
      HOL=(--trace-scale 0.0625 --long-fraction 0.05 --long-factor 16 --num-requests 100 --qps 1 --chunk-size 256)
      python -m minisarathi bench run "${COMMON[@]}" "${HOL[@]}" --label fcfs --out "$OUT/hol"
      python -m minisarathi bench run "${COMMON[@]}" "${HOL[@]}" --label fair --max-partial-prefills 2 \
          --long-prefill-threshold 256 --out "$OUT/hol" ;;
    priority)
      python -m minisarathi bench run "${COMMON[@]}" --trace-scale 0.125 --num-requests 80 --qps 4 \
          --chunk-size 256 --high-priority-fraction 0.2 --priority-aging-s 60 --label priority \
          --time-limit 240 --out "$OUT/priority" ;;
    timeline)
      python -m bench.slo_timeline --model "$MODEL" --out "$OUT/timeline" --plots docs/plots ;;
    table)   # the capacity tables of docs/benchmarks.md from the capacity step's results
      python - "$OUT" <<'PY'
import json, pathlib, sys
for folder in sorted(pathlib.Path(sys.argv[1]).glob("capacity-*x")):
    print(folder.name, "  (trail: qps tried, ! = failed)")
    for variant in ("sarathi-64", "sarathi-128", "sarathi-256", "sarathi-512", "vllm", "sarathi-slo"):
        path = folder / variant / "capacity.json"
        if path.exists():
            data = json.loads(path.read_text())
            trail = " ".join(f"{t['qps']:g}{'' if t['passed'] else '!'}" for t in data["trail"])
            tbt = max((t["p99_tbt"] or 0 for t in data["trail"] if t["passed"]), default=None)
            print(f"  {variant:<13} {data['capacity_qps']:6.2f} qps   worst passing P99 TBT "
                  f"{'-' if tbt is None else f'{tbt * 1e3:.0f} ms':>7}   {trail}")
PY
      ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
