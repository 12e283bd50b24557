"""(a) Each TSP layer vs a single-process reference, D in {1, 2, 4}, fp64 and fp32; attention
dropout, eval mode and Megatron's main_grad contract.

The MLP reference is megatron-core's stock ``MLP`` at TP=1 (so the activation, fused bias-GeLU
included, is Megatron's choice, not ours); the attention reference is written from the formula.
Every comparison runs inside the ranks through ``tests.common.assert_close`` (fails on NaN/Inf,
names the worst tensor); a failing rank's message reaches the test through the rank pool.
"""

import pytest
import torch
import torch.nn.functional as F

from tests import checks_layers
from tests.common import FUSIONS_OFF, make_config

DS = [1, 2, 4]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("d", DS)
@pytest.mark.parametrize(
    "gated,bias,activation,seq,batch,hidden,ffn,recompute",
    [
        (False, True, "gelu", 16, 2, 16, 32, True),  # GPT-2 style: Megatron's fused tanh-GeLU
        (True, False, "silu", 24, 3, 24, 40, True),  # SwiGLU, uneven sizes (ffn/D = 10)
        (True, True, "silu", 16, 2, 16, 32, False),  # fc1 outputs kept instead of recomputed
    ],
)
def test_mlp_matches_reference(
    pool4, seed, d, dtype, gated, bias, activation, seq, batch, hidden, ffn, recompute
):
    pool4.run(
        checks_layers.check_mlp,
        d,
        seed,
        dtype,
        gated=gated,
        bias=bias,
        seq=seq,
        batch=batch,
        hidden=hidden,
        ffn=ffn,
        activation=activation,
        recompute_activation=recompute,
    )


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize(
    "gated,bias,recompute,fusions",
    [
        (False, True, False, "megatron-lm"),  # Megatron's fused tanh-GeLU
        (True, False, False, "megatron-lm"),  # fused SwiGLU
        (True, True, True, "megatron-lm"),  # fc1 recomputed
        (False, True, False, "off"),  # the exact GeLU
        (True, False, False, "off"),  # the unfused gated SiLU
    ],
)
def test_mlp_triton_kernel(pool4, seed, d, gated, bias, recompute, fusions):
    """TSP's activation kernel, the CUDA default for Megatron's GeLU / SwiGLU, fused or not (the
    activation recomputed and its backward in one launch per shard, d(fc1 output) written into
    its columns of the one dgrad GEMM's operand), run here in Triton's interpreter: fp32 parity
    with megatron-core's stock MLP, forward and backward."""
    pool4.run(
        checks_layers.check_mlp,
        d,
        seed,
        "float32",
        gated=gated,
        bias=bias,
        seq=24,
        batch=2,
        hidden=32,
        ffn=48,
        activation="silu" if gated else "gelu",
        recompute_activation=recompute,
        fusions=fusions,
        triton_kernel=True,
    )


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("recompute", [False, True])
def test_mlp_saved_tensors_go_through_hooks(pool4, seed, d, recompute):
    """Activation offloading (``saved_tensors_hooks`` packing to a copy, as ``--cpu-offloading``
    does) sees every tensor the MLP backward uses, releases them, and the result still equals
    the stock MLP in fp64."""
    pool4.run(
        checks_layers.check_mlp,
        d,
        seed,
        "float64",
        gated=True,
        bias=True,
        seq=16,
        batch=2,
        hidden=16,
        ffn=32,
        activation="silu",
        recompute_activation=recompute,
        offload_hooks=True,
    )


@pytest.mark.parametrize(
    "gated,bias,activation",
    [
        (False, True, "gelu"),  # exact erf-GeLU (--no-bias-gelu-fusion)
        (False, False, "silu"),  # plain SiLU: Megatron has no fused kernel for it
        (True, True, "gelu"),  # GeGLU unfused
        (False, False, "squared_relu"),  # --squared-relu (megatron-core's activation)
    ],
)
def test_mlp_unfused_activations(pool4, seed, gated, bias, activation):
    """FUSIONS_OFF: Megatron's unfused MLP path (the activation applied as given)."""
    pool4.run(
        checks_layers.check_mlp,
        4,
        seed,
        "float64",
        gated=gated,
        bias=bias,
        seq=16,
        batch=2,
        hidden=16,
        ffn=32,
        activation=activation,
        recompute_activation=True,
        fusions="off",
    )


