"""Per-layer checks run inside every rank: TSP layer vs a single-process reference.

Each rank's tokens and the reference rows it is compared with are taken with
``tests.common.zigzag_rows`` (the zigzag written from its definition), not with the package's
``zigzag`` / ``TSPLayout``, which the attention layer itself uses."""

from __future__ import annotations

import contextlib
import gc
import math
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules

from megatron_tsp.core import sharding
from megatron_tsp.core.layers.attention import TSPSelfAttention
from megatron_tsp.core.layers.mlp import TSPMLP, make_activation
from tests.common import (
    DTYPES,
    FUSIONS_OFF,
    TOL,
    assert_close,
    group_info,
    make_config,
    setup_tsp,
    stock_mlp,
    zigzag_rows,
)


def _grad_pairs(module, full_grads, group, actual, expected):
    """Add each parameter's gradient on this rank (``grad:<name>``) and the reference's slice."""
    import torch.distributed as dist

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    for name, param in module.named_parameters():
        if param.grad is None:
            raise AssertionError(f"{name}: no gradient")
        grad = param.grad.clone()
        sharded, dim, stride = sharding.sharding_of(param)
        if sharded:
            want = sharding.shard(full_grads[name], dim, stride, size, rank)
        else:  # replicated: each rank saw its own tokens; the group sum is the full gradient
            dist.all_reduce(grad, group=group)
            want = full_grads[name]
        actual[f"grad:{name}"] = grad
        expected[f"grad:{name}"] = want


ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu, "squared_relu": squared_relu}


@contextlib.contextmanager
def forced_activation_kernel(enabled=True):
    """TSP's activation kernel chosen as on CUDA (here it runs in Triton's interpreter) while
    inside; yields the list of its calls' ``(kind, rows of the fc1 output)``. ``enabled`` False:
    nothing changes, the list stays empty."""
    from megatron_tsp.core.layers import activation_kernel

    calls = []
    saved = activation_kernel.available, activation_kernel.act_backward_into

    def counted(kind, pre, *rest):
        calls.append((kind, pre.shape[0]))
        return saved[1](kind, pre, *rest)

    if enabled:
        activation_kernel.available = lambda device, dtype: dtype in activation_kernel.DTYPES
        activation_kernel.act_backward_into = counted
    try:
        yield calls
    finally:
        activation_kernel.available, activation_kernel.act_backward_into = saved


