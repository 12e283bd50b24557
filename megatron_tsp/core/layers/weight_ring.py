"""The P2P weight ring shared by the TSP MLP and the TSP expert ring.

Every rank packs its shard of the ring's weights into one flat buffer (``FlatShard``); at step t it
computes with shard (rank - t) mod D while hop t+1 (send to rank+1, receive from rank-1) is in
flight. No collectives.

Forward (``shards``): D-1 weight hops, each posted before the current shard's GEMMs and waited
after them.

Backward (``backward``): the same D-1 weight hops, plus D-1 hops of the weight-gradient
accumulator. The accumulator of shard j starts at the rank that reads shard j at step 1 and
travels with it; every later rank's weight-gradient GEMMs accumulate onto it in place, in the
buffer it arrived in (a GEMM with beta = 1: the accumulator is read and written once per step, no
separate partial and no ``add_``), and that buffer is sent on. Issue order per step t (``comm``'s
queue model): wait W(t); the dX kernels (they need no accumulator and cover the accumulator hop
A(t-1) posted at the end of step t-1); post W(t+1); wait A(t-1); the weight-gradient GEMMs onto
it (they cover W(t+1)); post A(t). Each transfer is posted with compute between it and the
previous post, so no kernel queues behind a transfer that is not needed yet. The last hop (the
drain) brings every other rank's contribution to the rank's own shard, whose own part was written
at step 0: one ``add_``; the caller's ``cover_drain`` work (the MLP's one dgrad GEMM) is issued
between its post and its wait.
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_tsp.core.comm import FlatShard, done, ring_exchange


def shards(
    params: Sequence[torch.Tensor], group, payload: str
) -> Iterator[Tuple[int, List[torch.Tensor]]]:
    """Yield ``(t, views of shard (rank - t) mod D)`` for t = 0..D-1 (views in ``params``'
    order). Hop t+1 is posted before shard t is yielded and waited when the consumer asks for
    the next one; with D = 1 the parameters themselves are yielded."""
    size = dist.get_world_size(group)
    if size == 1:
        yield 0, list(params)
        return
    current = FlatShard.pack(params)
    spare = [FlatShard.like(current) for _ in range(min(size - 1, 2))]
    for t in range(size):
        pending, incoming = done(), None
        if t < size - 1:
            incoming = spare[t % len(spare)]
            pending = ring_exchange(current.buffer, incoming.buffer, group, payload)
        yield t, current.views()
        pending.wait()
        if incoming is not None:
            current = incoming


# fp32 flat gradient shards a backward ring holds: the rank's own shard and two that alternate
# between being accumulated onto and being on the wire (the estimator counts these)
GRAD_SHARDS_HELD = 3


def backward(
    params: Sequence[torch.Tensor],
    group,
    grad_dtype: torch.dtype,
    input_grads: Callable[[List[torch.Tensor], int], object],
    weight_grads: Callable[[object, FlatShard, bool], None],
    payloads: Tuple[str, str],
    cover_drain: Optional[Callable[[], None]] = None,
) -> FlatShard:
    """The backward ring (module docstring). Per step t: ``kept = input_grads(views of shard
    (rank - t) mod D, t)`` (the dX kernels; needs no accumulator), then ``weight_grads(kept, out,
    accumulate)`` puts this rank's partial weight gradients of that shard into ``out`` (a
    ``FlatShard`` of ``grad_dtype``): written when ``accumulate`` is False (the shard's first
    contribution), added in place onto the arrived accumulator when True. Returns this rank's own
    shard's gradient, summed over the ring. ``payloads``: the names of the weight and accumulator
    transfers. ``cover_drain``: work issued after the last hop is posted and before it is waited
    (it must not read the own shard's gradient), so that hop does not block."""
    weight_payload, grad_payload = payloads
    size = dist.get_world_size(group)
    current = FlatShard.pack(params)
    own = FlatShard(current.shapes, grad_dtype, current.buffer.device)
    if size > 1:  # the next shard is posted before this step's matmuls
        spare = [FlatShard.like(current) for _ in range(min(size - 1, 2))]
        pending = ring_exchange(current.buffer, spare[0].buffer, group, weight_payload)
    # ``kept`` stays bound until the next step's ``input_grads`` returns, at every step (the
    # estimator's memory model counts step t-1's tensors next to step t's)
    kept = input_grads(current.views(), 0)
    weight_grads(kept, own, False)
    if size == 1:
        if cover_drain is not None:
            cover_drain()
        return own
    # Two accumulator buffers: one is accumulated onto (it arrived in it) while the other is on
    # the wire; an exchange sends one and receives into the other.
    acc = [FlatShard.like(own), FlatShard.like(own)]
    acc_pending = None  # A(t-1): sends step t-1's accumulator, receives step t's
    for t in range(1, size):
        pending.wait()
        current = spare[(t - 1) % len(spare)]
        kept = input_grads(current.views(), t)  # covers A(t-1)
        if t < size - 1:  # W(t+1), covered by this step's weight-gradient GEMMs
            pending = ring_exchange(
                current.buffer, spare[t % len(spare)].buffer, group, weight_payload
            )
        # Accumulator of shard (p - t): ranks p-t+1 .. p-1 added theirs; add ours onto it.
        arrived = acc[t % 2]
        if acc_pending is not None:
            acc_pending.wait()
        weight_grads(kept, arrived, acc_pending is not None)
        acc_pending = ring_exchange(arrived.buffer, acc[(t + 1) % 2].buffer, group, grad_payload)
    if cover_drain is not None:
        cover_drain()
    acc_pending.wait()  # the drain: every other rank's part of the own shard
    own.buffer.add_(acc[size % 2].buffer)
    return own
