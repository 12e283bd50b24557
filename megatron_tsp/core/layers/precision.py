"""Accumulation precision for TSP's partial sums.

TSP sums D partial results where TP+SP computes one: partial outputs over weight shards, ``grad_x``
over shards, dK/dV over chunks, and each shard's weight gradient over the D ranks' tokens. Rounding
every partial to bf16/fp16 before summing would make TSP less accurate than TP+SP, so no partial
is rounded on its own: weight gradients and dK/dV chunk sums live in an fp32 accumulator
(``accumulation_dtype``) and are cast once at the end; activation sums (``activation_sum_dtype``)
are accumulated by the GEMM itself, in place, with one rounding of the running sum per shard
(fewer roundings than TP+SP's bf16 reduce-scatter makes), or in fp32 on request. The extra buffers
are O(weights) or O(local tokens), never O(S).

``matmul_acc`` writes ``a @ b`` into (or onto) an fp32 accumulator: on CUDA through the GEMM's own
fp32 output (``out_dtype``), so no rounded bf16 intermediate exists; elsewhere (CPU tests) by
upcasting the operands, which is exact for bf16/fp16 inputs (their products fit in fp32).

What the CUDA GEMM accepts depends on the torch release, so it is decided once, at import
(``MM_OUT_DTYPE``, ``ADDMM_FP32_ACC``; tests patch them to run every branch):

* torch >= 2.10: ``addmm(acc, a, b, out_dtype=fp32, out=acc)`` accumulates in place (beta = 1):
  the GEMM reads and writes ``acc``, no temporary exists;
* torch 2.8 / 2.9 accept ``out_dtype`` only with a ``self`` of the operands' dtype ("self and
  mat2 must have the same dtype"): one fp32 GEMM result, then ``acc.add_`` (a temporary of
  ``acc``'s size);
* older torch has no ``out_dtype``: the operands are upcast (exact, but an fp32 GEMM).

Shape-only runs (``FakeTensorMode``: the memory and traffic tools) need torch's fake kernel of
``addmm.dtype_out``. torch 2.11 (seen on an H200 image) has none: it decomposes the op with the
plain ``addmm`` rule, which reads ``out_dtype`` as ``beta`` and raises a TypeError. There, and only
for fake tensors, the 2.8 / 2.9 form is issued instead (``fake_addmm_dtype_out_broken``): the
prediction then counts one transient fp32 buffer of ``acc``'s size that the GPU run does not have.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16 / fp16 compute, the compute dtype otherwise (fp32, fp64)."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def ring_grad_dtype(params, accumulate_into_main_grad: bool) -> torch.dtype:
    """dtype of the weight-gradient accumulator that rides a weight ring (``weight_ring``):
    ``main_grad``'s when the gradient is accumulated into it and that is wider (fp32 under
    Megatron DDP), else ``accumulation_dtype`` of the parameters (fp32 for bf16/fp16)."""
    acc = accumulation_dtype(params[0].dtype)
    main_grad = getattr(params[0], "main_grad", None) if accumulate_into_main_grad else None
    if main_grad is not None and main_grad.dtype.itemsize > acc.itemsize:
        return main_grad.dtype
    return acc


def activation_sum_dtype(dtype: torch.dtype, in_fp32: bool = False) -> torch.dtype:
    """dtype of a sum of D GEMM results that is an activation or an activation gradient (the
    MLP output over its weight shards, ``grad_x`` over shards and head groups).

    By default the compute dtype, accumulated in place by the GEMM (``addmm`` with beta = 1: the
    product and the running sum meet in the GEMM's fp32 arithmetic and are rounded once per
    shard). That is D roundings of the running sum, where TP+SP rounds each of its D partial
    products and then each of the D-1 additions of its bf16 reduce-scatter; and the accumulator
    is read and written at 2 bytes per element instead of 4 (the largest part of TSP's extra
    memory traffic over TP+SP). ``in_fp32`` (``--tsp-activation-sums-in-fp32``): an fp32
    accumulator (``accumulation_dtype``), cast once at the end. Weight-gradient sums are never
    in the compute dtype: they land in Megatron's fp32 ``main_grad``."""
    return accumulation_dtype(dtype) if in_fp32 else dtype