def check_mlp(
    d,
    seed,
    dtype_name,
    gated,
    bias,
    seq,
    batch,
    hidden,
    ffn,
    activation="gelu",
    recompute_activation=True,
    fusions="megatron-lm",
    offload_hooks=False,
    triton_kernel=False,
    config_fields=None,
):
    """TSP MLP on zigzag tokens vs megatron-core's stock ``MLP`` (TP=1) on the full sequence:
    output, input gradient and every weight gradient. ``fusions``: "megatron-lm" (the defaults,
    fused bias-GeLU / SwiGLU) or "off". ``triton_kernel``: the activation backward in TSP's
    Triton kernel (``activation_kernel``, chosen on CUDA), here on CPU tensors in Triton's
    interpreter, its launches counted (one per shard).

    ``offload_hooks``: the TSP forward runs under ``saved_tensors_hooks`` that emulate activation
    offloading (``--cpu-offloading``): pack stores a copy and drops the tensor, the backward gets
    the copy back. Every tensor the backward needs must go through them: the packed tensors are
    exactly the input, the weights and (when fc1 is not recomputed) the D per-shard fc1 outputs,
    each unpacked once, and no packed activation outlives the forward elsewhere (its memory is
    really released).

    ``config_fields``: more ``TransformerConfig`` fields, the same in TSP's and the reference's
    config (the GLU's clamp / offset, the fused SwiGLU's FP8 input store)."""
    dtype = DTYPES[dtype_name]
    setup_tsp(d)
    group, size, rank = group_info()
    fields = dict(
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        gated_linear_unit=gated,
        add_bias_linear=bias,
        activation_func=ACTIVATIONS[activation],
    )
    if fusions == "off":
        fields.update(FUSIONS_OFF)
    fields.update(config_fields or {})
    config = make_config(d, dtype, **fields)
    layer = TSPMLP(
        config,
        MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        recompute_activation=recompute_activation,
    )
    reference = stock_mlp(make_config(1, dtype, **fields))
    torch.manual_seed(seed)  # same full weights and data on every rank, fresh per run
    full = {n: torch.randn(p.shape, dtype=dtype) * 0.2 for n, p in reference.named_parameters()}
    with torch.no_grad():
        for n, p in reference.named_parameters():
            p.copy_(full[n])
    sharding.load_full_state(layer, full, group)
    x_full = torch.randn(seq, batch, hidden, dtype=dtype)
    dy_full = torch.randn(seq, batch, hidden, dtype=dtype)

    xr = x_full.clone().requires_grad_(True)
    out_r, bias_r = reference(xr)
    yr = out_r + bias_r if bias_r is not None else out_r
    yr.backward(dy_full)

    x = zigzag_rows(x_full, size, rank).requires_grad_(True)
    packed, originals, unpacked = [], [], []

    def pack(t):
        packed.append(tuple(t.shape))
        if not any(t is keep for keep in (x, *layer.parameters())):
            originals.append(weakref.ref(t))
        return t.detach().clone()  # the "offloaded" copy; the original is not kept

    def unpack(copy):
        unpacked.append(tuple(copy.shape))
        return copy

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    with hooks if offload_hooks else contextlib.nullcontext():
        out, out_bias = layer(x)
    if offload_hooks:
        gc.collect()
        alive = [ref().shape for ref in originals if ref() is not None]
        rows = (2 if gated else 1) * ffn // size
        params = [p for p in (layer.linear_fc1.weight, layer.linear_fc1.bias) if p is not None]
        expected_packed = [tuple(x.shape)] + [tuple(p.shape) for p in params]
        expected_packed += [tuple(layer.linear_fc2.weight.shape)]
        if not recompute_activation:  # every shard's fc1 output, one tensor
            expected_packed += [(x.shape[0] * x.shape[1], size, rows)]
        assert sorted(packed) == sorted(expected_packed), (
            f"saved tensors seen by the hooks {packed}, expected {expected_packed}"
        )
        assert not alive, f"packed activations still alive after the forward: {alive}"
    y = out + out_bias if out_bias is not None else out
    with forced_activation_kernel(triton_kernel) as calls:
        y.backward(zigzag_rows(dy_full, size, rank))
    launches = [kind for kind, _ in calls]
    if triton_kernel:
        kind = "swiglu" if gated else ("gelu_tanh" if fusions == "megatron-lm" else "gelu")
        if make_activation(config).kernel_kind is None:  # no kernel has this formula
            kind, size_launched = None, 0
        else:
            size_launched = size
        assert launches == [kind] * size_launched, f"activation kernel launches {launches}"
    if offload_hooks:
        assert sorted(unpacked) == sorted(packed), (unpacked, packed)
    actual = {"output": y, "grad:input": x.grad}
    expected = {
        "output": zigzag_rows(yr, size, rank),
        "grad:input": zigzag_rows(xr.grad, size, rank),
    }
    _grad_pairs(
        layer, {n: p.grad for n, p in reference.named_parameters()}, group, actual, expected
    )
    return assert_close(
        actual,
        expected,
        rtol=TOL[dtype],
        what=f"TSP MLP D={d} {dtype_name} {activation} gated={gated} fusions={fusions} seed={seed}",
    )


