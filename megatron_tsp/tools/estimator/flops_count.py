"""FLOP accounting for the measured training step (``torch.utils.flop_counter.FlopCounterMode``).

torch's counter knows the GEMM ops (mm, addmm, bmm, baddbmm; we add the in-place addmm_) and the
CUDA attention kernels, but not the CPU flash-attention kernel our runs use
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward). We register formulas for those
two ops that count only the query/key pairs a causal kernel actually visits (torch's own SDPA
formulas count the dense ``lq x lk`` rectangle even for causal attention). The stand-in attention
(``fake_run``) always calls the CPU kernel either non-causally on a full rectangle or causally on a
square block, so the count is exact for every scheme and comparable between them.
"""

from __future__ import annotations

from typing import Dict

import torch
from torch.utils.flop_counter import FlopCounterMode

aten = torch.ops.aten

MATMUL_OPS = ("mm", "addmm", "addmm_", "bmm", "baddbmm", "_scaled_mm")
ATTENTION_FWD = aten._scaled_dot_product_flash_attention_for_cpu
ATTENTION_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward


def causal_pairs(lq: int, lk: int, is_causal: bool) -> int:
    """(query, key) pairs visited; causal means top-left aligned (the CPU kernel's convention)."""
    if not is_causal:
        return lq * lk
    if lq <= lk:
        return lq * (lq + 1) // 2
    return lk * (lk + 1) // 2 + (lq - lk) * lk


def _flash_cpu_fwd(
    q_shape, k_shape, v_shape, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs
) -> int:
    b, h, lq, d = q_shape
    lk, dv = k_shape[2], v_shape[3]
    pairs = causal_pairs(lq, lk, is_causal)
    return 2 * b * h * pairs * (d + dv)  # Q K^T and P V


def _flash_cpu_bwd(
    grad_out_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs
) -> int:
    # args: out_shape_tensor, logsumexp, dropout_p, is_causal
    is_causal = bool(args[3]) if len(args) > 3 else bool(kwargs.get("is_causal", False))
    b, h, lq, d = q_shape
    lk, dv = k_shape[2], v_shape[3]
    pairs = causal_pairs(lq, lk, is_causal)
    # recompute Q K^T, dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q (torch's convention)
    return 2 * b * h * pairs * (d + dv + dv + d + d)


def _addmm_inplace(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``acc.addmm_(a, b)``: the fp32 accumulators of layers/precision.py (torch counts only the
    out-of-place ``addmm``)."""
    m, k = a_shape
    return 2 * m * k * b_shape[1]


CUSTOM_FLOP_FORMULAS = {
    ATTENTION_FWD: _flash_cpu_fwd,
    ATTENTION_BWD: _flash_cpu_bwd,
    aten.addmm_: _addmm_inplace,
}


class _GlobalOnly:
    """Stand-in for FlopCounterMode's ``ModuleTracker``: global totals only.

    The stock tracker hooks every module's inputs and outputs for backward
    (``register_multi_grad_hook``), and those hooks keep gradient tensors alive longer than the
    model does: measured under ``MemTracker`` they add one ``[s, b, h]`` tensor per layer to the
    backward peak. Counting only global totals needs no hooks.
    """

    parents = {"Global"}

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None


def make_flop_counter() -> FlopCounterMode:
    counter = FlopCounterMode(display=False, custom_mapping=CUSTOM_FLOP_FORMULAS)
    counter.mod_tracker = _GlobalOnly()
    return counter


def summarize(counter: FlopCounterMode) -> Dict[str, int]:
    """Global totals split into GEMM and attention-core FLOPs (plus anything else counted)."""
    counts = counter.get_flop_counts().get("Global", {})
    out = {"matmul": 0, "attention": 0, "other": 0}
    for op, n in counts.items():
        name = getattr(op, "__name__", str(op)).split(".")[0]
        if name in MATMUL_OPS:
            out["matmul"] += int(n)
        elif "scaled_dot_product" in name or "attention" in name:
            out["attention"] += int(n)
        else:
            out["other"] += int(n)
    out["total"] = out["matmul"] + out["attention"] + out["other"]
    return out
