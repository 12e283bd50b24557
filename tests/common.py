"""Helpers used inside ranks by the distributed checks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tsp import parallel_state as tsp_state

DTYPES = {"float64": torch.float64, "float32": torch.float32}
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


_current = None  # tensor-parallel size of the groups alive in this process


def _ensure_groups(size: int) -> None:
    """Megatron groups with tensor-parallel size ``size`` (TSP-D uses the same groups as TP=D),
    re-created only when the size changes: group creation is the slow part of a check."""
    global _current
    if _current != size:
        tsp_state.destroy_model_parallel()
        tsp_state.initialize_model_parallel(tensor_sequence_parallel_size=size,
                                            create_gloo_process_groups=False)
        _current = size


def setup_tsp(d: int, seed: int = 1234) -> None:
    """Groups for TSP with group size d."""
    _ensure_groups(d)
    tsp_state._TSP_SIZE = d
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def setup_megatron_tp(tp: int, seed: int = 1234) -> None:
    """Plain Megatron groups with tensor-parallel size tp (TSP marked off)."""
    _ensure_groups(tp)
    tsp_state._TSP_SIZE = None
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def reset_groups() -> None:
    global _current
    tsp_state.destroy_model_parallel()
    _current = None


def make_config(d: int, dtype: torch.dtype, **overrides) -> TransformerConfig:
    fields = dict(
        num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        use_cpu_initialization=True, params_dtype=dtype, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=d, sequence_parallel=d > 1,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() / (scale if scale > 0 else 1.0)


def group_info():
    group = tsp_state.get_tensor_sequence_parallel_group()
    return group, dist.get_world_size(group), dist.get_rank(group)


def broadcast_seed(seed: int) -> None:
    torch.manual_seed(seed)


def thread_count() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


def reinit_cycles(n: int) -> int:
    """Re-initialise the groups n times through three layouts; return the thread count."""
    for _ in range(n):
        setup_tsp(2)
        setup_megatron_tp(1)
        setup_tsp(4)
    return thread_count()


def accessors_after_init(d: int) -> dict:
    """What the TSP accessors (and their copies on megatron.core.parallel_state) report."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    setup_tsp(d)
    group = tsp_state.get_tensor_sequence_parallel_group()
    return {
        "size": tsp_state.get_tensor_sequence_parallel_world_size(),
        "rank": tsp_state.get_tensor_sequence_parallel_rank(),
        "mpu_size": mpu.get_tensor_sequence_parallel_world_size(),
        "is_tsp": mpu.is_tensor_sequence_parallel(),
        "group_ranks": dist.get_process_group_ranks(group),
        "dp_size": mpu.get_data_parallel_world_size(),
    }
