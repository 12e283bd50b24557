"""``matmul_acc`` / ``matmul_into`` (``megatron_tsp/core/layers/precision.py``), every branch, ~5 s.

The bf16 precision tests (tests/test_precision.py) compare TSP with Megatron TP+SP, which rounds its
partial sums to bf16 in the reduce-scatter: a TSP that rounded each partial GEMM result to bf16
before the fp32 add would tie with it and pass. Here the GEMMs are checked against the fp64 product
rounded once:

* CPU (the operand-upcast branch, also torch < 2.8's CUDA fallback) and the same-dtype branch:
  values, within the fp32 (fp64) rounding bound of a length-K dot product;
* CUDA: on fake CUDA tensors (no values), the ops issued: the in-place
  ``addmm.dtype_out(acc, a, b, out=acc)`` on torch >= 2.10 (no temporary, no ``copy_``), and the
  fallbacks of torch 2.8 / 2.9 and older with the capability flags patched.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_tsp.core.layers import precision
from megatron_tsp.core.layers.precision import matmul_acc, matmul_into

M, K, N = 12, 384, 20
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}


def _operands(dtype, seed=0):
    """``a`` as the layers pass it (a transposed view, e.g. ``d_rows.t()``), ``b``, an accumulator
    of ``accumulation_dtype(dtype)`` with values of the product's size."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(K, M, generator=g).to(dtype).t()
    b = torch.randn(K, N, generator=g).to(dtype)
    acc = (torch.randn(M, N, generator=g) * K**0.5).to(precision.accumulation_dtype(dtype))
    return a, b, acc


