"""Check every attention backend available on this machine against an fp32 SDPA-math reference
before anything is timed with it (``scripts/gpu_check.py``).

The case is what a TSP layer hands a kernel: one rank's two zigzag chunks (chunk r and 2D-1-r,
each a bottom-right block against the natural-order keys [0, (c+1)C)), q a view into a wider
QKV buffer, K and V ``narrow`` views of one packed [S, b, 2g, d] buffer, GQA (MHA for cuDNN,
which takes no GQA), micro-batch 2. Each backend runs ``kernels.zigzag_forward`` /
``zigzag_backward`` (``zigzag_attend`` under autograd for ``sdpa_recompute``) and is compared
with full causal attention over the whole sequence in fp32 through SDPA's math backend (the
log-sum-exp from the same fp32 scores), at the local rows: relative errors of out, lse, dq, dk,
dv. A backend is *verified* when every error is within ``tolerance`` (bf16 resolution); an
exception is recorded as a failure with its message, never swallowed.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from megatron_tsp.core.layers import kernels
from megatron_tsp.core.layout import TSPLayout

# bf16 has an 8-bit mantissa (2^-8 = 3.9e-3); the kernels accumulate in fp32: errors of a few
# 1e-3 are bf16 rounding, anything near 1 is a misread layout or a wrong mask
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
PREFERENCE = ("aten_flash", "cpu_flash", "cudnn", "te_fused", "sdpa_recompute")


def candidates(device: str) -> List[str]:
    """The backends that can run on this machine (TE only when it imports)."""
    if device == "cpu":
        names = ["cpu_flash", "sdpa_recompute"]
    else:
        names = ["aten_flash"]
        if torch.cuda.get_device_capability() >= (9, 0):
            names.append("cudnn")
        if kernels._te_available():
            names.append("te_fused")
        names.append("sdpa_recompute")
    return names


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _case(device, dtype, size, rank, heads, groups, chunk, head_dim, batch, seed=0):
    gen = torch.Generator().manual_seed(seed)
    s = 2 * size * chunk
    mk = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q_full = mk(s, batch, heads, head_dim)
    k, v = mk(s, batch, groups, head_dim), mk(s, batch, groups, head_dim)
    # bf16-representable fp32 inputs: the reference sees exactly what the kernel sees
    q_full, k, v = (t.to(dtype).float() for t in (q_full, k, v))
    dy_full = mk(s, batch, heads * head_dim).to(dtype).float()
    rows = TSPLayout(size, 2 * size * chunk).positions_of(rank).clone()
    return {
        "q_full": q_full.to(device),
        "k": k.to(device),
        "v": v.to(device),
        "dy_full": dy_full.to(device),
        "rows": rows.to(device),
    }


def _reference(case, scale):
    """fp32 SDPA (math backend) over the full sequence, causal: out, lse, dq, dk, dv at the
    local rows."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (case[n].clone().requires_grad_(True) for n in ("q_full", "k", "v"))
    perm = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731  [s, b, n, d] -> [b, n, s, d]
    heads, groups = q.shape[2], k.shape[2]
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(
            perm(q), perm(k), perm(v), is_causal=True, scale=scale, enable_gqa=heads != groups
        )
    s, b = q.shape[:2]
    rows = case["rows"]
    out_rows = out.permute(2, 0, 1, 3).reshape(s, b, -1).index_select(0, rows)
    (out_rows * case["dy_full"].index_select(0, rows)).sum().backward()
    with torch.no_grad():
        kr = perm(k).repeat_interleave(heads // groups, 1)
        scores = perm(q) @ kr.transpose(-1, -2) * scale
        i = torch.arange(s, device=q.device)
        scores.masked_fill_(i.unsqueeze(0) > i.unsqueeze(1), float("-inf"))
        lse = torch.logsumexp(scores, -1).index_select(2, rows)  # [b, h, s_loc]
    return {
        "out": out_rows.detach(),
        "lse": lse,
        "dq": q.grad.index_select(0, rows),
        "dk": k.grad,
        "dv": v.grad,
    }


def _layer_views(case, dtype):
    """q inside a QKV-like buffer, K/V narrow views of one packed buffer, as the layer has them."""
    q_loc = case["q_full"].index_select(0, case["rows"])
    s_loc, b, heads, d = q_loc.shape
    groups = case["k"].shape[2]
    qkv = torch.zeros(s_loc, b, heads + 2 * groups, d, dtype=dtype, device=q_loc.device)
    qkv.narrow(2, 0, heads).copy_(q_loc)
    kv = torch.cat([case["k"], case["v"]], dim=2).to(dtype)
    return qkv.narrow(2, 0, heads), kv.narrow(2, 0, groups), kv.narrow(2, groups, groups)


def _run(kernel, case, dtype, size, rank, scale):
    from megatron_tsp.core.layout import TSPLayout

    q, k, v = _layer_views(case, dtype)
    groups = k.shape[2]
    blocks = TSPLayout(size, k.shape[0], rank).causal_blocks
    dy = case["dy_full"].index_select(0, case["rows"]).to(dtype)
    if kernel.has_lse:
        outs, lses = kernels.zigzag_forward(kernel, q, k, v, blocks, scale)
        dq, dkv = kernels.zigzag_backward(kernel, dy, q, k, v, blocks, scale, outs, lses)
        out, lse = torch.cat(outs), torch.cat(lses, dim=-1)
        dk, dv = dkv.narrow(2, 0, groups), dkv.narrow(2, groups, groups)
    else:
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = kernels.zigzag_attend(kernel, *leaves, blocks, scale)
        out.backward(dy)
        lse = None
        dq, dk, dv = (t.grad for t in leaves)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def check_backend(name, device, dtype, size=4, rank=1, chunk=64, head_dim=64, batch=2) -> dict:
    """Errors of one backend on both zigzag chunks, forward and backward (see the module doc)."""
    heads, groups = (4, 4) if name == "cudnn" else (4, 2)
    scale = 1.0 / math.sqrt(head_dim)
    case = _case(device, dtype, size, rank, heads, groups, chunk, head_dim, batch)
    result = {
        "backend": name,
        "heads": heads,
        "groups": groups,
        "errors": {},
        "error": None,
        "verified": False,
    }
    try:
        kernel = kernels.get_kernel(name)
        got = _run(kernel, case, dtype, size, rank, scale)
        want = _reference(case, scale)
        for key, value in got.items():
            result["errors"][key] = None if value is None else _rel(value, want[key])
    except Exception as exc:  # recorded, not swallowed: the backend is reported as failed
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    tol = TOLERANCE[dtype]
    # sdpa_recompute has no log-sum-exp (None); every other error must be within tolerance
    measured = [e for k, e in result["errors"].items() if not (k == "lse" and e is None)]
    result["verified"] = len(measured) >= 4 and all(e <= tol for e in measured)
    return result


def verify_backends(
    device: str, dtype: torch.dtype, names: Optional[List[str]] = None, **case
) -> dict:
    """Check ``names`` (default: ``candidates(device)``); returns ``{"checked": {name: result},
    "tolerance": tol, "case": {...}}``."""
    names = list(names or candidates(device))
    checked: Dict[str, dict] = {}
    for name in names:
        checked[name] = check_backend(name, device, dtype, **case)
    settings = dict(size=4, rank=1, chunk=64, head_dim=64, batch=2)
    settings.update(case)
    return {"checked": checked, "tolerance": TOLERANCE[dtype], "case": settings}


def pin_backend(report: dict, default: str) -> str:
    """The backend to time: the default choice when it was verified, else the first verified one
    in ``PREFERENCE``; raises RuntimeError naming the failures when none was."""
    ok = [n for n, r in report["checked"].items() if r["verified"]]
    if default in ok:
        return default
    for name in PREFERENCE:
        if name in ok:
            return name
    failures = {n: r["error"] or r["errors"] for n, r in report["checked"].items()}
    raise RuntimeError(f"no attention backend passed the check: {failures}")
