"""Helpers used inside ranks by the distributed checks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tsp import parallel_state as tsp_state

DTYPES = {"float64": torch.float64, "float32": torch.float32}
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


_current = None  # ("tsp" | "tp", size) of the groups alive in this process


def setup_tsp(d: int, seed: int = 1234) -> None:
    """Initialise the groups with TSP size d (re-initialising only if the layout changed)."""
    global _current
    if _current != ("tsp", d):
        tsp_state.destroy_model_parallel()
        tsp_state.initialize_model_parallel(tensor_sequence_parallel_size=d,
                                            create_gloo_process_groups=False)
        _current = ("tsp", d)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def setup_megatron_tp(tp: int, seed: int = 1234) -> None:
    """Plain Megatron groups with tensor-parallel size tp (no TSP)."""
    global _current
    from megatron.core import parallel_state as mpu

    if _current != ("tp", tp):
        tsp_state.destroy_model_parallel()
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp,
                                      create_gloo_process_groups=False)
        _current = ("tp", tp)
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
