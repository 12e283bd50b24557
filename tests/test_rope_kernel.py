"""TSP's one-kernel RoPE (``megatron_tsp.core.layers.rope_kernel``), its Triton kernel run in
Triton's interpreter on CPU tensors: the formula in every dtype it takes, strided sources and
destinations, interleaved pairs, partial rotary, the inverse as the exact adjoint; when it is
chosen; how the traffic recorder counts it. (The layer parity with it:
``tests/test_layers.py::test_attention_triton_kernels``.)"""

import pytest
import torch

from megatron_tsp.core.layers import rope_kernel

triton = pytest.importorskip("triton")


def _tables(t, rot, interleaved, generator):
    """fp32 (cos, signed sine) of random angles, pairs sharing an angle (as RoPE's)."""
    angles = torch.rand(t, rot // 2, generator=generator, dtype=torch.float64) * 6.3
    angles = angles.repeat_interleave(2, -1) if interleaved else angles.repeat(1, 2)
    sign = torch.ones(rot, dtype=torch.float64)
    if interleaved:
        sign[0::2] = -1
    else:
        sign[: rot // 2] = -1
    return torch.cos(angles).float(), (torch.sin(angles) * sign).float()


def _reference(x, cos, signed, interleaved, inverse):
    """The formula in fp64: out[i] = x[i] c[i] + x[p(i)] s[i] (inverse: s[p(i)])."""
    rot = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rot,)
    c, s = cos.double().view(shape), signed.double().view(shape)
    i = torch.arange(rot)
    partner = i ^ 1 if interleaved else torch.where(i < rot // 2, i + rot // 2, i - rot // 2)
    y = x.double().clone()
    y[..., :rot] = (
        x[..., :rot].double() * c + x[..., partner].double() * s[..., partner if inverse else i]
    )
    return y


# one rounding of an fp32 result, relative: half an ulp of the output dtype (a GPU rounds to
# nearest), a whole one for bf16 here: Triton's interpreter converts fp32 to bf16 by truncation
ROUNDING = {torch.float32: 2e-7, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-11}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("rot", [16, 8])
def test_kernel_equals_the_formula_at_any_strides(seed, dtype, interleaved, inverse, rot):
    g = torch.Generator().manual_seed(seed)
    t, a, b, d = 5, 3, 2, 16
    base = torch.randn(t, a, b + 1, d + 3, generator=g).to(dtype)
    x = base[:, :, 1:, 2 : d + 2]  # a strided source
    cos, signed = _tables(t, rot, interleaved, g)
    holder = torch.full((t, b, a, 2 * d), float("nan"), dtype=dtype)
    out = holder.transpose(1, 2)[..., ::2]  # a strided destination, other layout
    assert rope_kernel.rope_into(x, cos, signed, out, interleaved, inverse) is out
    ref = _reference(x, cos, signed, interleaved, inverse)
    # fp32 arithmetic on the terms (|x c| + |x_p s|), then one rounding of the result
    terms = _reference(x.abs(), cos.abs(), signed.abs(), interleaved, inverse)
    bound = 1.01 * ROUNDING[dtype] * ref.abs() + 4e-7 * terms
    excess = ((out.double() - ref).abs() - bound).max().item()
    assert excess <= 0, f"seed={seed}: error exceeds one rounding by {excess}"
    assert holder[..., 1::2].isnan().all(), "wrote outside the destination"
    if rot < d:  # channels past the rotary ones are copied
        assert torch.equal(out[..., rot:], x[..., rot:])


@pytest.mark.parametrize("inverse", [False, True])
def test_five_dimensions_into_a_slot_of_a_wider_row(seed, inverse):
    """The backward's q gradient [s, b, groups, heads per group, d] written into its slot of the
    layer's QKV gradient (each token's row wider than one group's: b and the groups cannot be
    merged into one dimension there)."""
    g = torch.Generator().manual_seed(seed)
    s, b, groups, per_group, d, rot = 6, 2, 3, 2, 8, 8
    x = torch.randn(s, b, groups, per_group, d, generator=g)
    cos, signed = _tables(s, rot, False, g)
    holder = torch.full((s, b, 2, groups, per_group + 2, d), float("nan"))
    out = holder[:, :, 1, :, :per_group]
    rope_kernel.rope_into(x, cos, signed, out, False, inverse)
    ref = _reference(x, cos, signed, False, inverse)
    assert (out.double() - ref).abs().max().item() < 1e-5, f"seed={seed}"
    written = torch.zeros_like(holder, dtype=torch.bool)
    written[:, :, 1, :, :per_group] = True
    assert holder[~written].isnan().all(), "wrote outside the destination"


@pytest.mark.parametrize("interleaved", [False, True])
def test_inverse_is_the_adjoint(seed, interleaved):
    """<R x, y> = <x, R^T y>: what lets the backward rotate the gradient by -θ."""
    g = torch.Generator().manual_seed(seed)
    t, rot = 7, 16
    x = torch.randn(t, 2, 4, rot, generator=g)
    y = torch.randn(t, 2, 4, rot, generator=g)
    cos, signed = _tables(t, rot, interleaved, g)
    rx = rope_kernel.rope_into(x, cos, signed, torch.empty_like(x), interleaved, False)
    ry = rope_kernel.rope_into(y, cos, signed, torch.empty_like(y), interleaved, True)
    lhs, rhs = (rx.double() * y.double()).sum(), (x.double() * ry.double()).sum()
    assert abs(lhs - rhs) <= 1e-5 * abs(lhs), (seed, lhs, rhs)


def test_bad_arguments_are_refused():
    x = torch.zeros(4, 2, 8)
    cos = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="differ"):
        rope_kernel.rope_into(x, cos, cos, torch.zeros(4, 2, 6), False, False)
    with pytest.raises(ValueError, match="do not fit"):
        rope_kernel.rope_into(x, torch.zeros(4, 10), torch.zeros(4, 10), x.clone(), False, False)
    with pytest.raises(ValueError, match="fp32"):
        rope_kernel.rope_into(x, cos.double(), cos.double(), x.clone(), False, False)


@pytest.mark.parametrize("kernel", ["rope_kernel", "row_sum_kernel"])
def test_when_the_triton_kernels_are_chosen(monkeypatch, kernel):
    """Both of TSP's Triton kernels follow ``triton_choice``: CUDA, an fp32-or-narrower dtype
    (their arithmetic is fp32), their environment switch, an unknown value refused by name."""
    from megatron_tsp.core.layers import row_sum_kernel

    module = {"rope_kernel": rope_kernel, "row_sum_kernel": row_sum_kernel}[kernel]
    cuda = torch.device("cuda")
    monkeypatch.delenv(module.ENV, raising=False)
    assert module.available(cuda, torch.bfloat16)
    assert module.available(cuda, torch.float32)
    assert not module.available(cuda, torch.float64)
    assert not module.available(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setenv(module.ENV, "torch")
    assert not module.available(cuda, torch.bfloat16)
    monkeypatch.setenv(module.ENV, "fused")
    with pytest.raises(ValueError, match=module.ENV):
        module.available(cuda, torch.bfloat16)


def test_recorded_as_one_kernel_that_reads_x_and_tables_and_writes_out():
    """Under a fake mode the op does nothing and the traffic recorder sees one kernel: x and
    the tables read, ``out`` written and not read."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_tsp.tools.traffic import make_recorder

    with FakeTensorMode():
        x = torch.empty(32, 2, 4, 16, dtype=torch.bfloat16)
        out = torch.empty(32, 2, 8, 16, dtype=torch.bfloat16)[:, :, :4]
        cos = torch.empty(32, 16)
        recorder = make_recorder(device_type="cpu")
        with recorder:
            rope_kernel.rope_into(x, cos, cos.clone(), out, False, False)
    kernels = [r for r in recorder.records if r.kind == "kernel"]
    rope = [r for r in kernels if r.name == "rope"]
    assert len(rope) == 1, [r.name for r in kernels]
    assert rope[0].read == x.numel() * 2 + 2 * cos.numel() * 4
    assert rope[0].written == out.numel() * 2
