"""What converting one quantized linear costs at load (minisarathi/quant/hf_quantized.py), per format.

    python -m bench.hf_quantized_load                  # Llama-3-8B's gate_proj, 14336 x 4096
    python -m bench.hf_quantized_load --shape 2048 2048

Random words of each format's shapes (their values do not change the work); process CPU time, best and
worst of --repeats, and nanoseconds per weight at the best.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from minisarathi.quant import hf_quantized as hq

GROUP = 128
CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
    "gptq-4": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True},
    "gptq-8": {"quant_method": "gptq", "bits": 8, "group_size": GROUP, "sym": True},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
}


def converter(fmt: str, N: int, K: int, rng: np.random.Generator):
    """A call converting one random [N, K] linear of format `fmt`."""
    scheme = hq.read_scheme(CONFIGS[fmt])
    scales = rng.uniform(1e-3, 2e-3, (K // GROUP, N)).astype(np.float16).astype(np.float32)
    if fmt == "fp8":
        weight = rng.integers(0, 0x7F, (N, K), dtype=np.uint8)
        return lambda: hq.fp8_layout("w", weight, np.ones((N, 1), np.float32))
    if fmt == "awq":
        qweight = rng.integers(0, 2**32, (K, N // 8), dtype=np.uint32)
        qzeros = rng.integers(0, 2**32, (K // GROUP, N // 8), dtype=np.uint32)
        return lambda: hq.awq_layout("w", qweight, qzeros, scales, scheme)
    per = 32 // scheme.bits
    qweight = rng.integers(0, 2**32, (K // per, N), dtype=np.uint32)
    qzeros = np.full((K // GROUP, N // per), 0x77777777 if scheme.bits == 4 else 0x7F7F7F7F, np.uint32)
    return lambda: hq.gptq_layout("w", qweight, qzeros, scales, None, scheme, True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=2, default=[14336, 4096], metavar=("N", "K"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    N, K = args.shape
    rng = np.random.default_rng(0)
    print(f"[{N}, {K}] ({N * K / 1e6:.1f}M weights), process CPU time")
    print("| format | best s | worst s | ns per weight |")
    print("| --- | ---: | ---: | ---: |")
    for fmt in CONFIGS:
        run, times = converter(fmt, N, K, rng), []
        for _ in range(args.repeats):
            start = time.process_time()
            run()
            times.append(time.process_time() - start)
        print(f"| {fmt} | {min(times):.3f} | {max(times):.3f} | {min(times) / (N * K) * 1e9:.2f} |")


if __name__ == "__main__":
    main()
