"""Point-to-point and rooted collectives used by the TSP layers.

All functions take an explicit process group and use plain ``torch.distributed`` calls, so they
run unchanged on gloo (CPU tests), NCCL (GPU) and the ``fake`` backend (full-scale memory runs).
Weight shards travel as ONE flat buffer per message (``FlatShard``) so that a ring step or a
broadcast is a single transfer whatever the layer's parameter count.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist


class FlatShard:
    """Views of several tensors laid out back to back in one contiguous buffer."""

    def __init__(self, shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device,
                 buffer: Optional[torch.Tensor] = None):
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [s.numel() for s in self.shapes]
        total = sum(self.numels)
        self.buffer = buffer if buffer is not None else torch.empty(total, dtype=dtype, device=device)

    @classmethod
    def like(cls, other: "FlatShard") -> "FlatShard":
        return cls(other.shapes, other.buffer.dtype, other.buffer.device)

    @classmethod
    def pack(cls, tensors: Sequence[torch.Tensor]) -> "FlatShard":
        flat = cls([t.shape for t in tensors], tensors[0].dtype, tensors[0].device)
        for view, t in zip(flat.views(), tensors):
            view.copy_(t)
        return flat

    def views(self) -> List[torch.Tensor]:
        return [
            chunk.view(shape)
            for chunk, shape in zip(self.buffer.split(self.numels), self.shapes)
        ]

    def zero_(self) -> "FlatShard":
        self.buffer.zero_()
        return self


def weight_bias_views(views: Sequence[torch.Tensor], has_bias: bool):
    """(first weight, bias or None, second weight) from a shard packed as [w, (b), w2]."""
    return (views[0], views[1], views[2]) if has_bias else (views[0], None, views[1])


def ring_neighbours(group) -> tuple[int, int]:
    """Global ranks of the next (rank+1) and previous (rank-1) members of the group."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    return nxt, prv


def ring_exchange(send: torch.Tensor, recv: torch.Tensor, group) -> list:
    """Post ``send -> rank+1`` and ``recv <- rank-1`` together; returns the requests to wait on."""
    nxt, prv = ring_neighbours(group)
    ops = [
        dist.P2POp(dist.isend, send, nxt, group),
        dist.P2POp(dist.irecv, recv, prv, group),
    ]
    return dist.batch_isend_irecv(ops)


def wait_all(requests) -> None:
    for req in requests or ():
        req.wait()


def broadcast_from(buffer: torch.Tensor, owner: int, group, async_op: bool = True):
    """Broadcast ``buffer`` from group rank ``owner`` to every member of the group."""
    return dist.broadcast(buffer, src=dist.get_global_rank(group, owner), group=group,
                          async_op=async_op)


def reduce_to(buffer: torch.Tensor, owner: int, group, async_op: bool = True):
    """SUM-reduce ``buffer`` over the group onto group rank ``owner``."""
    return dist.reduce(buffer, dst=dist.get_global_rank(group, owner), group=group,
                       async_op=async_op)


def all_gather_seq(local: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dim 0 in rank order: ``[D * s, ...]`` from each rank's ``[s, ...]``."""
    size = dist.get_world_size(group)
    if size == 1:
        return local
    local = local.contiguous()
    out = torch.empty((size * local.shape[0],) + tuple(local.shape[1:]), dtype=local.dtype,
                      device=local.device)
    dist.all_gather_into_tensor(out, local, group=group)
    return out


def reduce_scatter_seq(full: torch.Tensor, group) -> torch.Tensor:
    """SUM-reduce a ``[D * s, ...]`` tensor over the group; rank r keeps rows of block r."""
    size = dist.get_world_size(group)
    if size == 1:
        return full
    full = full.contiguous()
    out = torch.empty((full.shape[0] // size,) + tuple(full.shape[1:]), dtype=full.dtype,
                      device=full.device)
    dist.reduce_scatter_tensor(out, full, group=group)
    return out
