"""(b) whole GPTModel under TSP vs single-process stock GPTModel; (c) vs Megatron TP=D+SP;
(d) state-dict interop with Megatron TP=D both ways."""

import pytest

from tests import checks_gpt

DS = [1, 2, 4]


def _worst(results):
    return max(max(r.values()) for r in results)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("d", DS)
def test_gpt_matches_single_process_fp64(pool4, seed, d, style):
    """Exact loss path (vocab-gathered logits, fp64 cross-entropy), partial loss mask."""
    results = pool4.run(checks_gpt.check_gpt_vs_single, d, seed, style)
    assert _worst(results) <= 1e-10, results[0]


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("d", [2, 4])
def test_gpt_megatron_loss_path_fp32(pool4, seed, d, style):
    """Megatron's own vocab-parallel cross-entropy and loss normalisation, fp32."""
    results = pool4.run(checks_gpt.check_gpt_vs_single, d, seed, style, dtype_name="float32",
                        loss_path="megatron")
    assert _worst(results) <= 1e-5, results[0]


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("d", [2, 4])
def test_tsp_equals_megatron_tp_sp(pool4, seed, d, style):
    results = pool4.run(checks_gpt.check_tsp_vs_tp_sp, d, seed, style)
    assert _worst(results) <= 1e-10, results[0]
    results = pool4.run(checks_gpt.check_tsp_vs_tp_sp, d, seed, style, dtype_name="float32",
                        loss_path="megatron")
    assert _worst(results) <= 1e-5, results[0]
