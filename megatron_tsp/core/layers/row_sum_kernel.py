"""Sums of row pieces in one kernel launch: what TSP's attention backward does with dK and dV.

Each head group's flash backward returns dK and dV per causal block (the early chunk's keys, the
late chunk's keys, whose last rows are the local copy of this rank's late chunk). The send buffer
of the dK/dV reduce-scatter wants them summed in the gathered K/V layout: rows one block covers
copied, rows both cover added, rows none covers zeroed (``TSPLayout.key_pieces``). In torch ops
that is one ``copy_`` / ``add`` / ``zero_`` per row range, about five launches per call and two
calls (dK, dV) per head group; this kernel writes the whole destination once per call, reading
each source once: the same bytes, one launch.

Contract of ``sum_pieces(dest, pieces)``: ``pieces`` are ``(lo, hi, tensor)`` with ``tensor``
shaped like ``dest`` but for its ``hi - lo`` rows (dim 0), any strides; ``dest`` row i becomes
the sum of the pieces covering it, in fp32 in the pieces' order, rounded once into ``dest``'s
dtype (zero where none covers it). ``layout.sum_row_pieces`` is the torch path with the same
arithmetic; ``sum_pieces`` takes it where the kernel does not apply (not CUDA, no Triton, a
dtype wider than fp32, more than ``MAX_PIECES`` pieces, ``TSP_ROW_SUM_KERNEL=torch``).

A torch custom op (``torch.ops.megatron_tsp.sum_rows``) whose fake implementation does nothing,
so shape-only runs (the traffic recorder, the memory tool) see one kernel writing ``dest``. On
CPU tensors the kernel runs in Triton's interpreter (tests only).
"""

from __future__ import annotations

import functools
from typing import List, Sequence, Tuple

import torch

from megatron_tsp.core.layers import triton_choice
from megatron_tsp.core.layout import sum_row_pieces

ENV = "TSP_ROW_SUM_KERNEL"  # "triton" (default where available) or "torch"
MAX_PIECES = 4  # the kernel's pointer arguments; TSP's dK/dV sums have two or three pieces
DTYPES = triton_choice.DTYPES  # fp32 accumulation: wider dtypes keep the torch path

Piece = Tuple[int, int, torch.Tensor]


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether row sums into ``dtype`` tensors on ``device`` run this kernel."""
    return triton_choice.enabled(ENV, device, dtype)


def sum_pieces(dest: torch.Tensor, pieces: Sequence[Piece]) -> torch.Tensor:
    """``dest`` rows = the sum of the pieces covering them (module docstring); returns ``dest``."""
    if (
        len(pieces) <= MAX_PIECES
        and available(dest.device, dest.dtype)
        and all(t.dtype in DTYPES for _, _, t in pieces)
    ):
        return sum_rows_into(dest, pieces)
    return sum_row_pieces(dest, pieces)


def sum_rows_into(dest: torch.Tensor, pieces: Sequence[Piece]) -> torch.Tensor:
    """The kernel, whatever ``available`` says (it checks the shapes); returns ``dest``."""
    if not 1 <= dest.dim() <= 4:
        raise ValueError(f"row-sum kernel takes 1 to 4 dimensions, got {tuple(dest.shape)}")
    if len(pieces) > MAX_PIECES:
        raise ValueError(f"row-sum kernel: {len(pieces)} pieces, at most {MAX_PIECES}")
    for lo, hi, t in pieces:
        if not 0 <= lo <= hi <= dest.shape[0] or t.shape != (hi - lo,) + dest.shape[1:]:
            raise ValueError(
                f"row-sum kernel: piece rows [{lo}, {hi}) of shape {tuple(t.shape)} do not fit "
                f"dest {tuple(dest.shape)}"
            )
    spans = [v for lo, hi, _ in pieces for v in (lo, hi)]
    torch.ops.megatron_tsp.sum_rows(dest, [t for _, _, t in pieces], spans)
    return dest


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    while t.dim() < 4:
        t = t.unsqueeze(-1)
    return t


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The Triton kernel (compiled for the GPU, or wrapped for the interpreter on CPU tensors)."""
    import triton
    import triton.language as tl

    def sum_rows(
        dest_ptr, sd0, sd1, sd2, sd3,
        p0, s00, s01, s02, s03, lo0, hi0,
        p1, s10, s11, s12, s13, lo1, hi1,
        p2, s20, s21, s22, s23, lo2, hi2,
        p3, s30, s31, s32, s33, lo3, hi3,
        rows, n1, n2, n3,
        PIECES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # one program per [BLOCK_R rows, BLOCK_C of the flattened trailing dims] tile
        # 64-bit offsets: a 1M-token send buffer has more than 2^31 elements
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]).to(tl.int64)
        c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]).to(tl.int64)
        i3 = c % n3
        i2 = (c // n3) % n2
        i1 = c // (n3 * n2)
        inside = (r < rows) & (c < n1 * n2 * n3)
        acc = tl.full((BLOCK_R, BLOCK_C), 0.0, tl.float32)
        # each piece: its value at rows r, 0 outside [lo, hi) (the interpreter sees only the
        # module's globals, so no helper function: the four slots are written out)
        if PIECES > 0:
            at = p0 + (r - lo0) * s00 + i1 * s01 + i2 * s02 + i3 * s03
            acc += tl.load(at, mask=inside & (r >= lo0) & (r < hi0), other=0.0).to(tl.float32)
        if PIECES > 1:
            at = p1 + (r - lo1) * s10 + i1 * s11 + i2 * s12 + i3 * s13
            acc += tl.load(at, mask=inside & (r >= lo1) & (r < hi1), other=0.0).to(tl.float32)
        if PIECES > 2:
            at = p2 + (r - lo2) * s20 + i1 * s21 + i2 * s22 + i3 * s23
            acc += tl.load(at, mask=inside & (r >= lo2) & (r < hi2), other=0.0).to(tl.float32)
        if PIECES > 3:
            at = p3 + (r - lo3) * s30 + i1 * s31 + i2 * s32 + i3 * s33
            acc += tl.load(at, mask=inside & (r >= lo3) & (r < hi3), other=0.0).to(tl.float32)
        at = dest_ptr + r * sd0 + i1 * sd1 + i2 * sd2 + i3 * sd3
        tl.store(at, acc.to(dest_ptr.dtype.element_ty), mask=inside)

    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(sum_rows)
    return triton.jit(sum_rows)


BLOCK_R, BLOCK_C = 16, 128


@torch.library.custom_op("megatron_tsp::sum_rows", mutates_args=("dest",))
def _sum_rows(dest: torch.Tensor, sources: List[torch.Tensor], spans: List[int]) -> None:
    import triton

    d4 = _as_4d(dest)
    rows, n1, n2, n3 = d4.shape
    args: list = []
    for i in range(MAX_PIECES):  # unused pointer slots get dest and an empty span
        t = _as_4d(sources[i]) if i < len(sources) else d4
        lo, hi = (spans[2 * i], spans[2 * i + 1]) if i < len(sources) else (0, 0)
        args += [t, *t.stride(), lo, hi]
    grid = (triton.cdiv(rows, BLOCK_R), triton.cdiv(n1 * n2 * n3, BLOCK_C))
    _kernel(dest.device.type == "cpu")[grid](
        d4, *d4.stride(), *args, rows, n1, n2, n3,
        PIECES=len(sources), BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C,
    )  # fmt: skip


@_sum_rows.register_fake
def _sum_rows_fake(dest, sources, spans) -> None:
    return None
