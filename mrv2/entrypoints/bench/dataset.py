"""The `random` dataset: prompts of random token ids, the same for the same seed."""

from __future__ import annotations

import numpy as np

# Low ids are special tokens (bos/eos/pad) in mrv2's tokenizers and most real ones.
FIRST_ID = 10


def random_token_prompts(num_prompts: int, input_len: int, vocab_size: int,
                         seed: int = 0) -> list[list[int]]:
    """`num_prompts` lists of `input_len` ids drawn uniformly from [FIRST_ID, vocab_size)."""
    if num_prompts < 1 or input_len < 1:
        raise ValueError(f"num_prompts and input_len must be >= 1, got {num_prompts}, "
                         f"{input_len}")
    low = FIRST_ID if vocab_size > FIRST_ID else 0
    rng = np.random.default_rng(seed)
    return rng.integers(low, vocab_size, (num_prompts, input_len)).tolist()
