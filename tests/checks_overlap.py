"""Overlap trace of one TSP layer (attention + MLP): every transfer's post and wait, interleaved
with the GEMM and attention kernels issued between them (``comm.observe`` + a dispatch mode), and
the queue-order check of ``comm``'s queue model (``queue_stalls``)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_tsp.core import comm
from tests.checks_comm import _attention, _mlp
from tests.common import group_info, setup_tsp

_KERNELS = {"mm", "addmm", "bmm", "baddbmm"}
# buffer initialisations (a zeroed accumulator read back instead of writing the first partial)
_FILLS = {"zero", "zeros", "zeros_like", "new_zeros", "fill", "full", "full_like", "new_full"}


class _KernelTrace(TorchDispatchMode):
    def __init__(self, events):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")  # addmm_ accumulates in place
        if name in _KERNELS:
            self.events.append(("kernel", "mm"))
        elif "scaled_dot_product" in name:
            self.events.append(("kernel", "attention"))
        out = func(*args, **(kwargs or {}))
        if name in _FILLS and isinstance(out, torch.Tensor) and out.numel() > 1:
            self.events.append(("fill", name, tuple(out.shape)))
        return out


def _recorder(events):
    """Observer appending ``(event, ident, op, payload, nbytes)`` to ``events``."""

    def record(event, transfer):
        events.append((event, transfer.ident, transfer.op, transfer.payload, transfer.nbytes))

    return record


def queue_stalls(events):
    """Posts that stall the single hardware queue (``comm``'s queue model): a transfer posted
    while the previous one is still in flight (not waited) with no GEMM or attention kernel
    issued in between. On one communicator it cannot launch before the previous one finishes,
    and every kernel issued after it waits with it. Returns [(earlier payload, later payload)]."""
    stalls, previous, kernels_since, waited = [], None, 0, set()
    for event in events:
        if event[0] == "kernel":
            kernels_since += 1
        elif event[0] == "wait":
            waited.add(event[1])
        elif event[0] == "post":
            if previous is not None and previous[0] not in waited and kernels_since == 0:
                stalls.append((previous[1], event[3]))
            previous, kernels_since = (event[1], event[3]), 0
    return stalls


def blocking(events):
    """Transfers waited with no GEMM or attention kernel issued between their post and wait:
    returns (number of transfers, [op of each blocking one])."""
    posted, kernels_since, blocked, total = {}, 0, [], 0
    for event in events:
        if event[0] == "kernel":
            kernels_since += 1
        elif event[0] == "post":
            posted[event[1]] = (event[2], kernels_since)
            total += 1
        elif event[0] == "wait":
            op, mark = posted.pop(event[1])
            if kernels_since == mark:
                blocked.append(op)
    assert not posted, f"transfers never waited: {posted}"
    return total, blocked


def trace_layer_overlap(d, backward="saved", seq=32, batch=2, hidden=32, heads=8, groups=4):
    """Per phase and module: (transfers, blocking ops) of one forward + backward."""
    setup_tsp(d)
    _, size, _ = group_info()
    results = {}
    for kind in ("attention", "mlp"):
        if kind == "mlp":
            _, layer = _mlp(d, torch.float32, False, False, hidden, 2 * hidden)
        else:
            _, layer = _attention(d, torch.float32, heads, groups, False, hidden)
            layer.head_layout = type(layer.head_layout)(
                **{**layer.head_layout.__dict__, "backward": backward}
            )
        x = torch.randn(seq // size, batch, hidden, requires_grad=True)
        events = []
        remove = comm.observe(_recorder(events))
        try:
            with _KernelTrace(events):
                out, _ = layer(x)
            fwd = list(events)
            events.clear()
            grad = torch.randn_like(out)
            with _KernelTrace(events):
                out.backward(grad)
            bwd = list(events)
        finally:
            remove()
        results[kind] = {"fwd": blocking(fwd), "bwd": blocking(bwd)}
    return results


def trace_mlp_queue(d, dtype_name="bfloat16", seq=32, batch=2, hidden=32, ffn=64, **layer_kwargs):
    """The MLP ring's posts in issue order, forward and backward: [(payload, nbytes)] per phase,
    the queue stalls, the blocking transfers and the buffer fills (zeros / fill of more than
    one element) of each phase, and the flat shard's element count."""
    from tests.checks_comm import _mlp
    from tests.common import DTYPES

    dtype = {**DTYPES, "bfloat16": torch.bfloat16}[dtype_name]
    setup_tsp(d)
    _, size, _ = group_info()
    _, layer = _mlp(d, dtype, False, True, hidden, ffn)
    for name, value in layer_kwargs.items():
        setattr(layer, name, value)
    x = torch.randn(seq // size, batch, hidden, dtype=dtype, requires_grad=True)
    events = []
    remove = comm.observe(_recorder(events))
    try:
        with _KernelTrace(events):
            out, _ = layer(x)
        fwd = list(events)
        events.clear()
        grad = torch.randn_like(out)
        with _KernelTrace(events):
            out.backward(grad)
        bwd = list(events)
    finally:
        remove()
    shard = sum(p.numel() for p in (layer.linear_fc1.weight, layer.linear_fc1.bias))
    shard += layer.linear_fc2.weight.numel()
    return {
        phase: {
            "posts": [(e[3], e[4]) for e in ev if e[0] == "post"],
            "stalls": queue_stalls(ev),
            "blocking": blocking(ev)[1],
            "fills": [e[1:] for e in ev if e[0] == "fill"],
        }
        for phase, ev in (("fwd", fwd), ("bwd", bwd))
    } | {"shard_elems": shard}
