"""The MLP activation's recompute and backward in one kernel launch, written into strided slots.

Per weight shard j the TSP MLP's backward needs the activation output h_j = act(pre_j) (the fc2
weight gradient reads it) and d(pre_j) = act'(pre_j) * dh_j (the fc1 weight gradient and the
input gradient read it). Megatron's fused activations in torch ops are two launches per shard (the
activation recomputed, then its backward, each reading pre_j) and the backward returns a new
tensor. This kernel reads pre_j and dh_j once and writes h_j and d(pre_j) once, d(pre_j) straight
into the shard's columns of the layer's fc1-output gradient [tokens, D * fc1 rows per shard]: the
MLP's input gradient is then one dgrad GEMM over every shard after the ring, where D in-place
GEMMs each read and wrote the [tokens, h] sum.

Contract of ``act_backward_into(kind, pre, d_hidden, hidden_out, d_pre_out)``: 2-D tensors, any
strides. ``kind`` "gelu_tanh" (Megatron's fused tanh-approximate GeLU, ``bias_gelu``) or "gelu"
(the exact GeLU, ``F.gelu``, Megatron's MLP without ``bias_activation_fusion``): ``pre`` and
``d_pre_out`` [n, f]; "swiglu" (the fused ``bias_swiglu``, or the unfused gated SiLU without
clamp or offset: the same function): [n, 2f], the gate columns then the linear ones (Megatron's
``chunk`` order); ``d_hidden`` and ``hidden_out`` [n, f]. With x = pre (the fc1 bias already
added), g = d_hidden:

    gelu_tanh: t = tanh(0.79788456 x (1 + 0.044715 x^2));   h = 0.5 x (1 + t)
               d = g (0.5 x (1 - t^2)(0.79788456 + 0.1070322243 x^2) + 0.5 (1 + t))
    gelu:      c = 0.5 (1 + erf(x / sqrt 2));   h = x c;   d = g (c + x exp(-x^2 / 2) / sqrt(2 pi))
    swiglu:    [a | b] = x;  s = sigmoid(a);  h = a s b;   d = [g s (1 + a (1 - s)) b | g a s]

the formulas of Megatron's ``bias_gelu`` / ``bias_gelu_back``, torch's ``gelu`` /
``gelu_backward`` and Megatron's ``swiglu`` / ``swiglu_back``, in fp32 arithmetic with one
rounding per output (what the fused GPU kernels do; on CPU, Megatron's torch ops round every
intermediate in the tensors' dtype).

A torch custom op (``torch.ops.megatron_tsp.mlp_act_backward``) whose fake implementation does
nothing, so shape-only runs (the traffic recorder, the memory tool) see one kernel writing both
outputs. On CPU tensors the kernel runs in Triton's interpreter (tests only). ``available`` says
whether the MLP should use it: CUDA, Triton importable, bf16 / fp16 / fp32, and not turned off by
``TSP_ACTIVATION_KERNEL=torch``.
"""

from __future__ import annotations

import functools

import torch

from megatron_tsp.core.layers import triton_choice

