"""A TSP attention step's head groups: their geometry, their QKV projection and the stream of
weight shards that brings them.

Shared by the training layer (``attention.py``) and the prefill (``prefill_attention.py``): a
step is one head group, whose QKV rows and output-projection columns are one weight shard (or,
with fewer K/V heads than ranks, ``shards_per_group`` consecutive shards, megatron-core's TP
layout); its owner broadcasts them (``ShardStream`` / ``GroupStream``) and every rank projects
its own tokens through them (``group_qkv_linear``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_tsp.core.comm import FlatShard, broadcast_from, weight_bias_views


@dataclass(frozen=True)
class HeadLayout:
    """Per-step head geometry and attention constants. A step is one head group (ng >= D: one
    weight shard, exactly a TP=D rank's heads; ng < D: one K/V head and its np/ng query heads,
    spread over ``shards_per_group`` consecutive shards, as megatron-core lays out TP=D)."""

    heads: int  # query heads per step (np / D, or np / ng when ng < D)
    groups: int  # key/value groups per step (ng / D, or 1 when ng < D)
    head_dim: int
    softmax_scale: float
    dropout_p: float
    config: object  # the TransformerConfig, for RoPE
    backward: str = "saved"  # "saved": keep (q,k,v, out, lse); "recompute": keep only the input
    # the dK/dV reduce-scatter in the accumulation dtype (fp32 for bf16/fp16) instead of the
    # compute dtype (--tsp-kv-grad-reduce-in-fp32)
    kv_grad_fp32: bool = False
    # the dK/dV sum over the sequence group as an all-to-all of the partials, added in the
    # accumulation dtype at the owner (--tsp-kv-grad-all-to-all): one rounding whatever the
    # group size, where the ring reduce-scatter rounds to the wire dtype at each of its hops
    kv_grad_all_to_all: bool = False
    # grad_x (one dgrad GEMM over the head groups) in the accumulation dtype instead of the
    # compute dtype (--tsp-activation-sums-in-fp32, ``precision.activation_sum_dtype``)
    activation_sums_fp32: bool = False
    shards_per_group: int = 1  # m = D / ng weight shards per step when ng < D, else 1

    @property
    def qkv_split(self) -> list:
        return [self.heads // self.groups * self.head_dim, self.head_dim, self.head_dim]


def pack_own_shard(qkv_w, qkv_b, proj_w) -> FlatShard:
    """This rank's shard as one flat buffer [qkv weight, (qkv bias), proj weight]."""
    return FlatShard.pack([qkv_w] + ([qkv_b] if qkv_b is not None else []) + [proj_w])


def qkv_linear(x, qkv_w, qkv_b, head_layout: HeadLayout) -> torch.Tensor:
    """Local tokens through one QKV shard: [s, b, ng/D, (np/ng + 2) * hn] (Megatron's layout)."""
    mixed = torch.matmul(x, qkv_w.t())
    if qkv_b is not None:
        mixed = mixed + qkv_b
    return mixed.view(*mixed.shape[:2], head_layout.groups, -1)


def group_qkv_linear(x, shards, has_bias: bool, head_layout: HeadLayout) -> torch.Tensor:
    """Local tokens through one step's QKV rows, the concatenation of its ``shards`` (one GEMM
    per shard, no copy of the weights): [s, b, groups, (heads/groups + 2) * hn]."""
    parts = []
    for shard in shards:
        w, b, _ = weight_bias_views(shard.views(), has_bias)
        parts.append(qkv_linear(x, w, b, head_layout).flatten(2))
    mixed = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return mixed.view(*mixed.shape[:2], head_layout.groups, -1)


class ShardStream:
    """Broadcasts the D weight shards in order, one shard ahead of the consumer.

    ``get(r)`` (r non-decreasing) posts shard r+1's broadcast, then waits for shard r. ``hold``:
    how many consecutive shards the consumer still reads at once (the current one included); the
    stream keeps hold + 1 spare buffers so an in-flight broadcast never lands in a shard that is
    still being read. Shard 0's broadcast is posted at construction."""

    def __init__(self, own: FlatShard, group, hold: int = 2):
        self.own, self.group = own, group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        n_spare = min(hold + 1, self.size) if self.size > 1 else 0
        self.spare = [FlatShard.like(own) for _ in range(n_spare)]
        self.pending = {}
        self.ready = {}
        self._post(0)

    def _post(self, r: int) -> None:
        if r >= self.size or self.size == 1 or r in self.pending or r in self.ready:
            return
        buf = self.own if r == self.rank else self.spare[r % len(self.spare)]
        self.pending[r] = (buf, broadcast_from(buf.buffer, r, self.group, async_op=True))

    def get(self, r: int) -> FlatShard:
        if self.size == 1:
            return self.own
        if r not in self.ready:
            self._post(r)
            self._post(r + 1)  # prefetch the next shard before computing with this one
            buf, pending = self.pending.pop(r)
            pending.wait()
            self.ready = {r: buf}
        return self.ready[r]


class GroupStream:
    """A ``ShardStream`` read one step (head group) at a time: ``get(j)`` returns the
    ``shards_per_group`` consecutive shards of step j (j non-decreasing; the last step's list is
    kept, so asking for it again broadcasts nothing). ``hold``: steps read at once."""

    def __init__(self, own: FlatShard, group, shards_per_group: int, hold: int):
        self.m = shards_per_group
        self.stream = ShardStream(own, group, hold=hold * self.m)
        self.last = (None, None)

    def get(self, j: int) -> list:
        if self.last[0] != j:
            self.last = (j, [self.stream.get(j * self.m + i) for i in range(self.m)])
        return self.last[1]
