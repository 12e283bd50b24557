"""Next-token selection: greedy, temperature, top-k, top-p (nucleus)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` (default) or ``top_k == 1`` is greedy decoding.

    ``top_k``: keep the k most likely tokens (0 = all); ``top_p``: keep the smallest set of most
    likely tokens whose probability reaches top_p (1.0 = all); ``seed`` seeds the sampler (the same
    on every rank; rank 0 of the group samples and broadcasts the token).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def validate(self, vocab_size: int) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature={t!r}: must be a finite number >= 0 (0 = greedy)")
        if (
            not isinstance(self.top_k, int)
            or isinstance(self.top_k, bool)
            or not (0 <= self.top_k <= vocab_size)
        ):
            raise ValueError(
                f"top_k={self.top_k!r}: must be an integer in [0, vocab size "
                f"{vocab_size}] (0 = no top-k filter)"
            )
        p = self.top_p
        if not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p={p!r}: must be in (0, 1] (1 = no nucleus filter)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits with everything outside the top-k / top-p set at -inf ([b, V], any float dtype)."""
    logits = logits.clone()
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits.masked_fill_(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first is kept)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits.masked_fill_(drop, float("-inf"))
    return logits


def select_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> torch.Tensor:
    """Next token per row of ``logits`` [b, V] -> [b] (int64)."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    scaled = (
        filter_logits(
            logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits,
            params.top_k,
            params.top_p,
        )
        / params.temperature
    )
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