ENV = "TSP_ACTIVATION_KERNEL"  # "triton" (default where available) or "torch"
DTYPES = triton_choice.DTYPES  # fp32 arithmetic: wider dtypes keep the torch path
KINDS = {"gelu_tanh": 0, "gelu": 1, "swiglu": 2}  # the activations this kernel computes
BLOCK = 1024  # columns per program


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the activation backward of ``dtype`` tensors on ``device`` runs this kernel."""
    return triton_choice.enabled(ENV, device, dtype)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The Triton kernel (compiled for the GPU, or wrapped for the interpreter on CPU tensors)."""
    import triton
    import triton.language as tl

    def act_rows(
        pre_ptr, dh_ptr, h_ptr, dp_ptr,
        sp0, sp1, sg0, sg1, sh0, sh1, sd0, sd1,
        width,
        KIND: tl.constexpr, BLOCK_F: tl.constexpr,
    ):  # fmt: skip
        # one program per (row, block of BLOCK_F output columns)
        row = tl.program_id(0)
        col = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        inside = col < width
        g = tl.load(dh_ptr + row * sg0 + col * sg1, mask=inside, other=0.0).to(tl.float32)
        pre_row = pre_ptr + row * sp0
        x = tl.load(pre_row + col * sp1, mask=inside, other=0.0).to(tl.float32)
        dp_row = dp_ptr + row * sd0
        if KIND == 2:  # swiglu
            b = tl.load(pre_row + (col + width) * sp1, mask=inside, other=0.0).to(tl.float32)
            # sigmoid; the exponent clamped so that no lane overflows (s is 0 to fp32 there)
            s = 1.0 / (1.0 + tl.exp(-tl.maximum(x, -80.0)))
            silu = x * s
            h = silu * b
            d_first = g * s * (1.0 + x * (1.0 - s)) * b
            d_second = (g * silu).to(dp_ptr.dtype.element_ty)
            tl.store(dp_row + (col + width) * sd1, d_second, mask=inside)
        elif KIND == 1:  # exact GeLU
            c = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
            h = x * c
            d_first = g * (c + x * tl.exp(-0.5 * x * x) * 0.3989422804014327)
        else:  # tanh-approximate GeLU
            u = 0.79788456 * x * (1.0 + 0.044715 * x * x)
            # tanh(u) = 1 - 2 / (exp(2u) + 1); |u| <= 15 keeps exp finite (tanh(15) is 1 in fp32)
            t = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(tl.maximum(u, -15.0), 15.0)) + 1.0)
            h = 0.5 * x * (1.0 + t)
            slope = 0.5 * x * ((1.0 - t * t) * (0.79788456 + 0.1070322243 * x * x))
            d_first = g * (slope + 0.5 * (1.0 + t))
        tl.store(h_ptr + row * sh0 + col * sh1, h.to(h_ptr.dtype.element_ty), mask=inside)
        tl.store(dp_row + col * sd1, d_first.to(dp_ptr.dtype.element_ty), mask=inside)

    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(act_rows)
    return triton.jit(act_rows)


@torch.library.custom_op("megatron_tsp::mlp_act_backward", mutates_args=("hidden_out", "d_pre_out"))
def _act_backward(
    pre: torch.Tensor,
    d_hidden: torch.Tensor,
    hidden_out: torch.Tensor,
    d_pre_out: torch.Tensor,
    kind: int,
) -> None:
    import triton

    rows, width = d_hidden.shape
    block = min(BLOCK, triton.next_power_of_2(width))
    _kernel(pre.device.type == "cpu")[(rows, triton.cdiv(width, block))](
        pre, d_hidden, hidden_out, d_pre_out,
        *pre.stride(), *d_hidden.stride(), *hidden_out.stride(), *d_pre_out.stride(),
        width,
        KIND=kind, BLOCK_F=block,
    )  # fmt: skip


@_act_backward.register_fake
def _act_backward_fake(pre, d_hidden, hidden_out, d_pre_out, kind) -> None:
    return None


def act_backward_into(
    kind: str,
    pre: torch.Tensor,
    d_hidden: torch.Tensor,
    hidden_out: torch.Tensor,
    d_pre_out: torch.Tensor,
) -> torch.Tensor:
    """The kernel, whatever ``available`` says (module docstring: ``hidden_out`` = act(pre),
    ``d_pre_out`` = its gradient for ``d_hidden``); returns ``hidden_out``."""
    if kind not in KINDS:
        raise ValueError(f"activation kernel: kind {kind!r}, choose one of {sorted(KINDS)}")
    width = d_hidden.shape[-1]
    pre_width = 2 * width if kind == "swiglu" else width
    shapes = [t.shape for t in (pre, d_hidden, hidden_out, d_pre_out)]
    rows = d_hidden.shape[0]
    expected = [(rows, pre_width), (rows, width), (rows, width), (rows, pre_width)]
    if (
        any(t.dim() != 2 for t in (pre, d_hidden, hidden_out, d_pre_out))
        or [tuple(s) for s in shapes] != expected
    ):
        raise ValueError(
            f"activation kernel ({kind}): pre, d_hidden, hidden_out, d_pre_out shaped "
            f"{[tuple(s) for s in shapes]}, expected {expected}"
        )
    if rows and width:  # an empty grid is no launch (an expert without tokens on this rank)
        torch.ops.megatron_tsp.mlp_act_backward(pre, d_hidden, hidden_out, d_pre_out, KINDS[kind])
    return hidden_out
