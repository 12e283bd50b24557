"""TSP's one-kernel MLP activation backward (``megatron_tsp.core.layers.activation_kernel``), its
Triton kernel run in Triton's interpreter on CPU tensors: equal to Megatron's fused GeLU and
SwiGLU formulas (``bias_gelu`` / ``bias_gelu_back``, ``swiglu`` / ``swiglu_back``, evaluated in
fp64) in every dtype it takes, from and into strided slots, writing nothing else; its refusals;
when it is chosen. (The MLP's parity with it: ``tests/test_layers.py::test_mlp_triton_kernel``.)"""

import pytest
import torch

from megatron_tsp.core.layers import activation_kernel

triton = pytest.importorskip("triton")

# one rounding of an fp32 result, relative: half an ulp of the output dtype (a GPU rounds to
# nearest), a whole one for bf16 here: Triton's interpreter converts fp32 to bf16 by truncation.
# Below the dtype's smallest normal number the spacing stops shrinking (subnormals, then zero):
# there one rounding is that fraction of the smallest normal (fp16: 2**-25, half a subnormal step)
ROUNDING = {torch.float32: 2e-7, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-11}


def _megatron(kind, pre, g):
    """(h, d) by megatron-core's own fused-activation functions (torch's for the exact GeLU), in
    fp64."""
    from megatron.core.fusions import fused_bias_gelu, fused_bias_swiglu

    pre, g = pre.double(), g.double()
    if kind == "gelu":
        return torch.nn.functional.gelu(pre), torch.ops.aten.gelu_backward(g, pre)
    if kind == "gelu_tanh":
        zero = pre.new_zeros(())
        return fused_bias_gelu.bias_gelu(zero, pre), fused_bias_gelu.bias_gelu_back(g, zero, pre)
    return fused_bias_swiglu.swiglu(pre), fused_bias_swiglu.swiglu_back(g, pre)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["gelu_tanh", "gelu", "swiglu"])
def test_kernel_equals_megatrons_formulas_from_and_into_slots(seed, dtype, kind):
    g = torch.Generator().manual_seed(seed)
    n, shards, f = 9, 3, 40  # 40 columns: BLOCK_F 64 with a masked tail
    cols = 2 * f if kind == "swiglu" else f
    # pre: shard 1's columns of a [n, shards, cols] fc1 output; wide values reach both tails
    pre_all = (torch.randn(n, shards, cols, generator=g) * 4).to(dtype)
    pre = pre_all[:, 1]
    d_hidden = torch.randn(n, f, generator=g).to(dtype)
    holder = torch.full((n, shards, cols), float("nan"), dtype=dtype)
    d_pre = holder[:, 2]
    hidden = torch.empty(n, f, dtype=dtype)
    assert activation_kernel.act_backward_into(kind, pre, d_hidden, hidden, d_pre) is hidden
    ref_h, ref_d = _megatron(kind, pre, d_hidden)
    # fp32 arithmetic: a few fp32 ulps of the terms' magnitudes (GeLU's derivative subtracts
    # tanh^2 from 1 and scales it by up to ~0.1 x^3), then one rounding of the result
    x, gx = pre.double().abs(), d_hidden.double().abs()
    if kind.startswith("gelu"):
        terms = {"h": x, "d": gx * (1 + x * (0.8 + 0.11 * x * x))}
    else:
        a, b = x.chunk(2, -1)
        terms = {"h": a * b, "d": torch.cat([gx * (1 + a) * b, gx * a], -1)}
    for name, got, ref in (("h", hidden, ref_h), ("d", d_pre, ref_d)):
        rounded = ref.abs().clamp(min=torch.finfo(dtype).smallest_normal)
        bound = 1.01 * ROUNDING[dtype] * rounded + 8 * 2.0**-24 * terms[name]
        excess = ((got.double() - ref).abs() - bound).max().item()
        assert excess <= 0, f"seed={seed} {kind} {dtype} {name}: exceeds one rounding by {excess}"
    assert holder[:, [0, 1]].isnan().all(), "wrote outside the destination slot"


def test_kernel_refuses_what_it_cannot_do():
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="kind 'relu'"):
        activation_kernel.act_backward_into("relu", x, x, x, x)
    with pytest.raises(ValueError, match=r"swiglu.*expected \[\(4, 16\)"):
        activation_kernel.act_backward_into("swiglu", x, x, x, x)


def test_chosen_on_cuda_only_and_switchable(monkeypatch):
    assert not activation_kernel.available(torch.device("cpu"), torch.bfloat16)
    assert activation_kernel.available(torch.device("cuda"), torch.bfloat16)
    assert not activation_kernel.available(torch.device("cuda"), torch.float64)
    monkeypatch.setenv(activation_kernel.ENV, "torch")
    assert not activation_kernel.available(torch.device("cuda"), torch.bfloat16)
    monkeypatch.setenv(activation_kernel.ENV, "fused")
    with pytest.raises(ValueError, match="TSP_ACTIVATION_KERNEL='fused'"):
        activation_kernel.available(torch.device("cuda"), torch.bfloat16)
