"""HF transformers' offline `generate` on a static batch: the HF column of bench/peers.py.

    python bench/hf_offline.py MODEL_DIR PROMPTS_JSON THREADS NEW_TOKENS

Runs in any Python with torch and transformers (minisarathi is not imported). The prompts (a JSON list of
equal-length token-id lists) run as one batch, greedy, exactly NEW_TOKENS new tokens each, float32, after
a short warm-up; prints one JSON line: output tokens per second and per CPU-second of this process.
"""

import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main():
    model_dir, prompts_path, threads, new_tokens = (
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
    )
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(json.load(open(prompts_path)), dtype=torch.long)  # [B, P]
    greedy = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        model.generate(
            ids[:2],
            max_new_tokens=4,
            min_new_tokens=4,
            **{**greedy, "attention_mask": greedy["attention_mask"][:2]},
        )
        start, cpu = time.perf_counter(), time.process_time()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **greedy)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    print(
        json.dumps(
            {
                "output_tok_s": round(tokens / elapsed, 1),
                "output_tok_per_cpu_s": round(tokens / cpu, 1),
                "tokens": int(tokens),
            }
        )
    )


if __name__ == "__main__":
    main()