def test_mlp_fused_gelu_is_megatrons_tanh_approximation():
    """Under Megatron-LM's default fusion the TSP MLP applies Megatron's fused bias-GeLU (tanh
    approximation), not the exact GeLU; without fusion the exact one. The two differ (so the
    parity tests above can tell them apart)."""
    from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl

    from megatron_tsp.core.layers.mlp import make_activation

    x = torch.randn(8, 2, 16, dtype=torch.float64)
    fused = make_activation(make_config(1, torch.float64))(x)
    exact = make_activation(make_config(1, torch.float64, **FUSIONS_OFF))(x)
    assert torch.equal(fused, bias_gelu_impl(x, torch.zeros((), dtype=torch.float64)))
    assert torch.equal(exact, F.gelu(x))
    assert (fused - exact).abs().max().item() > 1e-5


@pytest.mark.parametrize(
    "fields,message",
    [
        (
            dict(activation_func=F.relu, gated_linear_unit=True),
            "activation_func=torch.nn.functional.relu with gated_linear_unit=True has no fused "
            "bias-activation kernel in Megatron's MLP (it fuses only GeLU, GeGLU and SwiGLU): set "
            "bias_activation_fusion=False (--no-bias-gelu-fusion / --no-bias-swiglu-fusion) to use "
            "it under TSP",
        ),
        (
            dict(activation_func=F.silu, gated_linear_unit=False),
            "activation_func=torch.nn.functional.silu with gated_linear_unit=False has no fused "
            "bias-activation kernel in Megatron's MLP (it fuses only GeLU, GeGLU and SwiGLU): set "
            "bias_activation_fusion=False (--no-bias-gelu-fusion / --no-bias-swiglu-fusion) to use "
            "it under TSP",
        ),
        (
            dict(activation_func="quick_gelu", gated_linear_unit=True),
            "activation_func=megatron.core.fusions.fused_bias_geglu.quick_gelu with "
            "gated_linear_unit=True has no fused bias-activation kernel in Megatron's MLP "
            "(it fuses only GeLU, GeGLU and SwiGLU): set bias_activation_fusion=False "
            "(--no-bias-gelu-fusion "
            "/ --no-bias-swiglu-fusion) to use it under TSP",
        ),
    ],
    ids=["reglu", "silu-ungated", "quick-geglu"],
)
def test_mlp_refuses_activation_without_fused_kernel(fields, message):
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    from megatron_tsp.core.layers.mlp import make_activation

    if fields["activation_func"] == "quick_gelu":
        fields = dict(fields, activation_func=quick_gelu)
    # Built unfused, then switched: TransformerConfig itself refuses some of these with fusion
    # on; the others pass it and only fail in Megatron's MLP forward.
    config = make_config(1, torch.float64, **fields, **FUSIONS_OFF)
    config.bias_activation_fusion = True
    with pytest.raises(ValueError) as info:
        make_activation(config)
    assert str(info.value) == message


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("d", DS)
@pytest.mark.parametrize(
    "heads,groups,bias,rope,seq,batch,hidden,backward",
    [
        (4, 4, True, False, 16, 2, 32, "saved"),  # MHA with biases, no RoPE
        (8, 4, False, True, 24, 3, 64, "saved"),  # GQA 2:1, RoPE, no bias, S/2D uneven (3 at D=4)
        (8, 4, True, True, 16, 2, 64, "recompute"),  # attention forward recomputed in backward
        # fewer K/V heads than D (megatron-core's TP layout: one K/V head shared by D/ng ranks)
        (8, 2, True, True, 16, 2, 64, "saved"),  # ng=2: D=4 shares each K/V head over 2 shards
        (8, 1, False, True, 24, 3, 64, "saved"),  # ng=1 (MQA): every shard shares one K/V head
        (8, 1, True, False, 16, 2, 64, "recompute"),
    ],
)
def test_attention_matches_reference(
    pool4, seed, d, dtype, heads, groups, bias, rope, seq, batch, hidden, backward
):
    pool4.run(
        checks_layers.check_attention,
        d,
        seed,
        dtype,
        heads=heads,
        groups=groups,
        bias=bias,
        rope=rope,
        seq=seq,
        batch=batch,
        hidden=hidden,
        attention_backward=backward,
    )


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize(
    "heads,groups,hidden,kv_channels,bias,backward",
    [
        (4, 4, 64, 32, True, "saved"),  # MHA, head dim 32 > hidden / heads = 16
        (8, 4, 64, 4, False, "recompute"),  # GQA 2:1, head dim 4 < 8
        (8, 2, 48, 12, True, "saved"),  # 2 K/V heads (< D at D=4), head dim 12 > 6
        (8, 1, 64, 6, True, "recompute"),  # MQA, head dim 6 < 8
        (8, 4, 36, 8, False, "saved"),  # hidden 36 not a multiple of the 8 heads
    ],
)
def test_attention_kv_channels(pool4, seed, d, heads, groups, hidden, kv_channels, bias, backward):
    """A head dimension other than hidden / heads (``kv_channels``, --kv-channels: Qwen3,
    Mistral-Nemo), larger and smaller, RoPE, fp64: the reference is given the head dimension
    explicitly, so a layer that uses hidden / heads fails."""
    pool4.run(
        checks_layers.check_attention,
        d,
        seed,
        "float64",
        heads=heads,
        groups=groups,
        bias=bias,
        rope=True,
        seq=16,
        batch=2,
        hidden=hidden,
        attention_backward=backward,
        kv_channels=kv_channels,
    )


