"""(g) Bad input: a ValueError naming the setting and the numbers, raised before any collective;
a bad configuration on one rank does not hang the others."""

import pytest
import torch

from megatron_tsp.core import rejections, validation, zigzag
from tests import checks_validation


def _not_divisible(flag, value, what, d=4):
    return (
        f"{flag}={value} is not divisible by --tensor-sequence-parallel-size={d}: TSP shards "
        f"{what} over the group, so {flag} % {d} must be 0"
    )


def _neither_multiple_nor_divisor(value, d=4):
    return (
        f"--num-query-groups={value} is not divisible by --tensor-sequence-parallel-size={d} and "
        f"does not divide it: TSP shards key/value head groups over the group, or gives each of "
        f"them to --tensor-sequence-parallel-size / --num-query-groups ranks when there are "
        f"fewer (megatron-core's TP layout), so --num-query-groups % {d} or {d} % "
        f"--num-query-groups must be 0"
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(num_attention_heads=6),
            _not_divisible("--num-attention-heads", 6, "attention heads"),
        ),
        (
            dict(num_attention_heads=12, num_query_groups=6),
            _neither_multiple_nor_divisor(6),
        ),
        (
            dict(num_attention_heads=8, ffn_hidden_size=66),
            _not_divisible("--ffn-hidden-size", 66, "the MLP's intermediate dimension"),
        ),
        (
            dict(num_attention_heads=8, vocab_size=50257),
            _not_divisible(
                "--vocab-size (padded)", 50257, "the vocabulary (embedding and output layer)"
            ),
        ),
        (
            dict(num_attention_heads=8, seq_length=4100),
            "--seq-length=4100 must be divisible by 2 x tensor-sequence-parallel size = 8 (zigzag "
            "partition into 2D chunks)",
        ),
        (
            dict(num_attention_heads=12, num_query_groups=3),
            _neither_multiple_nor_divisor(3),
        ),
        (
            # fewer K/V heads than D with head dim 1: (4 + 2) QKV rows cannot be cut into 4
            dict(num_attention_heads=4, num_query_groups=1, hidden_size=4),
            "--num-query-groups=1 < --tensor-sequence-parallel-size=4: the fused QKV "
            "projection's 6 output rows ((heads + 2 x groups) x head dim) are not divisible by 4",
        ),
        (
            dict(num_attention_heads=8, num_query_groups=8, hidden_size=68),
            "--hidden-size=68 is not divisible by --num-attention-heads=8",
        ),
    ],
)
def test_model_shape_errors_name_flag_and_numbers(kwargs, message):
    with pytest.raises(ValueError) as info:
        validation.check_model_shape(4, **kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize("d,groups", [(4, 4), (4, 8), (4, 2), (4, 1), (2, 1), (8, 2)])
def test_model_shape_accepts_groups_multiple_or_divisor_of_d(d, groups):
    """Fewer K/V heads than D is megatron-core's TP layout (K/V heads shared by D / groups ranks):
    accepted, like a multiple of D."""
    validation.check_model_shape(d, num_attention_heads=16, num_query_groups=groups, hidden_size=64)


def test_model_shape_accepts_hidden_not_a_multiple_of_heads_with_kv_channels():
    """With --kv-channels the head dimension is given, so hidden need not be a multiple of the
    heads (Megatron-LM asserts it only without the flag; TSP never divides hidden by the heads:
    tests/test_gpt.py::test_kv_channels_not_hidden_over_heads runs hidden 36, 8 heads)."""
    validation.check_model_shape(
        4, num_attention_heads=8, num_query_groups=8, hidden_size=68, kv_channels=16
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(world_size=12, tensor_sequence_parallel_size=8),
            "world size 12 is not divisible by --tensor-sequence-parallel-size=8 x "
            "--pipeline-model-parallel-size=1 = 8",
        ),
        (
            dict(world_size=16, tensor_sequence_parallel_size=4, pipeline_model_parallel_size=3),
            "world size 16 is not divisible by --tensor-sequence-parallel-size=4 x "
            "--pipeline-model-parallel-size=3 = 12",
        ),
        (
            dict(world_size=16, tensor_sequence_parallel_size=4, tensor_model_parallel_size=2),
            "--tensor-model-parallel-size=2 cannot be combined with "
            "--tensor-sequence-parallel-size=4: TSP already uses the tensor-parallel ranks as "
            "its folded axis; leave "
            "--tensor-model-parallel-size at 1 (or equal to D)",
        ),
        (  # TSP x CP: the D*C sequence group times the pipeline must divide the world
            dict(world_size=12, tensor_sequence_parallel_size=4, context_parallel_size=2),
            "world size 12 is not divisible by --tensor-sequence-parallel-size=4 x "
            "--context-parallel-size=2 x --pipeline-model-parallel-size=1 = 8",
        ),
        (
            dict(world_size=16, tensor_sequence_parallel_size=4, context_parallel_size=0),
            "--context-parallel-size must be a positive integer, got 0",
        ),
        (
            dict(world_size=8, tensor_sequence_parallel_size=0),
            "--tensor-sequence-parallel-size must be a positive integer, got 0",
        ),
    ],
)
def test_parallel_layout_errors(kwargs, message):
    with pytest.raises(ValueError) as info:
        validation.check_parallel_layout(**kwargs)
    assert str(info.value) == message


