"""A tiny generated corpus on which a small GPT's loss visibly falls (no downloads).

Character-level text from a seeded template grammar: short sentences over a fixed vocabulary of
words, so the next character is highly predictable once words are learned. Token ids are the
byte values, so the vocabulary is 128 (ASCII), which every D in {1, 2, 4, 8} divides.
"""

from __future__ import annotations

import random
from typing import Dict, Iterator

import torch

VOCAB_SIZE = 128
_SUBJECTS = ["the cat", "a dog", "my friend", "the teacher", "an old man", "the robot", "she", "he"]
_VERBS = ["sees", "likes", "builds", "paints", "reads", "finds", "carries", "follows"]
_OBJECTS = [
    "a red ball",
    "the big house",
    "two small birds",
    "the long river",
    "a green tree",
    "the new book",
    "a bright star",
    "the quiet garden",
]
_ENDINGS = [".", " today.", " again.", " at night.", " in the park."]


def generate_text(num_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    parts, total = [], 0
    while total < num_chars:
        sentence = " ".join([rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)])
        sentence = sentence + rng.choice(_ENDINGS) + " "
        parts.append(sentence)
        total += len(sentence)
    return "".join(parts)[:num_chars]


def batches(
    batch_size: int, seq_length: int, seed: int = 0, corpus_chars: int = 200_000
) -> Iterator[Dict[str, torch.Tensor]]:
    """Endless Megatron-style batches: tokens, labels (next char), loss_mask, position_ids."""
    data = torch.tensor(list(generate_text(corpus_chars, seed).encode("ascii")), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed + 1)
    while True:
        starts = torch.randint(0, len(data) - seq_length - 1, (batch_size,), generator=gen)
        window = torch.stack([data[s : s + seq_length + 1] for s in starts.tolist()])
        yield {
            "tokens": window[:, :-1].contiguous(),
            "labels": window[:, 1:].contiguous(),
            "loss_mask": torch.ones(batch_size, seq_length),
            "position_ids": torch.arange(seq_length).expand(batch_size, seq_length).contiguous(),
            "attention_mask": None,
        }
