"""Per-layer checks run inside every rank: TSP layer vs a single-process reference."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_tsp import checkpoint, zigzag
from megatron_tsp.layers.attention import TSPSelfAttention
from megatron_tsp.layers.mlp import TSPMLP, make_activation
from tests.common import DTYPES, group_info, make_config, rel_err, setup_tsp


def _grads_vs_reference(module, full_grads, group, errors, replicated_sum=True):
    """Compare each parameter's gradient on this rank with the reference's slice."""
    import torch.distributed as dist

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    for name, param in module.named_parameters():
        grad = param.grad.clone()
        sharded, dim, stride = checkpoint.sharding_of(param)
        if sharded:
            expected = checkpoint.shard(full_grads[name], dim, stride, size, rank)
        else:  # replicated: each rank saw its own tokens; the group sum is the full gradient
            dist.all_reduce(grad, group=group)
            expected = full_grads[name]
        errors[f"grad:{name}"] = rel_err(grad, expected)


def check_mlp(d, seed, dtype_name, gated, bias, seq, batch, hidden, ffn, activation="gelu",
              recompute_activation=True):
    dtype = DTYPES[dtype_name]
    setup_tsp(d)
    group, size, rank = group_info()
    act = {"gelu": F.gelu, "silu": F.silu}[activation]
    config = make_config(d, dtype, hidden_size=hidden, ffn_hidden_size=ffn,
                         gated_linear_unit=gated, add_bias_linear=bias, activation_func=act)
    layer = TSPMLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                         linear_fc2=RowParallelLinear),
                   recompute_activation=recompute_activation)
    torch.manual_seed(seed)  # same full weights and data on every rank, fresh per run
    full = {n: torch.randn(checkpoint.unshard([p] * size, *checkpoint.sharding_of(p)[1:]).shape
                           if checkpoint.sharding_of(p)[0] else p.shape, dtype=dtype) * 0.2
            for n, p in layer.named_parameters()}
    checkpoint.load_full_state(layer, full, group)
    x_full = torch.randn(seq, batch, hidden, dtype=dtype)
    dy_full = torch.randn(seq, batch, hidden, dtype=dtype)

    # single-process reference on the full sequence
    ref = {n: t.clone().requires_grad_(True) for n, t in full.items()}
    xr = x_full.clone().requires_grad_(True)
    pre = xr @ ref["linear_fc1.weight"].t()
    if bias:
        pre = pre + ref["linear_fc1.bias"]
    yr = make_activation(config)(pre) @ ref["linear_fc2.weight"].t()
    if bias:
        yr = yr + ref["linear_fc2.bias"]
    yr.backward(dy_full)

    x = zigzag.split(x_full, size, rank, dim=0).requires_grad_(True)
    out, out_bias = layer(x)
    y = out + out_bias if out_bias is not None else out
    y.backward(zigzag.split(dy_full, size, rank, dim=0))
    errors = {
        "output": rel_err(y, zigzag.split(yr, size, rank, dim=0)),
        "grad:input": rel_err(x.grad, zigzag.split(xr.grad, size, rank, dim=0)),
    }
    _grads_vs_reference(layer, {n: t.grad for n, t in ref.items()}, group, errors)
    return errors


def reference_attention(x, qkv_w, qkv_b, proj_w, proj_b, heads, groups, rope_freqs, config):
    """Full-sequence causal self-attention with Megatron's per-query-group QKV layout."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    s, b, h = x.shape
    hn = qkv_w.shape[1] // heads if False else h // heads
    mixed = x @ qkv_w.t()
    if qkv_b is not None:
        mixed = mixed + qkv_b
    mixed = mixed.view(s, b, groups, -1)
    q, k, v = torch.split(mixed, [heads // groups * hn, hn, hn], dim=3)
    q = q.reshape(s, b, heads, hn)
    if rope_freqs is not None:
        q = apply_rotary_pos_emb(q, rope_freqs, config=config)
        k = apply_rotary_pos_emb(k, rope_freqs, config=config)
    k = k.repeat_interleave(heads // groups, dim=2)
    v = v.repeat_interleave(heads // groups, dim=2)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(hn)
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    ctx = (probs @ v).permute(2, 0, 1, 3).reshape(s, b, heads * hn)
    out = ctx @ proj_w.t()
    return out + proj_b if proj_b is not None else out


def check_attention(d, seed, dtype_name, heads, groups, bias, rope, seq, batch, hidden,
                    attention_backward="saved"):
    dtype = DTYPES[dtype_name]
    setup_tsp(d)
    group, size, rank = group_info()
    config = make_config(d, dtype, hidden_size=hidden, num_attention_heads=heads,
                         num_query_groups=groups, add_bias_linear=bias)
    layer = TSPSelfAttention(
        config,
        SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                core_attention=DotProductAttention,
                                linear_proj=RowParallelLinear),
        layer_number=1, attn_mask_type=AttnMaskType.causal, attention_backward=attention_backward,
    )
    torch.manual_seed(seed)
    full = {}
    for n, p in layer.named_parameters():
        sharded, dim, stride = checkpoint.sharding_of(p)
        shape = list(p.shape)
        if sharded:
            shape[dim] *= size
        full[n] = torch.randn(shape, dtype=dtype) * 0.3
    checkpoint.load_full_state(layer, full, group)
    x_full = torch.randn(seq, batch, hidden, dtype=dtype)
    dy_full = torch.randn(seq, batch, hidden, dtype=dtype)
    freqs = None
    if rope:
        freqs = RotaryEmbedding(kv_channels=hidden // heads, rotary_percent=1.0,
                                use_cpu_initialization=True)(seq).to(dtype)

    ref = {n: t.clone().requires_grad_(True) for n, t in full.items()}
    xr = x_full.clone().requires_grad_(True)
    yr = reference_attention(xr, ref["linear_qkv.weight"], ref.get("linear_qkv.bias"),
                             ref["linear_proj.weight"], ref.get("linear_proj.bias"),
                             heads, groups, freqs, config)
    yr.backward(dy_full)

    x = zigzag.split(x_full, size, rank, dim=0).requires_grad_(True)
    out, out_bias = layer(x, attention_mask=None, rotary_pos_emb=freqs)
    y = out + out_bias if out_bias is not None else out
    y.backward(zigzag.split(dy_full, size, rank, dim=0))
    errors = {
        "output": rel_err(y, zigzag.split(yr, size, rank, dim=0)),
        "grad:input": rel_err(x.grad, zigzag.split(xr.grad, size, rank, dim=0)),
    }
    _grads_vs_reference(layer, {n: t.grad for n, t in ref.items()}, group, errors)
    return errors


def check_main_grad_contract(d, seed, kind):
    """With gradient-accumulation fusion, weight grads land in ``main_grad`` (fp32, accumulated
    over two backward passes) and autograd's ``.grad`` is a flagged dummy — Megatron DDP's contract."""
    import torch.distributed as dist

    setup_tsp(d)
    group, size, rank = group_info()
    torch.manual_seed(seed)
    x = torch.randn(16 // size, 2, 32, dtype=torch.float64)
    dy = torch.randn(16 // size, 2, 32, dtype=torch.float64)

    def build():
        config = make_config(d, torch.float64, hidden_size=32, ffn_hidden_size=64,
                             num_attention_heads=4)
        if kind == "mlp":
            layer = TSPMLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                 linear_fc2=RowParallelLinear))
        else:
            layer = TSPSelfAttention(config, SelfAttentionSubmodules(
                linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention,
                linear_proj=RowParallelLinear), layer_number=1)
        return layer

    def run(layer):
        out, _ = layer(x.clone().requires_grad_(True))
        out.backward(dy)

    plain = build()
    fused = build()
    fused.load_state_dict(plain.state_dict())
    fused.gradient_accumulation_fusion = True
    sharded = [p for p in fused.parameters() if getattr(p, "tensor_model_parallel", False)]
    for p in sharded:
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        p.grad_added_to_main_grad = False
    run(plain)
    run(plain)
    run(fused)
    run(fused)
    errors = {}
    for (name, p_plain), p_fused in zip(plain.named_parameters(), fused.parameters()):
        if not getattr(p_fused, "tensor_model_parallel", False):
            continue
        assert p_fused.grad_added_to_main_grad, name
        assert p_fused.main_grad.dtype == torch.float32
        errors[name] = rel_err(p_fused.main_grad.double(), p_plain.grad)
    return errors
