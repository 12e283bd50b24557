"""(e) communication volume of one TSP layer vs the schedule's formula; (f) ring ordering."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_tsp.core.layers.attention import TSPSelfAttention
from megatron_tsp.core.layers.mlp import TSPMLP
from megatron_tsp.tools.comm_counter import CommCounter
from tests.common import group_info, make_config, setup_tsp

_MATMULS = {"mm", "addmm", "addmm_", "bmm", "baddbmm"}


class _Trace(TorchDispatchMode):
    """Interleaves matmuls (from dispatch) and collectives (from the CommCounter) in call order."""

    def __init__(self):
        super().__init__()
        self.events = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _MATMULS:
            self.events.append("mm")
        return func(*args, **(kwargs or {}))


def _mlp(d, dtype, gated, bias, hidden, ffn):
    config = make_config(
        d,
        dtype,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        gated_linear_unit=gated,
        add_bias_linear=bias,
        activation_func=F.silu if gated else F.gelu,
    )
    return config, TSPMLP(
        config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    )


def _attention(d, dtype, heads, groups, bias, hidden, kv_grad_fp32=None, kv_grad_a2a=False):
    config = make_config(
        d,
        dtype,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        add_bias_linear=bias,
    )
    config.tsp_kv_grad_all_to_all = kv_grad_a2a
    return config, TSPSelfAttention(
        config,
        SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=DotProductAttention,
            linear_proj=RowParallelLinear,
        ),
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        kv_grad_reduce_in_fp32=kv_grad_fp32,
    )


def _summary(counter, phase):
    return {
        "ops": sorted(set(counter.ops(phase=phase))),
        "calls": {op: e["calls"] for op, e in counter.by_op(phase=phase).items()},
        "recv": counter.recv_bytes(phase=phase),
    }


def measure_layer(
    kind,
    d,
    dtype_name="float32",
    seq=32,
    batch=2,
    hidden=32,
    heads=4,
    groups=2,
    ffn=64,
    gated=False,
    bias=True,
    kv_grad_fp32=None,
    kv_grad_a2a=False,
):
    """Run one TSP layer forward + backward under a CommCounter; return counted comm.
    ``kv_grad_fp32``: the attention's ``kv_grad_reduce_in_fp32`` (None: the default);
    ``kv_grad_a2a``: ``config.tsp_kv_grad_all_to_all``."""
    dtype = getattr(torch, dtype_name)
    setup_tsp(d)
    _, size, _ = group_info()
    if kind == "mlp":
        _, layer = _mlp(d, dtype, gated, bias, hidden, ffn)
    else:
        _, layer = _attention(d, dtype, heads, groups, bias, hidden, kv_grad_fp32, kv_grad_a2a)
    x = torch.randn(seq // size, batch, hidden, dtype=dtype, requires_grad=True)
    with CommCounter() as counter:
        out, _ = layer(x)
        out.backward(torch.randn_like(out))
    return {
        "fwd": _summary(counter, "fwd"),
        "bwd": _summary(counter, "bwd"),
        "scopes": sorted({r.scope for r in counter.records}),
    }


def trace_layer(kind, d, seq=32, batch=2, hidden=32):
    """Event order (collectives and matmuls) of one TSP layer's forward and backward."""
    setup_tsp(d)
    _, size, _ = group_info()
    if kind == "mlp":
        _, layer = _mlp(d, torch.float32, False, False, hidden, 2 * hidden)
    else:
        _, layer = _attention(d, torch.float32, 4, 4, False, hidden)
    x = torch.randn(seq // size, batch, hidden, requires_grad=True)
    return trace_forward_backward(lambda: layer(x)[0])


def trace_forward_backward(forward):
    """Event order (collectives from the CommCounter, matmuls from dispatch) of ``forward()``
    and of the backward of the tensor it returns, for a random output gradient."""
    trace = _Trace()
    with CommCounter(on_record=lambda r: trace.events.append(r.op)):
        with trace:
            out = forward()
        fwd = list(trace.events)
        trace.events.clear()
        grad = torch.randn_like(out)
        with trace:
            out.backward(grad)
        bwd = list(trace.events)
    return {"fwd": fwd, "bwd": bwd}


def check_all_to_all_sum_rounds_once(seed, rows=64, width=96):
    """``comm.post_all_to_all_sum`` on bf16 partials: this rank's rows are the fp32 sum of every
    rank's bf16 block rounded once, bitwise; the ring reduce-scatter of the same partials (bf16
    at every hop) is returned beside it for the caller to compare against the exact sum."""
    import torch.distributed as dist

    from megatron_tsp.core.comm import post_all_to_all_sum, post_reduce_scatter

    setup_tsp(dist.get_world_size())
    group, size, rank = group_info()
    gen = torch.Generator().manual_seed(seed)
    partials = [
        torch.randn(size * rows, width, generator=gen, dtype=torch.float64) for _ in range(size)
    ]
    mine = partials[rank].to(torch.bfloat16)
    summed = post_all_to_all_sum(mine, group, torch.float32, purpose="test_a2a").wait()
    ring = post_reduce_scatter(mine.clone(), group, purpose="test_rs").wait().double()
    block = slice(rank * rows, (rank + 1) * rows)
    once = sum(p[block].to(torch.bfloat16).float() for p in partials)
    exact = sum(p[block] for p in partials)
    assert summed.dtype == torch.float32 and torch.equal(summed, once), "not one fp32 sum"
    one_rounding = (exact.to(torch.bfloat16).double() - exact).norm() / exact.norm()
    return {
        "a2a": ((summed.to(torch.bfloat16).double() - exact).norm() / exact.norm()).item(),
        "ring": ((ring - exact).norm() / exact.norm()).item(),
        "one_rounding": one_rounding.item(),
    }
