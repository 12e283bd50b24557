"""Move parameters between full (single-device) and TP=D / TSP-D sharded form.

Sharding follows the attributes Megatron puts on every tensor-parallel parameter
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``), so it is the layout of a
TP=D checkpoint by construction: rank r holds chunks r, r+D, ... of the parameter cut into
D * stride pieces (stride 2 is the gated fc1, where rank r holds ``[gate_r; up_r]``). TSP-D and
TP=D + SP hold identical shards.

Megatron sets those attributes on a weight only while initialising it: a model built with
``perform_initialization=False`` (the natural choice when weights are loaded afterwards) has
unmarked Column/RowParallelLinear and vocab-parallel embedding weights. ``mark_tensor_parallel``
fills in the missing attributes from the module types (the layout those modules allocate), so
``build_tsp_gpt_model`` marks every model it builds and ``load_full_state`` / ``gather_full_state``
mark the model they are given.
"""

from __future__ import annotations

from typing import Dict, Iterable, Tuple

import torch
import torch.distributed as dist


def sharding_of(param: torch.Tensor) -> Tuple[bool, int, int]:
    """(is_sharded, dim, stride) for a parameter of a Megatron model."""
    if getattr(param, "tensor_model_parallel", False):
        return (
            True,
            int(getattr(param, "partition_dim", 0)),
            int(getattr(param, "partition_stride", 1)),
        )
    return False, 0, 1


def _module_sharding(module, attr: str, gated_fc1: bool):
    """(dim, stride) of ``module.<attr>`` from the Megatron module type, or None if not sharded."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    if isinstance(module, ColumnParallelLinear) and attr in ("weight", "bias"):
        # Megatron's MLP allocates a gated fc1 with stride 2 (rank r holds [gate_r; up_r]).
        return 0, 2 if gated_fc1 else 1
    if isinstance(module, RowParallelLinear) and attr == "weight":
        return 1, 1
    if isinstance(module, VocabParallelEmbedding) and attr == "weight":
        return 0, 1
    return None


def mark_tensor_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """Set ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` on every sharded
    parameter that Megatron left unmarked (``perform_initialization=False``). Parameters that
    already carry the attributes are left alone; returns ``model``."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for mod_name, module in model.named_modules():
        config = getattr(module, "config", None)
        gated_fc1 = mod_name.split(".")[-1] == "linear_fc1" and bool(
            getattr(config, "gated_linear_unit", False)
        )
        for attr, param in module.named_parameters(recurse=False):
            if hasattr(param, "tensor_model_parallel"):
                continue
            layout = _module_sharding(module, attr, gated_fc1)
            if layout is not None:
                set_tensor_model_parallel_attributes(param, True, *layout)
    return model


def shard(full: torch.Tensor, dim: int, stride: int, size: int, rank: int) -> torch.Tensor:
    chunks = full.chunk(size * stride, dim=dim)
    return torch.cat([chunks[rank + size * i] for i in range(stride)], dim=dim)


def unshard(parts: Iterable[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    pieces = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([pieces[r][i] for i in range(stride) for r in range(len(pieces))], dim=dim)


@torch.no_grad()
def load_full_state(model: torch.nn.Module, full: Dict[str, torch.Tensor], group) -> None:
    """Copy a full (TP=1) parameter dict into a TP/TSP-sharded model on this rank."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    mark_tensor_parallel(model)
    for name, param in model.named_parameters():
        sharded, dim, stride = sharding_of(param)
        value = full[name]
        if sharded:
            value = shard(value, dim, stride, size, rank)
        if value.shape != param.shape:
            how = (
                f"sharded along dim {dim} with stride {stride}"
                if sharded
                else "not marked as tensor-parallel (no tensor_model_parallel attribute)"
            )
            raise ValueError(
                f"{name}: the full (TP=1) tensor {tuple(full[name].shape)} gives "
                f"{tuple(value.shape)} on rank {rank} of D={size}, but the parameter is "
                f"{tuple(param.shape)}; it is "
                f"{how}. Check that the full state comes from the same architecture (TP=1), and "
                "that a custom sharded module sets Megatron's tensor_model_parallel / "
                "partition_dim / partition_stride attributes on its parameters (Megatron sets "
                "them only when perform_initialization=True; mark_tensor_parallel covers "
                "Megatron's own parallel layers)"
            )
        param.copy_(value)


@torch.no_grad()
def gather_full_state(
    model: torch.nn.Module, group, grads: bool = False
) -> Dict[str, torch.Tensor]:
    """All-gather every sharded parameter (or its gradient) into full TP=1 form on every rank."""
    size = dist.get_world_size(group)
    mark_tensor_parallel(model)
    out = {}
    for name, param in model.named_parameters():
        value = param.grad if grads else param.data
        if grads and value is None:
            value = getattr(param, "main_grad", None)
        if value is None:
            continue
        sharded, dim, stride = sharding_of(param)
        if sharded and size > 1:
            parts = [torch.empty_like(value) for _ in range(size)]
            dist.all_gather(parts, value.contiguous(), group=group)
            value = unshard(parts, dim, stride)
        out[name] = value.clone()
    return out


def allreduce_sequence_parallel_grads(model: torch.nn.Module, group) -> None:
    """Sum the gradients of replicated parameters (``sequence_parallel=True``) over the group —
    what Megatron's ``finalize_model_grads`` does under DDP, for training loops without DDP."""
    if dist.get_world_size(group) == 1:
        return
    grads = [
        p.grad
        for p in model.parameters()
        if getattr(p, "sequence_parallel", False) and p.grad is not None
    ]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
