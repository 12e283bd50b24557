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


def _trace_forward_backward(layer, x):
    """One forward and backward of ``layer`` on ``x`` traced: the events of each phase."""
    events = []
    remove = comm.observe(_recorder(events))
    try:
        with _KernelTrace(events):
            out, _ = layer(x)
        fwd = list(events)
        events.clear()
        with _KernelTrace(events):
            out.backward(torch.randn_like(out))
        return fwd, list(events)
    finally:
        remove()


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
        fwd, bwd = _trace_forward_backward(layer, x)
        results[kind] = {"fwd": blocking(fwd), "bwd": blocking(bwd)}
    return results


# --------------------------------------------------------------------------------------------
# queue order under CUDA_DEVICE_MAX_CONNECTIONS=1 (attention backward)


def stalls_behind_large(events, large_ops):
    """Where a transfer and the kernels behind it would wait for a large transfer that is not yet
    needed, in the one FIFO hardware queue every stream feeds under
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron-LM's scripts).

    Model: collectives of one communicator run one after another, so a transfer T posted while a
    large transfer L is still running cannot start before L ends, and the queue holds every
    kernel launched after T until then. L is taken to be running from its post until an
    attention kernel has been queued behind it (the next head group's attention backward, which
    takes longer than any one transfer at the shapes TSP is for) or until it is waited (then it is
    needed anyway). A stall is such a T followed by at least one kernel before L's wait: returns
    ``[(op of L, op of T), ...]``. (``queue_stalls`` is the MLP ring's stricter check: no two
    transfers back to back without compute between them.)"""
    running = {}  # ident of a large transfer -> (op, attention kernels queued before its post)
    attention, candidates, stalls = 0, [], []
    for event in events:
        kind = event[0]
        if kind == "kernel":
            if event[1] == "attention":
                attention += 1
            for cand in candidates:  # a kernel queued behind a held transfer
                if cand[0] in running and cand not in stalls:
                    stalls.append(cand)
        elif kind == "post":
            for ident, (op, mark) in running.items():
                if attention == mark:
                    candidates.append((ident, op, event[2]))
            if event[2] in large_ops:
                running[event[1]] = (event[2], attention)
        elif kind == "wait":
            running.pop(event[1], None)
            candidates = [c for c in candidates if c[0] != event[1]]
    return [(op, held) for _, op, held in stalls]


def attention_queue_order(d, backward="saved", seq=32, batch=2, hidden=32, heads=8, groups=4):
    """One TSP attention layer's forward and backward traced (transfers posted and waited,
    GEMM and attention kernels queued): the queue stalls behind its dK/dV reduce-scatters, per
    phase, and the backward's post order (for the failure message)."""
    setup_tsp(d)
    _, size, _ = group_info()
    _, layer = _attention(d, torch.float32, heads, groups, False, hidden)
    layer.head_layout = type(layer.head_layout)(
        **{**layer.head_layout.__dict__, "backward": backward}
    )
    x = torch.randn(seq // size, batch, hidden, requires_grad=True)
    fwd, bwd = _trace_forward_backward(layer, x)
    large = ("reduce_scatter_tensor",)
    order = [e[2] if e[0] == "post" else e[1] for e in bwd if e[0] != "wait"]
    return {
        "fwd": stalls_behind_large(fwd, large),
        "bwd": stalls_behind_large(bwd, large),
        "order": order,
    }


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
    fwd, bwd = _trace_forward_backward(layer, x)
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