@pytest.mark.parametrize(
    "d,groups,backward", [(2, 4, "saved"), (4, 8, "recompute"), (4, 2, "saved")]
)
def test_attention_kv_grad_all_to_all(pool4, seed, d, groups, backward):
    """dK/dV summed over the group by an all-to-all and an fp32 add at the owner
    (--tsp-kv-grad-all-to-all) instead of the reduce-scatter: fp64 parity, MHA, GQA and fewer
    K/V heads than D."""
    pool4.run(
        checks_layers.check_attention,
        d,
        seed,
        "float64",
        heads=8,
        groups=groups,
        bias=True,
        rope=True,
        seq=16,
        batch=2,
        hidden=64,
        attention_backward=backward,
        kv_grad_all_to_all=True,
    )


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize(
    "interleaved,percent,fused,backward",
    [
        (True, 1.0, False, "saved"),  # interleaved pairs (2k, 2k+1)
        (False, 0.5, False, "recompute"),  # partial rotary: half of each head passes through
        (False, 1.0, True, "saved"),  # apply_rope_fusion (a stand-in for TE's kernel)
        (True, 0.5, True, "recompute"),
    ],
)
def test_attention_rope_variants(pool4, seed, d, interleaved, percent, fused, backward):
    """RoPE options against the reference (Megatron's unfused RoPE), fp64, GQA: the unfused
    path's tables and swapped-channel formula, and the fused path's kernel calls, backward
    included (the inverse rotation, never autograd)."""
    pool4.run(
        checks_layers.check_attention,
        d,
        seed,
        "float64",
        heads=8,
        groups=4,
        bias=True,
        rope=True,
        seq=24,
        batch=2,
        hidden=64,
        attention_backward=backward,
        rotary_interleaved=interleaved,
        rotary_percent=percent,
        rope_fusion=fused,
    )


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize(
    "interleaved,percent,backward",
    [(False, 1.0, "saved"), (True, 0.5, "recompute")],
)
def test_attention_triton_kernels(pool4, seed, d, interleaved, percent, backward):
    """TSP's Triton kernels, the CUDA default (``rope_kernel``: RoPE in one launch;
    ``row_sum_kernel``: each head group's dK and dV summed into the send buffer in one launch
    each), run here in Triton's interpreter: fp32 parity with the reference (Megatron's unfused
    RoPE), forward and backward (the RoPE inverse is the adjoint), their launch counts."""
    pool4.run(
        checks_layers.check_attention,
        d,
        seed,
        "float32",
        heads=8,
        groups=4,
        bias=True,
        rope=True,
        seq=24,
        batch=2,
        hidden=64,
        attention_backward=backward,
        rotary_interleaved=interleaved,
        rotary_percent=percent,
        triton_kernels=True,
    )


