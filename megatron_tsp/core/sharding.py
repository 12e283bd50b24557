"""Move parameters between full (single-device) and TP=D / TSP-D sharded form.

Sharding follows the attributes Megatron puts on every tensor-parallel parameter
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``), so it is the layout of a
TP=D checkpoint by construction: rank r holds chunks r, r+D, ... of the parameter cut into
D * stride pieces (stride 2 is the gated fc1, where rank r holds ``[gate_r; up_r]``). TSP-D and
TP=D + SP hold identical shards.
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
    for name, param in model.named_parameters():
        sharded, dim, stride = sharding_of(param)
        value = full[name]
        if sharded:
            value = shard(value, dim, stride, size, rank)
        if value.shape != param.shape:
            raise ValueError(
                f"{name}: full-state slice {tuple(value.shape)} does not match "
                f"parameter {tuple(param.shape)} (D={size})"
            )
        param.copy_(value)


@torch.no_grad()
def gather_full_state(
    model: torch.nn.Module, group, grads: bool = False
) -> Dict[str, torch.Tensor]:
    """All-gather every sharded parameter (or its gradient) into full TP=1 form on every rank."""
    size = dist.get_world_size(group)
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
