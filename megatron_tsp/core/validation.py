"""Configuration checks for TSP, raised as ``ValueError`` naming the flag and the numbers.

Every rule on a single setting (MoE, CP, qk-layernorm, heads / groups / FFN / vocabulary divisible
by D, ...) is a row of ``rejections``; this module applies them and adds the arithmetic between
settings (sequence into 2D chunks, world size, hidden size over heads).

Everything here is pure (no collectives), so it can run before any process group exists.
"""

from __future__ import annotations

from typing import Optional

from megatron_tsp.core import rejections
from megatron_tsp.core.layout import check_sequence_length
from megatron_tsp.core.rejections import TSP_FLAG


def check_parallel_layout(
    world_size: int,
    tensor_sequence_parallel_size: int,
    pipeline_model_parallel_size: int = 1,
    tensor_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> None:
    d = tensor_sequence_parallel_size
    if not isinstance(d, int) or d < 1:
        raise ValueError(f"{TSP_FLAG} must be a positive integer, got {d!r}")
    rejections.check_values(
        {"tensor_model_parallel_size": tensor_model_parallel_size},
        d,
        config_value=False,
    )  # command-line values, not a config
    # TSP x CP: the core API accepts context_parallel_size C (the sequence group is the D*C
    # tensor-and-context-parallel group, see core/layout.py); the launcher still refuses it.
    if not isinstance(context_parallel_size, int) or context_parallel_size < 1:
        raise ValueError(
            f"--context-parallel-size must be a positive integer, got {context_parallel_size!r}"
        )
    if pipeline_model_parallel_size < 1:
        raise ValueError(
            f"--pipeline-model-parallel-size must be >= 1, got {pipeline_model_parallel_size}"
        )
    model_parallel = d * context_parallel_size * pipeline_model_parallel_size
    if world_size % model_parallel != 0:
        cp = f"--context-parallel-size={context_parallel_size} x "
        cp = cp if context_parallel_size > 1 else ""
        raise ValueError(
            f"world size {world_size} is not divisible by {TSP_FLAG}={d} x {cp}"
            f"--pipeline-model-parallel-size={pipeline_model_parallel_size} = {model_parallel}"
        )


def check_model_shape(
    tensor_sequence_parallel_size: int,
    num_attention_heads: int,
    num_query_groups: Optional[int] = None,
    ffn_hidden_size: Optional[int] = None,
    vocab_size: Optional[int] = None,
    seq_length: Optional[int] = None,
    hidden_size: Optional[int] = None,
    kv_channels: Optional[int] = None,
) -> None:
    """``kv_channels``: the head dimension when it is not hidden / heads (``--kv-channels``)."""
    d = tensor_sequence_parallel_size
    rejections.check_divisible(
        d, num_attention_heads=num_attention_heads, num_query_groups=num_query_groups
    )
    if num_query_groups is not None and num_attention_heads % num_query_groups != 0:
        raise ValueError(
            f"--num-attention-heads={num_attention_heads} is not divisible by "
            f"--num-query-groups={num_query_groups}"
        )
    rejections.check_divisible(d, ffn_hidden_size=ffn_hidden_size, padded_vocab_size=vocab_size)
    if kv_channels is None and hidden_size is not None and hidden_size % num_attention_heads != 0:
        # only where the head dimension is derived from them (Megatron-LM asserts the same)
        raise ValueError(
            f"--hidden-size={hidden_size} is not divisible by "
            f"--num-attention-heads={num_attention_heads}"
        )
    head_dim = kv_channels or (hidden_size // num_attention_heads if hidden_size else None)
    if head_dim is not None and num_query_groups is not None and num_query_groups < d:
        # fewer K/V heads than ranks: the fused QKV output [(np + 2 ng) x head dim] is cut into D
        # row shards, D / ng per group block (megatron-core's ColumnParallelLinear divides it)
        qkv = (num_attention_heads + 2 * num_query_groups) * head_dim
        if qkv % d != 0:
            raise ValueError(
                f"--num-query-groups={num_query_groups} < {TSP_FLAG}={d}: the fused QKV "
                f"projection's {qkv} output rows ((heads + 2 x groups) x head dim) are not "
                f"divisible by {d}"
            )
    if seq_length is not None:
        check_sequence_length(seq_length, d)


MOE_RING_FLAG = "--tsp-moe-ring"


def check_expert_layout(
    num_experts: Optional[int],
    expert_tensor_parallel_size,
    d: int,
    expert_model_parallel_size: Optional[int] = None,
    moe_ring: bool = False,
) -> None:
    """The expert layout of MoE under TSP, per schedule (docs/moe.md).

    Experts folded onto the TSP axis (default): every expert whole on one rank, expert-tensor-
    parallel size 1. A ``TransformerConfig`` (and Megatron-LM after ``validate_args``) defaults the
    expert-tensor-parallel size to the tensor-parallel size D, so the ``--expert-tensor-parallel-
    size`` row of the table is checked here only for models with experts; the message is the
    row's.

    The TSP expert ring (``moe_ring``, ``--tsp-moe-ring``): every expert sharded over the D TSP
    ranks as megatron-core shards it for expert-tensor-parallel size D, expert-model-parallel size
    1; other sizes are refused naming the flag and the numbers (``None``: not given, the launcher
    fills in D and 1)."""
    if moe_ring:
        if not num_experts:
            raise rejections.TSPRejection(
                f"{MOE_RING_FLAG} runs the MoE layers' experts on the TSP weight ring; it "
                "needs --num-experts"
            )
        problems = []
        if expert_tensor_parallel_size not in (None, d):
            problems.append(
                f"--expert-tensor-parallel-size={expert_tensor_parallel_size} cannot be combined "
                f"with {MOE_RING_FLAG} and {TSP_FLAG}={d}: the expert ring shards every expert "
                f"over the {d} TSP ranks (expert-tensor-parallel size {d}; leave the flag out or "
                f"set it to {d})"
            )
        if expert_model_parallel_size not in (None, 1):
            problems.append(
                f"--expert-model-parallel-size={expert_model_parallel_size} cannot be combined "
                f"with {MOE_RING_FLAG} ({TSP_FLAG}={d}): every TSP rank holds 1/{d} of every "
                "expert, so the "
                "experts are not spread over ranks (expert-model-parallel size 1; without "
                f"{MOE_RING_FLAG} the experts are spread over the expert-model-parallel ranks)"
            )
        rejections.raise_if_any(problems)
        return
    if num_experts and expert_tensor_parallel_size not in (None, 1):
        row = rejections.row_for("expert_tensor_parallel_size")
        raise rejections.TSPRejection(row.message(expert_tensor_parallel_size, d))


def check_transformer_config(
    config, vocab_size: Optional[int] = None, seq_length: Optional[int] = None
) -> None:
    """Check a megatron-core ``TransformerConfig`` meant for TSP (``tensor_model_parallel_size``
    is the TSP group size)."""
    d = config.tensor_model_parallel_size
    if d > 1 and not config.sequence_parallel:
        raise ValueError(
            "TSP runs on the tensor-parallel ranks with sequence-parallel activations: "
            "set sequence_parallel=True (--sequence-parallel) in the TransformerConfig"
        )
    # context_parallel_size > 1 is TSP x CP, which the core layers run (hierarchical and hybrid
    # CP stay refused by their rows)
    rejections.check_config(config, d, overrides={"context_parallel_size": 1})
    check_expert_layout(
        config.num_moe_experts,
        config.expert_tensor_parallel_size,
        d,
        config.expert_model_parallel_size,
        moe_ring=bool(getattr(config, "tsp_moe_ring", False)),
    )
    check_model_shape(
        d,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        ffn_hidden_size=config.ffn_hidden_size,
        vocab_size=vocab_size,
        seq_length=seq_length,
        hidden_size=config.hidden_size,
        kv_channels=config.kv_channels,
    )
    cp = getattr(config, "context_parallel_size", 1) or 1
    if seq_length is not None and cp > 1:
        check_sequence_length(seq_length, d * cp)  # zigzag over the D*C sequence group


TSP_MLP_FLAG = rejections.MODE_FLAGS[rejections.TSP_MLP]


def check_tsp_mlp_config(config) -> None:
    """Check a ``TransformerConfig`` for the hybrid (TP+SP attention + TSP MLP, ``--tsp-mlp``).

    The TSP MLP ring runs over the tensor-parallel group on the sequence-parallel activations
    TP+SP already has; everything outside the MLP is Megatron's, so only the hybrid's rows of the
    rejection table are checked here (Megatron checks the rest)."""
    d = config.tensor_model_parallel_size
    if d > 1 and not config.sequence_parallel:
        raise ValueError(
            f"{TSP_MLP_FLAG} with --tensor-model-parallel-size={d} needs --sequence-parallel "
            "(sequence_parallel=True): the TSP MLP ring works on sequence-sharded activations"
        )
    rejections.check_config(config, d, mode=rejections.TSP_MLP)
