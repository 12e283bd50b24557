"""Megatron's recompute options under TSP, run inside every rank."""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_tsp.core import sharding, zigzag
from megatron_tsp.core.layers.attention import TSPSelfAttention
from megatron_tsp.core.specs import get_gpt_block_tsp_spec
from tests import checks_gpt
from tests.common import DTYPES, group_info, make_config, rel_err, setup_tsp


def _attention(config, backward=None):
    return TSPSelfAttention(
        config,
        SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=DotProductAttention,
            linear_proj=RowParallelLinear,
        ),
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_backward=backward,
    )


def recompute_equals_saved(d, seed, dtype_name, heads=8, groups=4, hidden=64, seq=32, batch=2):
    """The same layer in "saved" and "recompute" mode: output and every gradient bitwise equal
    (the recompute runs the same kernels on the same inputs). Also returns the modes that
    Megatron's flags select."""
    dtype = {**DTYPES, "bfloat16": torch.bfloat16}[dtype_name]
    setup_tsp(d)
    group, size, rank = group_info()
    results = {}
    selected = {}
    for name, extra in (
        ("default", {}),
        (
            "selective_core_attn",
            dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
        ),
        ("selective_mlp_only", dict(recompute_granularity="selective", recompute_modules=["mlp"])),
    ):
        config = make_config(
            d,
            dtype,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=groups,
            add_bias_linear=True,
            **extra,
        )
        selected[name] = _attention(config).head_layout.backward
    config = make_config(
        d,
        dtype,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        add_bias_linear=True,
    )
    torch.manual_seed(seed)
    x_full = torch.randn(seq, batch, hidden, dtype=dtype)
    dy_full = torch.randn(seq, batch, hidden, dtype=dtype)
    full = None
    for mode in ("saved", "recompute"):
        layer = _attention(config, mode)
        if full is None:
            full = sharding.gather_full_state(layer, group)
            full = {
                n: torch.randn(
                    t.shape, dtype=dtype, generator=torch.Generator().manual_seed(seed + 1)
                )
                * 0.3
                for n, t in full.items()
            }
        sharding.load_full_state(layer, full, group)
        x = zigzag.split(x_full, size, rank, dim=0).requires_grad_(True)
        out, _ = layer(x)
        out.backward(zigzag.split(dy_full, size, rank, dim=0))
        results[mode] = [out.detach(), x.grad] + [
            p.grad for p in layer.parameters() if p.grad is not None
        ]
    equal = all(torch.equal(a, b) for a, b in zip(results["saved"], results["recompute"]))
    return {"bitwise_equal": equal, "selected": selected, "kernel": layer.attention_kernel_name}


def gpt_recompute_vs_single(
    d, seed, style, recompute, layers=2, hidden=32, heads=8, ffn=64, vocab=128, batch=2, seq=32
):
    """Whole GPTModel under TSP with Megatron's ``--recompute-granularity full`` (uniform, one
    layer per checkpoint), ``selective`` (``--recompute-activations``) or ``selective_mlp``
    (``--recompute-modules core_attn mlp``: Megatron's TransformerLayer checkpoints the TSP MLP,
    ring included) vs the stock single-process model without recompute, fp64. Also returns the
    attention modes, and per layer whether Megatron checkpoints the MLP and whether the TSP MLP
    recomputes fc1 itself (never unless opted in)."""
    dtype = torch.float64
    ref_loss, ref_params, ref_grads, data = checks_gpt.reference_run(
        style, seed, dtype, layers, hidden, heads, ffn, vocab, batch, seq, "exact"
    )
    setup_tsp(d, seed)
    group, size, _ = group_info()
    config = checks_gpt._config(d, dtype, style, layers, hidden, heads, ffn)
    extra = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if recompute == "full"
        else dict(
            recompute_granularity="selective",
            recompute_modules=["core_attn", "mlp"]
            if recompute == "selective_mlp"
            else ["core_attn"],
        )
    )
    for key, value in extra.items():
        setattr(config, key, value)
    model = checks_gpt._model(
        config, get_gpt_block_tsp_spec(config), style, vocab, seq, parallel_output=False
    )
    modes = sorted(
        {m.head_layout.backward for m in model.modules() if isinstance(m, TSPSelfAttention)}
    )
    mlp = sorted(
        {
            (bool(layer.recompute_mlp), bool(layer.mlp.recompute_activation))
            for layer in model.modules()
            if hasattr(layer, "recompute_mlp")
        }
    )
    sharding.load_full_state(model, ref_params, group)
    loss = checks_gpt._step(model, zigzag.get_batch_on_this_tsp_rank(data, size), "exact")
    sharding.allreduce_sequence_parallel_grads(model, group)
    grads = sharding.gather_full_state(model, group, grads=True)
    errors = {"loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())}
    for name, g in ref_grads.items():
        errors[f"grad:{name}"] = rel_err(grads[name], g)
    return {"errors": errors, "modes": modes, "mlp": mlp}