@pytest.mark.parametrize("backward", ["saved", "recompute"])
@pytest.mark.parametrize("d", [2, 4])
def test_attention_dropout_gradients_match_finite_differences(pool4, seed, d, backward):
    """Attention dropout > 0: backward replays the forward's dropout masks (both modes fall back
    to recompute with dropout)."""
    pool4.run(checks_layers.check_attention_dropout_grads, d, seed, backward)


def test_attention_eval_turns_dropout_off(pool4, seed):
    pool4.run(checks_layers.check_attention_eval_disables_dropout, 4, seed)


@pytest.mark.parametrize("zero_out_wgrad", [False, True])
@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_main_grad_contract(pool4, seed, kind, zero_out_wgrad):
    pool4.run(checks_layers.check_main_grad_contract, 2, seed, kind, zero_out_wgrad)


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize(
    "fields,fusions,dtype,bias,triton_kernel",
    [
        # Megatron's unfused GLU: x_glu clamped above, x_linear to [-c, c]
        (dict(activation_func_clamp_value=0.5), "off", "float64", True, False),
        # Megatron's unfused GLU: act(x_glu) * (x_linear + offset)
        (dict(glu_linear_offset=1.0), "off", "float64", True, False),
        # the fused SwiGLU saves its input rounded to float8_e4m3fn for the backward (no biases:
        # with an fc1 bias it is refused, test_mlp_fp8_input_store_with_bias_is_refused)
        (dict(activation_func_fp8_input_store=True), "megatron-lm", "float64", False, False),
        # the same where TSP would otherwise take its activation kernel (CUDA; here Triton's
        # interpreter): the backward must still be Megatron's, at the rounded input
        (dict(activation_func_fp8_input_store=True), "megatron-lm", "float32", False, True),
    ],
    ids=["clamp_0.5", "offset_1.0", "fp8_input_store", "fp8_input_store_kernel"],
)
def test_mlp_glu_options(pool4, seed, d, fields, fusions, dtype, bias, triton_kernel):
    """SwiGLU options off their defaults against megatron-core's stock MLP with the same config
    (output, input gradient, every weight gradient): the unfused GLU's clamp and linear offset,
    the fused SwiGLU's FP8 input store."""
    pool4.run(
        checks_layers.check_mlp,
        d,
        seed,
        dtype,
        gated=True,
        bias=bias,
        seq=16,
        batch=2,
        hidden=16,
        ffn=32,
        activation="silu",
        recompute_activation=True,
        fusions=fusions,
        triton_kernel=triton_kernel,
        config_fields=fields,
    )


def test_mlp_fp8_input_store_with_bias_is_refused():
    """Megatron's fused SwiGLU rounds the fc1 output to float8 before its bias is added; TSP's fc1
    output carries the bias, so that combination is refused by name, not run differently."""
    from megatron_tsp.core.layers.mlp import make_activation

    config = make_config(
        1, torch.float64, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=True
    )
    config.activation_func_fp8_input_store = True
    with pytest.raises(ValueError, match="activation_func_fp8_input_store"):
        make_activation(config)


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("backward", ["saved", "recompute"])
@pytest.mark.parametrize(
    "softmax_scale,no_rope_freq",
    [(0.3, None), (None, [1])],
    ids=["softmax_scale_0.3", "no_rope_freq_layer1"],
)
def test_attention_scale_and_nope(pool4, seed, d, backward, softmax_scale, no_rope_freq):
    """``softmax_scale`` other than 1/sqrt(head dim) (0.3; the head dim is 8), and a NoPE layer
    (``no_rope_freq=[1]``: layer 1 takes no RoPE although the model passes the table) against
    the reference with that scale / without RoPE, fp64, GQA, forward and backward."""
    pool4.run(
        checks_layers.check_attention,
        d,
        seed,
        "float64",
        heads=8,
        groups=4,
        bias=True,
        rope=True,
        seq=24,
        batch=2,
        hidden=64,
        attention_backward=backward,
        softmax_scale=softmax_scale,
        no_rope_freq=no_rope_freq,
    )