def _check_rounded_once(result, a, b, acc=None):
    """``result`` equals ``acc + a @ b`` computed exactly (fp64; bf16/fp16 products are exact
    there) and rounded to ``result.dtype``, up to the rounding of a (K+1)-term sum in
    ``result.dtype``: |error| <= (K+1) u (|a| @ |b| + |acc|) elementwise (Higham's gamma bound)."""
    exact = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()
    if acc is not None:
        exact, scale = exact + acc.double(), scale + acc.double().abs()
    bound = (K + 1) * UNIT_ROUNDOFF[result.dtype] * scale
    err = (result.double() - exact).abs()
    assert result.dtype == precision.accumulation_dtype(a.dtype)
    assert bool((err <= bound).all()), f"max error / bound {(err / bound).max().item():.3g}"
    return exact, bound


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_low_precision_rounds_once(dtype):
    a, b, acc = _operands(dtype)
    start = acc.clone()
    out = matmul_acc(a, b, acc)
    assert out is acc  # in place
    exact, bound = _check_rounded_once(acc, a, b, start)
    # the bound is tight enough to see a partial product rounded to the compute dtype
    planted = start + (a.float() @ b.float()).to(dtype).float()
    assert bool(((planted.double() - exact).abs() > bound).any())

    _check_rounded_once(matmul_acc(a, b, dtype=torch.float32), a, b)
    target = torch.full((M, N), float("nan"))
    assert matmul_into(a, b, target) is target
    _check_rounded_once(target, a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_dtype_branch(dtype):
    a, b, acc = _operands(dtype)
    start = acc.clone()
    assert matmul_acc(a, b, acc) is acc
    _check_rounded_once(acc, a, b, start)
    _check_rounded_once(matmul_acc(a, b), a, b)
    target = torch.empty(M, N, dtype=dtype)
    assert matmul_into(a, b, target) is target
    _check_rounded_once(target, a, b)


# --------------------------------------------------------------------------------------------
# CUDA: the ops issued, on fake CUDA tensors


class _Ops(TorchDispatchMode):
    """Records every aten op (name, args, kwargs). ``addmm.dtype_out`` is checked through the
    fake kernel of its functional overload and answered with its ``out``: CPU torch cannot run
    the out= variant on fake CUDA tensors (its decomposition copies into ``out`` through a CUDA
    device guard CPU builds do not have), and the call itself is what is under test."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append((f"{func.overloadpacket.__name__}.{func._overloadname}", args, kwargs))
        if func is torch.ops.aten.addmm.dtype_out:
            out = kwargs["out"]
            functional = {k: v for k, v in kwargs.items() if k != "out"}
            result = torch.ops.aten.addmm.dtype(*args, **functional)
            assert result.shape == out.shape and result.dtype == out.dtype
            return out
        return func(*args, **kwargs)


def _on_fake_cuda(dtype, run):
    with FakeTensorMode(allow_non_fake_inputs=True):
        dev = torch.device("cuda")
        a = torch.empty(K, M, dtype=dtype, device=dev).t()
        b = torch.empty(K, N, dtype=dtype, device=dev)
        acc = torch.empty(M, N, dtype=torch.float32, device=dev)
        log = _Ops()
        with log:
            result = run(a, b, acc)
        assert result.device.type == "cuda" and result.dtype == torch.float32
        assert tuple(result.shape) == (M, N)
    return log.ops, (a, b, acc), result


def _names(ops):
    return [name for name, _, _ in ops]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_accumulates_in_place_through_the_gemm(monkeypatch, dtype):
    """torch >= 2.10: one ``addmm.dtype_out`` reading and writing ``acc`` (beta = 1), nothing
    else: no fp32 temporary, no ``copy_``, no operand upcast."""
    monkeypatch.setattr(precision, "MM_OUT_DTYPE", True)
    monkeypatch.setattr(precision, "ADDMM_FP32_ACC", True)
    ops, (a, b, acc), result = _on_fake_cuda(dtype, lambda a, b, acc: matmul_acc(a, b, acc))
    assert _names(ops) == ["addmm.dtype_out"], _names(ops)
    _, args, kwargs = ops[0]
    assert args[0] is acc and kwargs["out"] is acc and result is acc
    assert args[1] is a and args[2] is b and args[3] == torch.float32
    assert kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1

    ops, _, result = _on_fake_cuda(dtype, lambda a, b, acc: matmul_acc(a, b, dtype=torch.float32))
    assert _names(ops) == ["mm.dtype"] and ops[0][1][2] == torch.float32
    ops, (_, _, out), result = _on_fake_cuda(dtype, lambda a, b, out: matmul_into(a, b, out))
    assert _names(ops) == ["mm.dtype_out"] and ops[0][2]["out"] is out and result is out


def test_cuda_fallback_before_torch_2_10(monkeypatch):
    """torch 2.8 / 2.9 (``out_dtype``, but ``self`` must have the operands' dtype): one fp32 GEMM
    result added onto ``acc``; the product is never rounded to bf16."""
    monkeypatch.setattr(precision, "MM_OUT_DTYPE", True)
    monkeypatch.setattr(precision, "ADDMM_FP32_ACC", False)
    ops, (a, b, acc), result = _on_fake_cuda(
        torch.bfloat16, lambda a, b, acc: matmul_acc(a, b, acc)
    )
    assert _names(ops) == ["mm.dtype", "add_.Tensor"], _names(ops)
    assert ops[0][1][:3] == (a, b, torch.float32)
    assert ops[1][1][0] is acc and result is acc
    ops, (_, _, out), result = _on_fake_cuda(
        torch.bfloat16, lambda a, b, out: matmul_into(a, b, out)
    )
    assert _names(ops) == ["mm.dtype_out"] and result is out


def test_cuda_fallback_without_out_dtype(monkeypatch):
    """torch < 2.8 (no ``out_dtype``): the operands are upcast and the GEMM runs in fp32, as on
    CPU (whose values test_cpu_low_precision_rounds_once checks)."""
    monkeypatch.setattr(precision, "MM_OUT_DTYPE", False)
    monkeypatch.setattr(precision, "ADDMM_FP32_ACC", False)
    for run, gemm in (
        (lambda a, b, acc: matmul_acc(a, b, acc), "addmm_.default"),
        (lambda a, b, acc: matmul_acc(a, b, dtype=torch.float32), "mm.default"),
        (lambda a, b, out: matmul_into(a, b, out), "mm.out"),
    ):
        ops, (a, b, acc), result = _on_fake_cuda(torch.bfloat16, run)
        names = _names(ops)
        assert names[-1] == gemm and names.count(gemm) == 1, names
        assert all(n == "_to_copy.default" for n in names[:-1]) and len(names) == 3, names
        args = ops[-1][1]
        assert all(t.dtype == torch.float32 for t in args if isinstance(t, torch.Tensor))
        if gemm != "mm.default":
            assert result is acc


def test_fake_tensors_where_torch_decomposes_addmm_dtype_out_wrongly(monkeypatch):
    """torch 2.11's decomposition table sends ``addmm.dtype_out`` to the plain ``addmm`` rule, which
    reads ``out_dtype`` as ``beta``: the fake-tensor tools raised a TypeError on an H200 image.
    Reproduced here by giving this torch's table that entry: the plain op then fails under
    FakeTensorMode, and ``matmul_acc`` on fake tensors issues the fp32 GEMM + ``add_`` form."""
    from torch._decomp import decomposition_table

    ops = torch.ops.aten.addmm
    assert not precision.fake_addmm_dtype_out_broken()  # this torch: its own dtype rule
    monkeypatch.setitem(decomposition_table, ops.dtype_out, decomposition_table[ops.default])
    precision.fake_addmm_dtype_out_broken.cache_clear()
    try:
        assert precision.fake_addmm_dtype_out_broken()
        with FakeTensorMode():
            a = torch.empty(4, 8, dtype=torch.bfloat16)
            b = torch.empty(8, 3, dtype=torch.bfloat16)
            acc = torch.empty(4, 3)
            with pytest.raises(TypeError):
                torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        monkeypatch.setattr(precision, "MM_OUT_DTYPE", True)
        monkeypatch.setattr(precision, "ADDMM_FP32_ACC", True)
        ops_seen, (a, b, acc), result = _on_fake_cuda(
            torch.bfloat16, lambda a, b, acc: matmul_acc(a, b, acc)
        )
        assert _names(ops_seen) == ["mm.dtype", "add_.Tensor"], _names(ops_seen)
        assert ops_seen[1][1][0] is acc and result is acc
    finally:
        monkeypatch.undo()
        precision.fake_addmm_dtype_out_broken.cache_clear()
    assert not precision.fake_addmm_dtype_out_broken()