# ``aten::mm.dtype`` / ``aten::addmm.dtype`` (a GEMM with an fp32 result from bf16/fp16
# operands) exist from torch 2.8.
MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype_out")
# From torch 2.10 the CUDA ``addmm.dtype_out`` also takes an fp32 ``self`` beside bf16/fp16
# matrices, which is what accumulating in place into an fp32 buffer needs.
ADDMM_FP32_ACC = MM_OUT_DTYPE and torch.__version__ >= "2.10"


@functools.lru_cache(maxsize=None)
def fake_addmm_dtype_out_broken() -> bool:
    """torch's decomposition table sends ``addmm.dtype_out`` to the plain ``addmm`` rule (torch
    2.11), so FakeTensorMode cannot run it (see the module docstring)."""
    from torch._decomp import decomposition_table

    ops = torch.ops.aten.addmm
    rule = decomposition_table.get(ops.dtype_out) if hasattr(ops, "dtype_out") else None
    return rule is not None and rule is decomposition_table.get(ops.default)


def _in_place_fp32_gemm(acc: torch.Tensor) -> bool:
    if not ADDMM_FP32_ACC:
        return False
    return not (is_fake(acc) and fake_addmm_dtype_out_broken())


def _gpu_out_dtype(a: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """The GEMM itself can produce ``out_dtype`` (fp32) from ``a``'s dtype (bf16 / fp16)."""
    return (
        MM_OUT_DTYPE
        and a.device.type == "cuda"
        and a.dtype in _LOW_PRECISION
        and out_dtype == torch.float32
    )


def matmul_acc(
    a: torch.Tensor,
    b: torch.Tensor,
    acc: Optional[torch.Tensor] = None,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``acc + a @ b`` (2-D ``a``, ``b``) computed with an accumulator of ``acc.dtype`` (or
    ``dtype`` when ``acc`` is None), in place when ``acc`` is given. Returns the accumulator."""
    out_dtype = acc.dtype if acc is not None else (dtype or a.dtype)
    if out_dtype == a.dtype:
        if acc is None:
            return torch.mm(a, b)
        return acc.addmm_(a, b)
    if _gpu_out_dtype(a, out_dtype):
        if acc is None:
            return torch.mm(a, b, out_dtype=out_dtype)
        if _in_place_fp32_gemm(acc):
            return torch.addmm(acc, a, b, out_dtype=out_dtype, out=acc)
        return acc.add_(torch.mm(a, b, out_dtype=out_dtype))
    if acc is None:
        return torch.mm(a.to(out_dtype), b.to(out_dtype))
    return acc.addmm_(a.to(out_dtype), b.to(out_dtype))


def matmul_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a @ b`` (2-D) computed with ``out.dtype`` accumulation, written in place into
    ``out`` (e.g. a view of a flat fp32 gradient buffer). Returns ``out``."""
    if out.dtype == a.dtype:
        return torch.mm(a, b, out=out)
    if _gpu_out_dtype(a, out.dtype):
        return torch.mm(a, b, out_dtype=out.dtype, out=out)
    return torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)


def matmul_onto(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool):
    """``out = a @ b`` (``matmul_into``) or, with ``accumulate``, ``out += a @ b`` in place by
    the GEMM itself (``matmul_acc``: beta = 1, ``out`` read and written once, no temporary)."""
    if accumulate:
        return matmul_acc(a, b, acc=out)
    return matmul_into(a, b, out)


def sum_rows_onto(rows: torch.Tensor, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """``out = rows.sum(0)`` or, with ``accumulate``, ``out += rows.sum(0)``, summed in
    ``out.dtype`` (a bias gradient: one row of ``out``'s size)."""
    if accumulate:
        return out.add_(torch.sum(rows, dim=0, dtype=out.dtype))
    return torch.sum(rows, dim=0, dtype=out.dtype, out=out)
