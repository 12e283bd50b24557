"""Rank-side checks: TSP layers fire the forward pre-hooks of the submodules whose weights they
read (Megatron DDP's ``--overlap-param-gather`` waits live there)."""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.mlp import MLPSubmodules

from megatron_tsp.core.layers.attention import TSPSelfAttention
from megatron_tsp.core.layers.mlp import TSPMLP
from tests.common import group_info, make_config, rel_err, setup_tsp

READ_BY_TSP = {"mlp": ("linear_fc1", "linear_fc2"), "attention": ("linear_qkv", "linear_proj")}


def _build(kind, d, bias):
    config = make_config(
        d,
        torch.float64,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        add_bias_linear=bias,
    )
    if kind == "mlp":
        return TSPMLP(
            config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        )
    return TSPSelfAttention(
        config,
        SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=DotProductAttention,
            linear_proj=RowParallelLinear,
        ),
        layer_number=1,
    )


def check_pre_hooks_gate_weight_reads(d, seed, kind, bias):
    """Emulates a pending param all-gather: the submodules' weights hold garbage until their
    forward pre-hook "finishes the gather" (restores them), as DDP's hook waits on the bucket.
    The TSP output must equal the output with the weights in place, and every hook must fire
    exactly once per forward, before the layer's output exists."""
    setup_tsp(d)
    group, size, rank = group_info()
    torch.manual_seed(seed)
    reference = _build(kind, d, bias)
    gated = _build(kind, d, bias)
    gated.load_state_dict(reference.state_dict())
    x = torch.randn(16 // size, 2, 32, dtype=torch.float64)
    expected, _ = reference(x)

    fired = []
    for name in READ_BY_TSP[kind]:
        sub = getattr(gated, name)
        saved = {n: p.detach().clone() for n, p in sub.named_parameters(recurse=False)}
        with torch.no_grad():
            for p in sub.parameters(recurse=False):
                p.fill_(float("nan"))  # "not gathered yet"

        def finish_gather(module, inputs, name=name, saved=saved):
            fired.append(name)
            with torch.no_grad():
                for n, p in module.named_parameters(recurse=False):
                    p.copy_(saved[n])

        sub.register_forward_pre_hook(finish_gather)
    out, _ = gated(x)
    out2, _ = gated(x)
    return {"fired": fired, "err": rel_err(out, expected), "err2": rel_err(out2, expected)}


def check_input_rewriting_hook_is_refused(d, kind):
    setup_tsp(d)
    group, size, rank = group_info()
    layer = _build(kind, d, True)
    getattr(layer, READ_BY_TSP[kind][0]).register_forward_pre_hook(
        lambda module, inputs: (torch.zeros(1),)
    )
    try:
        layer(torch.randn(16 // size, 2, 32, dtype=torch.float64))
    except RuntimeError as exc:
        return str(exc)
    return None
