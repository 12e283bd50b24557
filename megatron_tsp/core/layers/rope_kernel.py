"""RoPE in one kernel launch: a Triton kernel that rotates ``x`` into a strided destination.

TSP applies RoPE to the q and k of every head group, forward, and its inverse in backward: 4D
launches per layer of whatever one application costs. Unfused (``rope.rotate``'s torch path) one
application is three kernels (``x*cos``, two multiply-adds) that write the destination three
times; Transformer Engine's fused RoPE is one kernel but returns a new tensor, copied into the
strided slot TSP needs (the K half of the packed K/V send buffer, the q / k slots of the QKV
gradient). This kernel reads ``x`` and the tables once and writes the destination once, at any
strides, in fp32 arithmetic with one rounding (TE's fused kernel's numerics).

Contract of ``rope_into(x, cos, signed, out, interleaved, inverse)``: ``x`` and ``out`` [t, a1,
a2, b, d] (2 to 5 dimensions, any strides, the same shape), ``cos`` and ``signed`` fp32 [t, rot]
with rot <= d even (``signed`` = the sine with sign -1 on each pair's first channel, see ``rope``).
Channel i < rot of a row: ``out[i] = x[i] cos[i] + x[p(i)] s[i]`` with p(i) its pair partner
(i ± rot/2, or i xor 1 when ``interleaved``) and s = ``signed`` (``inverse``: s[p(i)], the
adjoint rotation by -θ); channels from rot on are copied.

It is a torch custom op (``torch.ops.megatron_tsp.rope``) whose fake implementation does nothing,
so shape-only runs (the traffic recorder, the memory tool) see one kernel that writes ``out``.
On CPU tensors the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``; tests only).
``available`` says whether ``rope`` should use it: CUDA, Triton importable, bf16 / fp16 / fp32,
and not turned off by ``TSP_ROPE_KERNEL=torch``.
"""

from __future__ import annotations

import functools

import torch

from megatron_tsp.core.layers import triton_choice

ENV = "TSP_ROPE_KERNEL"  # "triton" (default where available) or "torch" (the unfused path)
DTYPES = triton_choice.DTYPES  # its arithmetic is fp32: wider models keep the unfused path


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether RoPE of ``dtype`` tensors on ``device`` runs this kernel (CUDA, Triton
    importable, an fp32-or-narrower dtype, not turned off by ``TSP_ROPE_KERNEL=torch``)."""
    return triton_choice.enabled(ENV, device, dtype)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The Triton kernel (compiled for the GPU, or wrapped for the interpreter on CPU tensors)."""
    import triton
    import triton.language as tl

    def rope_rows(
        x_ptr, out_ptr, cos_ptr, sin_ptr,
        sx0, sx1, sx2, sx3, sx4, so0, so1, so2, so3, so4,
        n_a2, rows_b, dim, rot,
        INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # one program per (token, a1, a2): the [b, d] block of that token's rows
        t = tl.program_id(0)
        a1 = tl.program_id(1) // n_a2
        a2 = tl.program_id(1) % n_a2
        rb = tl.arange(0, BLOCK_B)[:, None]
        ch = tl.arange(0, BLOCK_D)[None, :]
        inside = (rb < rows_b) & (ch < dim)
        rotated = ch < rot
        half = rot // 2
        if INTERLEAVED:
            partner = ch ^ 1
        else:
            partner = tl.where(ch < half, ch + half, ch - half)
        partner = tl.where(rotated, partner, ch)
        x_row = x_ptr + t * sx0 + a1 * sx1 + a2 * sx2 + rb * sx3
        x = tl.load(x_row + ch * sx4, mask=inside, other=0.0).to(tl.float32)
        x_p = tl.load(x_row + partner * sx4, mask=inside & rotated, other=0.0).to(tl.float32)
        table = rot * t
        c = tl.load(cos_ptr + table + ch, mask=rotated & (ch < dim), other=1.0)
        s_index = partner if INVERSE else ch
        s = tl.load(sin_ptr + table + s_index, mask=rotated & (ch < dim), other=0.0)
        y = x * c + x_p * s
        out_row = out_ptr + t * so0 + a1 * so1 + a2 * so2 + rb * so3
        tl.store(out_row + ch * so4, y.to(out_ptr.dtype.element_ty), mask=inside)

    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(rope_rows)
    return triton.jit(rope_rows)


def _as_5d(t: torch.Tensor) -> torch.Tensor:
    if not 2 <= t.dim() <= 5:
        raise ValueError(f"rope kernel takes 2 to 5 dimensions, got {tuple(t.shape)}")
    while t.dim() < 5:
        t = t.unsqueeze(-2)
    return t


@torch.library.custom_op("megatron_tsp::rope", mutates_args=("out",))
def _rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    signed: torch.Tensor,
    out: torch.Tensor,
    interleaved: bool,
    inverse: bool,
) -> None:
    import triton

    x5, o5 = _as_5d(x), _as_5d(out)
    t, a1, a2, b, d = x5.shape
    rot = cos.shape[-1]
    interpret = x.device.type == "cpu"
    _kernel(interpret)[(t, a1 * a2)](
        x5, o5, cos, signed,
        *x5.stride(), *o5.stride(),
        a2, b, d, rot,
        INTERLEAVED=interleaved, INVERSE=inverse,
        BLOCK_B=triton.next_power_of_2(b), BLOCK_D=triton.next_power_of_2(d),
    )  # fmt: skip


@_rope.register_fake
def _rope_fake(x, cos, signed, out, interleaved, inverse) -> None:
    return None


def rope_into(
    x: torch.Tensor,
    cos: torch.Tensor,
    signed: torch.Tensor,
    out: torch.Tensor,
    interleaved: bool,
    inverse: bool,
) -> torch.Tensor:
    """RoPE of ``x`` into ``out`` in one launch (module docstring); returns ``out``."""
    if x.shape != out.shape:
        raise ValueError(f"rope kernel: x {tuple(x.shape)} and out {tuple(out.shape)} differ")
    rot = cos.shape[-1]
    if rot % 2 or rot > x.shape[-1] or cos.shape != signed.shape or cos.shape[0] != x.shape[0]:
        raise ValueError(
            f"rope kernel: tables {tuple(cos.shape)} / {tuple(signed.shape)} do not fit "
            f"x {tuple(x.shape)} (need [t, rot], rot even and <= head dim)"
        )
    if cos.dtype != torch.float32 or signed.dtype != torch.float32:
        raise ValueError("rope kernel: the tables must be fp32")
    torch.ops.megatron_tsp.rope(x, cos.contiguous(), signed.contiguous(), out, interleaved, inverse)
    return out
