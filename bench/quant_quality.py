"""What each quantized weight format does to a model's quality: perplexity on a fixed text, top-1
agreement and KL divergence against the unquantized model, teacher-forced over every position.

    python -m bench.quant_quality                          # models/stories260K, every format
    python -m bench.quant_quality MODEL --formats Q8_0,Q4_K --text story.txt

MODEL is a Hugging Face folder or a GGUF F32 file. Each format quantizes the float weights in NumPy
(minisarathi/quant/kquants.py: gguf.quants for Q8_0 and Q4_0, a min/max rule for the K-quants) and the
model runs them through the loader's layouts as a GGUF file's would be. The matrices are the linear
weights, the embedding table and an untied lm_head. A matrix whose rows are no whole number of blocks
(stories260K's rows of 64 and 172 for the K-quants' 256) is quantized over its flattened weights in runs
of a block ("flat": the format's numbers, in groups that cross rows, which no GGUF file holds); one whose
size is no whole number of blocks stays float32. The text defaults to the story in
models/stories260K/README.md. Prints one JSON line per format, then a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import re

import numpy as np

from minisarathi.backends.devices import make_backend
from minisarathi.config import ModelConfig
from minisarathi.model.llama import LlamaModel
from minisarathi.model.loader import CheckpointTensor, load_weights
from minisarathi.paths import default_model_dir
from minisarathi.quant.kquants import TYPES, quantize
from minisarathi.quant.layouts import BLOCKS, GgmlType, from_gguf
from minisarathi.testing import prefill_then_greedy
from minisarathi.tokenizer import Tokenizer

MATRICES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head")


def story() -> str:
    readme = (default_model_dir() / "README.md").read_text(encoding="utf-8")
    return re.search(r"```text\n(.*?)\n```", readme, re.S).group(1)


def quantized_weights(weights, qtype: str) -> tuple[dict, dict]:
    """(LlamaModel's weights with the matrices in qtype, counts: by rows / flat / float and the bits)."""
    kind = GgmlType[qtype]
    block, block_bytes = BLOCKS[kind]
    out, counts = {}, {"by_rows": 0, "flat": 0, "float": 0, "bits": 0.0, "weights": 0}
    for name in weights:
        tensor = weights[name]
        if not name.endswith(MATRICES):
            out[name] = tensor
            continue
        w = np.asarray(tensor, dtype=np.float32)  # float32[N, K]
        if w.shape[-1] % block == 0:
            out[name] = CheckpointTensor("quantized", from_gguf(name, kind, quantize(w, qtype)))
            counts["by_rows"] += 1
        elif w.size % block == 0:
            flat = from_gguf(name, kind, quantize(w.reshape(-1, block), qtype))
            out[name] = CheckpointTensor("float32", flat.dequantize().reshape(w.shape))
            counts["flat"] += 1
        else:
            out[name] = tensor
            counts["float"] += 1
        quantized = w.size % block == 0
        counts["bits"] += w.size * (8 * block_bytes / block if quantized else 32)
        counts["weights"] += w.size
    return out, counts


def logits(config, weights, ids, device: str) -> np.ndarray:
    """float32[P, V]: the logits at every position of `ids`."""
    return prefill_then_greedy(LlamaModel(config, weights, make_backend(device, "float32")), ids, 1)[0]


def quality(got: np.ndarray, want: np.ndarray, ids: list[int]) -> dict:
    """Perplexity of ids[1:] under `got`, and top-1 agreement and mean KL(want || got) over positions."""

    def log_softmax(x):  # float64[P, V]
        x = x.astype(np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    lg, lw = log_softmax(got), log_softmax(want)
    nll = -lg[np.arange(len(ids) - 1), ids[1:]].mean()
    return {
        "perplexity": round(float(np.exp(nll)), 4),
        "top1_agreement": round(float((got.argmax(-1) == want.argmax(-1)).mean()), 4),
        "mean_kl": float(f"{(np.exp(lw) * (lw - lg)).sum(-1).mean():.3g}"),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", nargs="?", default=str(default_model_dir()))
    parser.add_argument("--formats", default=",".join(TYPES), help=f"comma-separated, of {', '.join(TYPES)}")
    parser.add_argument("--text", help="a text file to score (default: the bundled model's story)")
    parser.add_argument("--device", default="reference", help="the backend the forwards run on")
    args = parser.parse_args(argv)
    formats = args.formats.split(",")
    unknown = [f for f in formats if f not in TYPES]
    if unknown:
        parser.error(f"unknown formats {', '.join(unknown)} (supported: {', '.join(TYPES)})")
    text = open(args.text, encoding="utf-8").read() if args.text else story()
    config = ModelConfig.from_pretrained(args.model)
    ids = Tokenizer.from_pretrained(args.model).encode(text)  # BOS first
    weights = load_weights(args.model, config)
    want = logits(config, weights, ids, args.device)
    common = {"model": args.model, "positions": len(ids), "device": args.device, "host": platform.node()}
    rows = [{**common, "format": "F32", "bits_per_weight": 32.0, **quality(want, want, ids)}]
    for qtype in formats:
        quantized, counts = quantized_weights(weights, qtype)
        row = {**common, "format": qtype, "bits_per_weight": round(counts["bits"] / counts["weights"], 3)}
        row.update({f"matrices_{k}": counts[k] for k in ("by_rows", "flat", "float")})
        rows.append({**row, **quality(logits(config, quantized, ids, args.device), want, ids)})
    for row in rows:
        print(json.dumps(row), flush=True)
    print(
        "\n| format | bits a weight | perplexity | top-1 agreement | mean KL | matrices: rows, flat, float |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        layout = ", ".join(str(r.get(f"matrices_{k}", "")) for k in ("by_rows", "flat", "float"))
        print(
            f"| {r['format']} | {r['bits_per_weight']} | {r['perplexity']} | {r['top1_agreement']} | "
            f"{r['mean_kl']} | {layout if 'matrices_flat' in r else ''} |"
        )
    return rows


if __name__ == "__main__":
    main()
