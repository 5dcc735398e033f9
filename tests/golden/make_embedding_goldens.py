"""Goldens of last-token embeddings for tests/golden/qwen3_yarn_tied (made by make_goldens.py): Qwen3-
Embedding's pooling, the base model's last hidden state (after the final norm) at each prompt's last token,
L2-normalised, in float32 from transformers.

    /work/venv-golden/bin/python tests/golden/make_embedding_goldens.py

Writes tests/golden/qwen3_yarn_tied/embeddings.npz: prompt_<i> (int32 token ids, lengths 1 to past the
YaRN original context of 16), embedding_<i> (float32[hidden]), and the versions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModel

FOLDER = Path(__file__).resolve().parent / "qwen3_yarn_tied"
LENGTHS = (1, 7, 19, 40)

if __name__ == "__main__":
    model = AutoModel.from_pretrained(FOLDER, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(27)
    arrays = {}
    for i, length in enumerate(LENGTHS):
        prompt = torch.randint(3, model.config.vocab_size, (length,), generator=generator)
        with torch.no_grad():
            last = model(prompt[None]).last_hidden_state[0, -1]  # float32[hidden]
        arrays[f"prompt_{i}"] = prompt.numpy().astype(np.int32)
        arrays[f"embedding_{i}"] = torch.nn.functional.normalize(last, dim=-1).numpy()
    np.savez_compressed(
        FOLDER / "embeddings.npz",
        **arrays,
        transformers_version=transformers.__version__,
        torch_version=torch.__version__,
    )
    print(f"{len(LENGTHS)} embeddings of {model.config.hidden_size} features written")