def test_layout_accepts_good_configs():
    validation.check_parallel_layout(16, 8, 2)
    validation.check_parallel_layout(8, 8, 1, tensor_model_parallel_size=8)
    validation.check_parallel_layout(16, 4, 2, context_parallel_size=2)  # TSP x CP (core API)
    validation.check_model_shape(8, 32, 8, 14336, 128256, 131072, 4096)


def test_zigzag_batch_rejects_bad_sequence():
    batch = {"tokens": torch.zeros(2, 20, dtype=torch.long)}
    with pytest.raises(ValueError) as info:
        zigzag.get_batch_on_this_tsp_rank(batch, group_size=4)
    assert str(info.value) == (
        "--seq-length=20 must be divisible by 2 x tensor-sequence-parallel "
        "size = 8 (zigzag partition into 2D chunks)"
    )


def test_one_bad_rank_does_not_hang(pool4):
    """Rank 0 asks for D=3 (4 ranks: not divisible), the others for D=2."""
    errors = pool4.run(checks_validation.init_with_per_rank_sizes, [3, 2, 2, 2], timeout=120)
    own = (
        "world size 4 is not divisible by --tensor-sequence-parallel-size=3 x "
        "--pipeline-model-parallel-size=1 = 3"
    )
    assert errors[0] == own
    for err in errors[1:]:
        assert err == f"rank 0 rejected the TSP configuration: {own}"


def test_ranks_disagreeing_on_d_fail_together(pool4):
    errors = pool4.run(checks_validation.init_with_per_rank_sizes, [2, 2, 4, 4], timeout=120)
    expected = (
        "ranks disagree on the parallel configuration (tensor_sequence_parallel_size, "
        "pipeline, tp, cp): [(2, 1, 1, 1), (4, 1, 1, 1)]"
    )
    assert errors == [expected] * 4


def test_tsp_with_tp_or_cp_fails_on_all_ranks(pool4):
    errors = pool4.run(
        checks_validation.init_with_per_rank_sizes,
        [2] * 4,
        tensor_model_parallel_size=4,
        timeout=120,
    )
    assert (
        errors
        == [
            "--tensor-model-parallel-size=4 cannot be combined with "
            "--tensor-sequence-parallel-size=2: TSP already uses the tensor-parallel ranks as "
            "its folded axis; leave "
            "--tensor-model-parallel-size at 1 (or equal to D)"
        ]
        * 4
    )
    # TSP x CP is accepted by the core API; a world the D*C*PP groups do not divide is not
    errors = pool4.run(
        checks_validation.init_with_per_rank_sizes, [2] * 4, context_parallel_size=2, timeout=120
    )
    assert errors == [None] * 4
    errors = pool4.run(
        checks_validation.init_with_per_rank_sizes,
        [2] * 4,
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        timeout=120,
    )
    assert (
        errors
        == [
            "world size 4 is not divisible by --tensor-sequence-parallel-size=2 x "
            "--context-parallel-size=2 x --pipeline-model-parallel-size=2 = 8"
        ]
        * 4
    )


def test_layers_reject_unshardable_shapes(pool4):
    expected = {
        "heads": _not_divisible("--num-attention-heads", 6, "attention heads"),
        "groups": _neither_multiple_nor_divisor(3),
        "ffn": _not_divisible("--ffn-hidden-size", 66, "the MLP's intermediate dimension"),
        "local_seq": (
            "TSP attention got 3 local tokens: the sequence length (12) must be "
            "divisible by 2 x tensor-sequence-parallel size = 8 (zigzag chunks); pass "
            "batches through get_batch_on_this_tsp_rank"
        ),
        "vocab": _not_divisible(
            "--vocab-size (padded)", 130, "the vocabulary (embedding and output layer)"
        ),
        "seq": (
            "--seq-length=36 must be divisible by 2 x tensor-sequence-parallel size = 8 "
            "(zigzag partition into 2D chunks)"
        ),
    }
    # settings of the rejection table that reach the layers directly
    for key, dest, value in (
        ("qk_layernorm", "qk_layernorm", True),
        ("softmax", "softmax_type", "learnable"),
        ("window", "window_size", (16, 0)),
    ):
        expected[key] = rejections.row_for(dest).message(value, 4, config_value=True)
    for errors in pool4.run(checks_validation.layer_errors, 4, timeout=120):
        assert errors == expected