def reference_attention(
    x, qkv_w, qkv_b, proj_w, proj_b, heads, groups, rope_freqs, config, head_dim=None, scale=None
):
    """Full-sequence causal self-attention with Megatron's per-query-group QKV layout.
    ``head_dim``: the head dimension (``kv_channels``) when it is not hidden / heads; ``scale``:
    the softmax scale when it is not 1/sqrt(head dim)."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    s, b, h = x.shape
    hn = head_dim or h // heads
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
    scores = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(hn) if scale is None else scale)
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    ctx = (probs @ v).permute(2, 0, 1, 3).reshape(s, b, heads * hn)
    out = ctx @ proj_w.t()
    return out + proj_b if proj_b is not None else out


class _FusedRopeStandIn:
    """Stands in for ``rope_utils.fused_apply_rotary_pos_emb`` (Transformer Engine's fused RoPE,
    absent on CPU) with its contract: [s, b, h, d] input of any strides, [s, 1, 1, rot] angles,
    ``interleaved``, a new output tensor. Computes with Megatron's unfused formula and
    counts its calls, so the test sees that the layer took the fused path and that its backward
    (a call with the negated angles) inverts it."""

    def __init__(self):
        self.calls = 0

    def __call__(self, t, freqs, transpose_output_memory=False, interleaved=False):
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

        assert t.dim() == 4 and freqs.shape[1:3] == (1, 1), (t.shape, freqs.shape)
        self.calls += 1
        return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)


def attention_with_random_weights(config, attention_backward, seed, dtype, group):
    """A ``TSPSelfAttention`` (Megatron's local submodules) and the full random weights, scaled
    by 0.3 and drawn from ``seed``, it holds its shards of: ``(layer, full state)``."""
    layer = TSPSelfAttention(
        config,
        SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=DotProductAttention,
            linear_proj=RowParallelLinear,
        ),
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_backward=attention_backward,
    )
    torch.manual_seed(seed)
    size = dist.get_world_size(group)
    full = {}
    for n, p in layer.named_parameters():
        sharded, dim, _ = sharding.sharding_of(p)
        shape = list(p.shape)
        if sharded:
            shape[dim] *= size
        full[n] = torch.randn(shape, dtype=dtype) * 0.3
    sharding.load_full_state(layer, full, group)
    return layer, full


def check_attention(
    d,
    seed,
    dtype_name,
    heads,
    groups,
    bias,
    rope,
    seq,
    batch,
    hidden,
    attention_backward="saved",
    rotary_interleaved=False,
    rotary_percent=1.0,
    rope_fusion=False,
    kv_grad_all_to_all=False,
    triton_kernels=False,
    kv_channels=None,
    softmax_scale=None,
    no_rope_freq=None,
):
    """``kv_channels``: a head dimension other than hidden / heads (``--kv-channels``; the
    reference is given it explicitly). ``rope_fusion``: ``apply_rope_fusion`` on, with
    ``_FusedRopeStandIn`` as Megatron's fused kernel (the reference keeps the unfused formula).
    ``kv_grad_all_to_all``: dK/dV summed by an all-to-all (``config.tsp_kv_grad_all_to_all``).
    ``triton_kernels``: TSP's Triton kernels, chosen on CUDA (``rope_kernel``,
    ``row_sum_kernel``), here on CPU tensors in Triton's interpreter, their launches counted.
    ``softmax_scale``: the config's attention scale (the reference uses it instead of
    1/sqrt(head dim)). ``no_rope_freq``: the config's NoPE pattern (the layer is layer 1: with
    ``no_rope_freq[0]`` set the layer is given the rotary table and must not apply it; the
    reference gets none)."""
    import copy

    from megatron.core.models.common.embeddings import rope_utils

    from megatron_tsp.core.layers import rope_kernel, row_sum_kernel

    dtype = DTYPES[dtype_name]
    setup_tsp(d)
    group, size, rank = group_info()
    config = make_config(
        d,
        dtype,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        add_bias_linear=bias,
        rotary_interleaved=rotary_interleaved,
        **({} if kv_channels is None else dict(kv_channels=kv_channels)),
        **({} if softmax_scale is None else dict(softmax_scale=softmax_scale)),
        **({} if no_rope_freq is None else dict(no_rope_freq=no_rope_freq)),
    )
    head_dim = kv_channels or hidden // heads
    ref_config = copy.copy(config)
    config.tsp_kv_grad_all_to_all = kv_grad_all_to_all
    layer, full = attention_with_random_weights(config, attention_backward, seed, dtype, group)
    x_full = torch.randn(seq, batch, hidden, dtype=dtype)
    dy_full = torch.randn(seq, batch, hidden, dtype=dtype)
    freqs = None
    if rope:
        freqs = RotaryEmbedding(
            kv_channels=head_dim,
            rotary_percent=rotary_percent,
            rotary_interleaved=rotary_interleaved,
            use_cpu_initialization=True,
        )(seq).to(dtype)

    ref = {n: t.clone().requires_grad_(True) for n, t in full.items()}
    xr = x_full.clone().requires_grad_(True)
    yr = reference_attention(
        xr,
        ref["linear_qkv.weight"],
        ref.get("linear_qkv.bias"),
        ref["linear_proj.weight"],
        ref.get("linear_proj.bias"),
        heads,
        groups,
        None if no_rope_freq and no_rope_freq[0] else freqs,
        ref_config,
        head_dim=head_dim,
        scale=softmax_scale,
    )
    yr.backward(dy_full)

    x = zigzag_rows(x_full, size, rank).requires_grad_(True)
    stand_in, saved_fused = _FusedRopeStandIn(), rope_utils.fused_apply_rotary_pos_emb
    saved_kernel = (rope_kernel.available, rope_kernel.rope_into)
    saved_row_sum = (row_sum_kernel.available, row_sum_kernel.sum_rows_into)
    launches, row_sums = [], []
    if rope_fusion:
        config.apply_rope_fusion = True  # after construction: TransformerConfig wants TE
        rope_utils.fused_apply_rotary_pos_emb = stand_in
    if triton_kernels:
        rope_kernel.available = lambda device, dtype: dtype in rope_kernel.DTYPES
        rope_kernel.rope_into = lambda *a: (launches.append(1), saved_kernel[1](*a))[1]
        row_sum_kernel.available = lambda device, dtype: dtype in row_sum_kernel.DTYPES
        row_sum_kernel.sum_rows_into = lambda *a: (row_sums.append(1), saved_row_sum[1](*a))[1]
    try:
        out, out_bias = layer(x, attention_mask=None, rotary_pos_emb=freqs)
        y = out + out_bias if out_bias is not None else out
        y.backward(zigzag_rows(dy_full, size, rank))
    finally:
        rope_utils.fused_apply_rotary_pos_emb = saved_fused
        rope_kernel.available, rope_kernel.rope_into = saved_kernel
        row_sum_kernel.available, row_sum_kernel.sum_rows_into = saved_row_sum
    # q and k per head group: forward, backward (and recomputed forward)
    expected_calls = (4 if attention_backward == "saved" else 6) * size
    if rope_fusion:
        assert stand_in.calls == expected_calls, f"fused RoPE called {stand_in.calls} times"
    if triton_kernels:
        assert len(launches) == expected_calls, f"RoPE kernel launched {len(launches)} times"
        # dK and dV of each of the D head groups, once per backward
        assert len(row_sums) == 2 * size, f"row-sum kernel launched {len(row_sums)} times"
    actual = {"output": y, "grad:input": x.grad}
    expected = {
        "output": zigzag_rows(yr, size, rank),
        "grad:input": zigzag_rows(xr.grad, size, rank),
    }
    _grad_pairs(layer, {n: t.grad for n, t in ref.items()}, group, actual, expected)
    return assert_close(
        actual,
        expected,
        rtol=TOL[dtype],
        what=f"TSP attention D={d} {dtype_name} heads={heads}/{groups} hidden={hidden} "
        f"kv_channels={head_dim} "
        f"rope={rope} interleaved={rotary_interleaved} rotary_percent={rotary_percent} "
        f"fused={rope_fusion} triton={triton_kernels} backward={attention_backward} "
        f"a2a={kv_grad_all_to_all} softmax_scale={softmax_scale} no_rope_freq={no_rope_freq} "
        f"seed={seed}",
    )


def _build_layer(kind, config, **kwargs):
    if kind == "mlp":
        return TSPMLP(
            config,
            MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            **kwargs,
        )
    return TSPSelfAttention(
        config,
        SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=DotProductAttention,
            linear_proj=RowParallelLinear,
        ),
        layer_number=1,
        **kwargs,
    )


def check_main_grad_contract(d, seed, kind, zero_out_wgrad=False):
    """With gradient-accumulation fusion, weight grads land in ``main_grad`` (fp32, accumulated
    over two backward passes) and autograd's ``.grad`` is a flagged dummy — Megatron DDP's
    contract. With ``param.zero_out_wgrad`` (set by Megatron DDP) the dummy must be zeros, not
    uninitialised memory: the check runs with torch's deterministic mode, which fills
    uninitialised floats with NaN, so garbage cannot pass as zeros by luck."""
    setup_tsp(d)
    group, size, rank = group_info()
    torch.manual_seed(seed)
    x = torch.randn(16 // size, 2, 32, dtype=torch.float64)
    dy = torch.randn(16 // size, 2, 32, dtype=torch.float64)

    def build():
        return _build_layer(
            kind,
            make_config(
                d, torch.float64, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4
            ),
        )

    def run(layer):
        out, _ = layer(x.clone().requires_grad_(True))
        out.backward(dy)

    plain = build()
    fused = build()
    fused.load_state_dict(plain.state_dict())
    fused.gradient_accumulation_fusion = True
    sharded = [p for p in fused.parameters() if getattr(p, "tensor_model_parallel", False)]
    assert sharded, "no tensor-parallel parameters"
    for p in sharded:
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        p.grad_added_to_main_grad = False
        if zero_out_wgrad:
            p.zero_out_wgrad = True
    deterministic = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        run(plain)
        run(plain)
        run(fused)
        run(fused)
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    actual, expected = {}, {}
    for (name, p_plain), p_fused in zip(plain.named_parameters(), fused.parameters()):
        if not getattr(p_fused, "tensor_model_parallel", False):
            continue
        assert p_fused.grad_added_to_main_grad, f"{name}: grad_added_to_main_grad not set"
        assert p_fused.main_grad.dtype == torch.float32, name
        actual[f"main_grad:{name}"] = p_fused.main_grad.double()
        expected[f"main_grad:{name}"] = p_plain.grad
        if zero_out_wgrad:  # autograd's dummy .grad: exactly zero (NaN if left uninitialised)
            actual[f"grad:{name}"] = p_fused.grad
            expected[f"grad:{name}"] = torch.zeros_like(p_fused)
    errors = assert_close(
        actual,
        expected,
        rtol=1e-6,
        atol=0.0,  # main_grad is fp32
        what=f"{kind} main_grad D={d} zero_out_wgrad={zero_out_wgrad} seed={seed}",
    )
    if zero_out_wgrad:
        for name, value in actual.items():
            if name.startswith("grad:") and torch.count_nonzero(value).item() != 0:
                raise AssertionError(f"{name}: zero_out_wgrad dummy gradient is not all zeros")
    return errors


def _fd_attention_loss(layer, x, dy, dropout_seed, group):
    """sum over the group of <dy, attention(x) + proj bias>, the dropout RNG reseeded first (the
    same mask on every evaluation)."""
    import torch.distributed as dist

    torch.manual_seed(dropout_seed)
    out, out_bias = layer(x)
    y = out + out_bias if out_bias is not None else out
    total = (y * dy).sum().reshape(1)
    dist.all_reduce(total, group=group)
    return total


def check_attention_dropout_grads(d, seed, attention_backward, dropout=0.3, step=1e-6):
    """Attention dropout > 0 (backward recomputes attention and must replay the forward's dropout
    masks): analytic gradients of the TSP layer vs central finite differences, fp64, the dropout
    RNG reseeded before every evaluation. Per tensor (input, each weight, bias) a random direction
    v: ``<grad, v>`` summed over the group vs ``(L(w + h v) - L(w - h v)) / 2h``."""
    import torch.distributed as dist

    setup_tsp(d)
    group, size, rank = group_info()
    config = make_config(
        d,
        torch.float64,
        hidden_size=32,
        num_attention_heads=8,
        num_query_groups=4,
        add_bias_linear=True,
        attention_dropout=dropout,
    )
    layer = _build_layer(
        "attention",
        config,
        attn_mask_type=AttnMaskType.causal,
        attention_backward=attention_backward,
    )
    layer.train()
    torch.manual_seed(seed + 1000 * rank)  # this rank's tokens and sharded weights
    with torch.no_grad():
        for p in layer.parameters():
            if getattr(p, "tensor_model_parallel", False):
                p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(16 // size, 2, 32, dtype=torch.float64)
    dy = torch.randn_like(x)
    torch.manual_seed(seed)  # replicated parameters: identical on every rank
    with torch.no_grad():
        for p in layer.parameters():
            if not getattr(p, "tensor_model_parallel", False):
                p.copy_(torch.randn_like(p) * 0.3)
    dropout_seed = seed + 7

    # the masks really drop something: two RNG states give different outputs
    with torch.no_grad():
        a = _fd_attention_loss(layer, x, dy, dropout_seed, group)
        b = _fd_attention_loss(layer, x, dy, dropout_seed + 1, group)
        if torch.equal(a, b):
            raise AssertionError("attention dropout had no effect: the check would be vacuous")

    # Analytic gradients: each rank backpropagates its own tokens' term of the loss; the TSP
    # backward routes every cross-rank contribution (K/V, weight shards) to its owner.
    torch.manual_seed(dropout_seed)
    x_leaf = x.clone().requires_grad_(True)
    out, out_bias = layer(x_leaf)
    ((out + out_bias) * dy).sum().backward()

    tensors = {"input": (x, x_leaf.grad)}
    for name, p in layer.named_parameters():
        tensors[name] = (p.data, p.grad)
    analytic, numeric = {}, {}
    for i, (name, (value, grad)) in enumerate(tensors.items()):
        replicated = name != "input" and not getattr(
            dict(layer.named_parameters())[name], "tensor_model_parallel", False
        )
        gen = torch.Generator().manual_seed(seed + 31 * i + (0 if replicated else 1000 * rank))
        v = torch.randn(value.shape, dtype=value.dtype, generator=gen)
        inner = (grad * v).sum().reshape(1)
        dist.all_reduce(inner, group=group)
        with torch.no_grad():
            value.add_(v, alpha=step)
            plus = _fd_attention_loss(layer, x, dy, dropout_seed, group)
            value.add_(v, alpha=-2 * step)
            minus = _fd_attention_loss(layer, x, dy, dropout_seed, group)
            value.add_(v, alpha=step)
        analytic[f"d/d {name}"] = inner
        numeric[f"d/d {name}"] = (plus - minus) / (2 * step)
    # central differences in fp64 with h = 1e-6: their own error reached 1.9e-6 of the largest
    # directional derivative on some seeds (a wrong dropout mask or routing errs by O(1))
    return assert_close(
        analytic,
        numeric,
        rtol=1e-5,
        what=f"attention dropout={dropout} backward={attention_backward} D={d} "
        f"gradient vs finite differences, seed={seed}",
    )


def check_attention_eval_disables_dropout(d, seed, dropout=0.5):
    """``eval()`` turns attention dropout off: the output equals the dropout-free reference.
    In ``train()`` the same layer differs from it (so dropout is really configured)."""
    setup_tsp(d)
    group, size, rank = group_info()
    heads, groups, hidden, seq, batch = 8, 4, 32, 16, 2
    config = make_config(
        d,
        torch.float64,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        add_bias_linear=True,
        attention_dropout=dropout,
    )
    layer = _build_layer("attention", config, attn_mask_type=AttnMaskType.causal)
    torch.manual_seed(seed)
    full = {}
    for n, p in layer.named_parameters():
        sharded, dim, _ = sharding.sharding_of(p)
        shape = list(p.shape)
        if sharded:
            shape[dim] *= size
        full[n] = torch.randn(shape, dtype=torch.float64) * 0.3
    sharding.load_full_state(layer, full, group)
    x_full = torch.randn(seq, batch, hidden, dtype=torch.float64)
    ref = reference_attention(
        x_full,
        full["linear_qkv.weight"],
        full["linear_qkv.bias"],
        full["linear_proj.weight"],
        full["linear_proj.bias"],
        heads,
        groups,
        None,
        config,
    )
    expected = zigzag_rows(ref, size, rank)
    x = zigzag_rows(x_full, size, rank)

    def output():
        with torch.no_grad():
            out, out_bias = layer(x)
        return out + out_bias

    layer.eval()
    errors = assert_close(
        output(),
        expected,
        rtol=1e-10,
        name="eval output",
        what=f"attention dropout={dropout} in eval(), D={d}, seed={seed}",
    )
    layer.train()
    train_error = (output() - expected).abs().max().item() / expected.abs().max().item()
    if not train_error > 1e-3:
        raise AssertionError(
            f"train() output equals the dropout-free reference "
            f"(relative difference {train_error:.1e}): dropout is not active"
        )
    return errors
