"""The P2P weight ring shared by the TSP MLP and the TSP expert ring.

Every rank packs its shard of the ring's weights into one flat buffer (``FlatShard``); at step t it
computes with shard (rank - t) mod D while hop t+1 (send to rank+1, receive from rank-1) is in
flight. No collectives.

Forward (``shards``): D-1 weight hops, each posted before the current shard's GEMMs and waited
after them.

Backward (``backward``): the same D-1 weight hops, plus D-1 hops of the weight-gradient
accumulator one step behind. Issue order per step t (``comm``'s queue model): the next weight hop
W(t+1), the dX kernels, the accumulator hop A(t-1) of the previous step, the weight-gradient
kernels, then A(t-1) is waited and added. W(t+1) is needed first and never queues behind A(t-1);
A(t-1) follows compute that covers W(t+1); each transfer is posted after the previous one was
waited or covered, so no kernel waits for a transfer that is not needed yet, and A(t-1) overlaps
step t's weight-gradient GEMMs. The last hop (the drain) brings every other rank's contribution
to the rank's own shard.
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Sequence, Tuple

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


def backward(
    params: Sequence[torch.Tensor],
    group,
    grad_dtype: torch.dtype,
    input_grads: Callable[[List[torch.Tensor], int], object],
    weight_grads: Callable[[object, FlatShard], None],
    payloads: Tuple[str, str],
) -> FlatShard:
    """The backward ring (module docstring). Per step t: ``kept = input_grads(views of shard
    (rank - t) mod D, t)`` (the dX kernels; needs no accumulator), then ``weight_grads(kept,
    out)`` writes (not adds) this rank's partial weight gradients of that shard into ``out``
    (a ``FlatShard`` of ``grad_dtype``). Returns this rank's own shard's gradient, summed over
    the ring. ``payloads``: the names of the weight and accumulator transfers."""
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
    weight_grads(kept, own)
    if size == 1:
        return own
    # Two send buffers: step t fills one while the other is still on the wire. One receive
    # buffer: each hop is waited and added before the next is posted.
    acc_out = [FlatShard.like(own), FlatShard.like(own)]
    acc_recv = FlatShard.like(own)
    to_send = None
    for t in range(1, size):
        pending.wait()
        current = spare[(t - 1) % len(spare)]
        if t < size - 1:  # W(t+1) before this step's matmuls
            pending = ring_exchange(
                current.buffer, spare[t % len(spare)].buffer, group, weight_payload
            )
        kept = input_grads(current.views(), t)
        acc_pending = None
        if to_send is not None:  # A(t-1), behind W(t+1) and the dX kernels
            acc_pending = ring_exchange(to_send.buffer, acc_recv.buffer, group, grad_payload)
        # Accumulator of shard (p - t): ranks p-t+1 .. p-1 added theirs; add ours.
        filled = acc_out[t % 2]
        weight_grads(kept, filled)
        if acc_pending is not None:
            acc_pending.wait()
            filled.buffer.add_(acc_recv.buffer)
        to_send = filled
    ring_exchange(to_send.buffer, acc_recv.buffer, group, grad_payload).wait()
    own.buffer.add_(acc_recv.buffer)
    return own
