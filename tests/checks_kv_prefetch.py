"""Rank bodies of tests/test_kv_prefetch.py: one TSP attention followed by one TSP MLP (a
``TransformerLayer``'s order) traced forward and backward (``checks_overlap``'s trace: every
transfer's post and wait, the GEMM / attention kernels between them), and the same layers'
numerics with the hand-off on and off."""

from __future__ import annotations

import torch

from megatron_tsp.core.layers import kv_prefetch
from megatron_tsp.core.layers.mlp import WEIGHT_GRADS
from tests.checks_comm import _attention, _mlp
from tests.checks_overlap import _KernelTrace, _recorder, blocking, stalls_behind_large
from tests.common import group_info, setup_tsp

GATHER = "kv_gathered"  # the K/V all-gathers' payload (``attention._post_kv_gather``)


def _layers(d, backward, dtype=torch.float32, seq=32, batch=2, hidden=32, heads=8, groups=4):
    setup_tsp(d)
    _, size, _ = group_info()
    _, attention = _attention(d, dtype, heads, groups, False, hidden)
    attention.head_layout = type(attention.head_layout)(
        **{**attention.head_layout.__dict__, "backward": backward}
    )
    _, mlp = _mlp(d, dtype, False, True, hidden, 2 * hidden)
    x = torch.randn(seq // size, batch, hidden, dtype=dtype, requires_grad=True)
    return attention, mlp, x


def _run(attention, mlp, x, grad):
    a, _ = attention(x)
    y, _ = mlp(a)
    y.backward(grad)
    return y


def trace_layer(d, backward="saved"):
    """One attention + MLP forward and backward traced; returns the backward's events reduced to
    what the test reads: the posts and waits of the K/V gathers and of the MLP's gradient hops,
    and the kernels, in issue order; plus ``blocking`` and the attention's queue check
    (``stalls_behind_large`` of the dK/dV reduce-scatters) of the backward."""
    from megatron_tsp.core import comm

    attention, mlp, x = _layers(d, backward)
    events = []
    remove = comm.observe(_recorder(events))
    try:
        with _KernelTrace(events):
            a, _ = attention(x)
            y, _ = mlp(a)
        events.clear()
        with _KernelTrace(events):
            y.backward(torch.randn_like(y))
    finally:
        remove()
    order = []
    for e in events:
        if e[0] == "kernel":
            order.append(("kernel", e[1]))
        elif e[0] in ("post", "wait") and e[3] in (GATHER, WEIGHT_GRADS):
            order.append((e[0], e[3], e[1]))
    stalls = stalls_behind_large(events, ("reduce_scatter_tensor",))
    return {"order": order, "blocking": blocking(events)[1], "stalls": stalls}


def handoff_numerics(d, backward="saved", dtype_name="float64"):
    """Output, input gradient and every weight gradient of attention + MLP with the hand-off
    (the default) and with the slot forced empty (the attention posts its own gather), the same
    layers and input: they must be identical, bit for bit (the same transfer, posted earlier).
    Also whether the hand-off was taken by the MLP in the first run."""
    dtype = {"float64": torch.float64, "float32": torch.float32}[dtype_name]
    attention, mlp, x = _layers(d, backward, dtype)
    g = torch.randn(x.shape, dtype=dtype, generator=torch.Generator().manual_seed(7))
    params = list(attention.parameters()) + list(mlp.parameters())
    original, taken, results = kv_prefetch.take, [], []
    for use in (True, False):
        for t in params + [x]:
            t.grad = None

        def take(group, _use=use):
            handoff = original(group)
            taken.append(handoff is not None)
            return handoff if _use else None

        kv_prefetch.take = take
        try:
            y = _run(attention, mlp, x, g)
        finally:
            kv_prefetch.take = original
        results.append([y.detach(), x.grad] + [p.grad for p in params if p.grad is not None])
    with_handoff, without = results
    return {
        "taken": taken,
        "tensors": len(with_handoff),
        "max_diff": max((a - b).abs().max().item() for a, b in zip(with_handoff, without)),
    }
