"""TSP prefill + Megatron TP=D decode (megatron_tsp.inference)."""

import pytest
import torch

from tests import checks_inference


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("d", [2, 4])
def test_generation_matches_single_process_fp64(pool4, seed, d, style):
    """Greedy tokens identical to a single-process model; KV cache after TSP prefill equals TP
    prefill's tensor for tensor; last-token logits equal TP's and the single model's; two-chunk
    prefill equals one-shot; mixed lengths; prompts shorter than 2D (TP fallback)."""
    results = pool4.run(checks_inference.check_generation, d, seed, style)
    worst = {k: max(r[k] for r in results) for k in results[0]}
    assert max(worst.values()) <= 1e-12, worst


def test_sampling_stop_tokens_and_errors(pool4, seed):
    results = pool4.run(checks_inference.check_sampling_and_errors, 2, seed)
    assert all(r["sampled"] == results[0]["sampled"] for r in results), "ranks disagree"
    for needle, message in results[0]["errors"].items():
        assert needle in message


def test_filter_logits_top_k_top_p(seed):
    from megatron_tsp.inference.sampling import filter_logits

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 50, generator=g, dtype=torch.float64)
    kept = torch.isfinite(filter_logits(logits, 5, 1.0))
    assert (kept.sum(-1) == 5).all()
    assert torch.equal(kept, torch.zeros_like(kept).scatter(-1, logits.topk(5).indices, True))
    probs = torch.softmax(logits, -1)
    nucleus = torch.isfinite(filter_logits(logits, 0, 0.5))
    for row in range(3):
        p = probs[row][nucleus[row]]
        assert p.sum() >= 0.5, f"seed {seed}"
        assert p.sum() - p.min() < 0.5, f"seed {seed}: nucleus is not minimal"
