"""(g) Bad input: a ValueError naming the setting and the numbers, raised before any collective;
a bad configuration on one rank does not hang the others."""

import pytest
import torch

from megatron_tsp import validation, zigzag
from tests import checks_validation


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(num_attention_heads=6), "--num-attention-heads=6"),
        (dict(num_attention_heads=8, num_query_groups=2), "--num-query-groups=2"),
        (dict(num_attention_heads=8, ffn_hidden_size=66), "--ffn-hidden-size=66"),
        (dict(num_attention_heads=8, vocab_size=50257), "--vocab-size (padded)=50257"),
        (dict(num_attention_heads=8, seq_length=4100), "--seq-length=4100"),
        (dict(num_attention_heads=8, num_query_groups=3), "--num-query-groups=3"),
    ],
)
def test_model_shape_errors_name_flag_and_numbers(kwargs, needle):
    with pytest.raises(ValueError) as info:
        validation.check_model_shape(4, **kwargs)
    assert needle in str(info.value)
    assert "4" in str(info.value)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(world_size=12, tensor_sequence_parallel_size=8), "world size 12"),
        (dict(world_size=16, tensor_sequence_parallel_size=4, pipeline_model_parallel_size=3),
         "--pipeline-model-parallel-size=3"),
        (dict(world_size=16, tensor_sequence_parallel_size=4, tensor_model_parallel_size=2),
         "--tensor-model-parallel-size=2"),
        (dict(world_size=16, tensor_sequence_parallel_size=4, context_parallel_size=2),
         "--context-parallel-size=2"),
        (dict(world_size=8, tensor_sequence_parallel_size=0), "positive"),
    ],
)
def test_parallel_layout_errors(kwargs, needle):
    with pytest.raises(ValueError) as info:
        validation.check_parallel_layout(**kwargs)
    assert needle in str(info.value)


def test_layout_accepts_good_configs():
    validation.check_parallel_layout(16, 8, 2)
    validation.check_parallel_layout(8, 8, 1, tensor_model_parallel_size=8)
    validation.check_model_shape(8, 32, 8, 14336, 128256, 131072, 4096)


def test_zigzag_batch_rejects_bad_sequence():
    batch = {"tokens": torch.zeros(2, 20, dtype=torch.long)}
    with pytest.raises(ValueError, match="must be divisible by 2 x tensor-sequence-parallel"):
        zigzag.get_batch_on_this_tsp_rank(batch, group_size=4)


def test_one_bad_rank_does_not_hang(pool4):
    """Rank 0 asks for D=3 (4 ranks: not divisible), the others for D=2."""
    errors = pool4.run(checks_validation.init_with_per_rank_sizes, [3, 2, 2, 2], timeout=120)
    assert "world size 4 is not divisible" in errors[0]
    for err in errors[1:]:
        assert err and "rank 0 rejected" in err


def test_ranks_disagreeing_on_d_fail_together(pool4):
    errors = pool4.run(checks_validation.init_with_per_rank_sizes, [2, 2, 4, 4], timeout=120)
    assert all(e and "disagree" in e for e in errors), errors


def test_tsp_with_tp_or_cp_fails_on_all_ranks(pool4):
    errors = pool4.run(checks_validation.init_with_per_rank_sizes, [2] * 4,
                       tensor_model_parallel_size=4, timeout=120)
    assert all("--tensor-model-parallel-size=4" in e for e in errors)
    errors = pool4.run(checks_validation.init_with_per_rank_sizes, [2] * 4,
                       context_parallel_size=2, timeout=120)
    assert all("--context-parallel-size=2" in e for e in errors)


def test_layers_reject_unshardable_shapes(pool4):
    for errors in pool4.run(checks_validation.layer_errors, 4, timeout=120):
        assert "--num-attention-heads=6" in errors["heads"]
        assert "--num-query-groups=2" in errors["groups"]
        assert "--ffn-hidden-size=66" in errors["ffn"]
        assert "3 local tokens" in errors["local_seq"]
        assert "--vocab-size (padded)=130" in errors["vocab"]
        assert "--seq-length=36" in errors["seq"]
        assert errors["qk_layernorm"].startswith(
            "--qk-layernorm (TransformerConfig.qk_layernorm=True) cannot be combined with "
            "--tensor-sequence-parallel-size=4")
        assert errors["softmax"].startswith("--softmax-type=learnable (TransformerConfig."
                                            "softmax_type='learnable') cannot be combined")
        assert errors["window"].startswith("--window-size=16 0 (TransformerConfig.window_size")
        assert errors["moe"].startswith("--num-experts=4 (TransformerConfig.num_moe_experts=4) "
                                        "cannot be combined with --tensor-sequence-parallel-size=4")
