#!/usr/bin/env python
"""Per-rank kernel times of one transformer layer: TSP vs Megatron TP+SP, on one device.

Communication aside, TSP and TP+SP do the same FLOPs per rank (tokens/D x all weights vs all
tokens x weights/D) but in different shapes: TSP runs D small per-shard problems on S/D tokens
(its local zigzag chunks), TP+SP one problem on all S tokens with 1/D of the weights. This script
times exactly those per-rank kernels at real shapes, forward and forward+backward:

TSP, per head-group / weight shard (a layer runs each D times):
  tsp.qkv       x[S/D,B,h] @ W_qkv_r^T                    (W_qkv_r: [(h + 2 h_kv)/D, h])
  tsp.attn      the rank's 2 zigzag chunks (C = S/2D queries each) against the gathered K/V of
                one head group, bottom-right causal (torch ``causal_lower_right`` through SDPA,
                the code path of ``megatron_tsp.layers.attention``; on CUDA it is the flash kernel)
  tsp.attn_flash2  the same work as two plain flash calls per chunk (unmasked prefix + causal
                diagonal square), no softmax merge: a cost reference that needs no CausalBias
  tsp.proj      ctx[S/D,B,h/D] @ W_proj_r^T               (W_proj_r: [h, h/D])
  tsp.mlp       act(x[S/D,B,h] @ fc1_j^T) @ fc2_j^T        (fc1_j: [F/D (x2 gated), h])
TP+SP, per rank (once per layer):
  tp.qkv, tp.attn (S causal queries, heads/D heads, flash), tp.proj, tp.mlp on all S tokens.

Totals per layer and rank: TSP = D x (qkv + attn + proj + mlp). "TSP full recompute" is
fwd + (fwd+bwd): the upper bound of ``attention_backward="recompute"`` (only X_p saved); the
default layers recompute less (attention "saved", MLP recomputes fc1 only). TP+SP with Megatron's
local layers is fwd+bwd. Element-wise work (RoPE, norms,
residuals) and communication are not included.

Usage (one GPU, <= ~5 min on an H200):   python scripts/gpu_kernels.py
CPU smoke run (seconds):                  python scripts/gpu_kernels.py --small --out-dir /tmp
Results: ``<out-dir>/gpu_kernels_<device>.md`` and ``.json`` (default out-dir: docs/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# 7B-class (paper's model): h=4096, 32 heads (MHA), FFN 4h, bf16; S=128k, D=8, micro-batch 1.
FULL = dict(hidden=4096, heads=32, groups=32, ffn=16384, seq=131072, d=8, batch=1, iters=10,
            warmup=3)
SMALL = dict(hidden=256, heads=8, groups=8, ffn=1024, seq=2048, d=4, batch=1, iters=3, warmup=1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="small shapes that run on a CPU")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default bfloat16 on CUDA, float32 on CPU")
    for k in ("hidden", "heads", "groups", "ffn", "seq", "d", "batch", "iters", "warmup"):
        p.add_argument(f"--{k}", type=int, default=None)
    p.add_argument("--gated", action="store_true", help="SwiGLU MLP (fc1 has 2F/D rows)")
    p.add_argument("--out-dir", default=os.path.join(REPO, "docs"))
    p.add_argument("--tag", default=None, help="file-name tag (default: the device name)")
    p.add_argument("--budget-s", type=float, default=270.0,
                   help="stop starting new cases after this many seconds (results so far kept)")
    args = p.parse_args(argv)
    base = SMALL if args.small else FULL
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.seq % (2 * args.d) or args.heads % args.d or args.groups % args.d \
            or args.ffn % args.d or args.hidden % args.heads or args.heads % args.groups:
        p.error("need S % 2D == 0, heads, groups, ffn divisible by D, hidden % heads == 0, "
                "heads % groups == 0")
    return args


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> List[float]:
    """Milliseconds per call: CUDA events on GPU, perf_counter (after the call returns) on CPU."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    if device.type == "cuda":
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def fwd_and_fwdbwd(forward: Callable[[], torch.Tensor], inputs: List[torch.Tensor]):
    """Two closures: forward only (no graph), and forward + backward to every input."""

    def fwd():
        with torch.no_grad():
            return forward()

    grad_cache = {}

    def fwdbwd():
        out = forward()
        g = grad_cache.get("g")
        if g is None or g.shape != out.shape:
            g = grad_cache["g"] = torch.randn_like(out)
        return torch.autograd.grad(out, inputs, g)

    return fwd, fwdbwd


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
def _act(gated: bool):
    if gated:
        def swiglu(x):
            a, b = torch.chunk(x, 2, dim=-1)
            return F.silu(a) * b
        return swiglu
    return F.gelu


def mlp_case(tokens: int, args, dtype, device):
    h, fd = args.hidden, args.ffn // args.d
    rows = (2 if args.gated else 1) * fd
    x = torch.randn(tokens, args.batch, h, dtype=dtype, device=device, requires_grad=True)
    w1 = (torch.randn(rows, h, dtype=dtype, device=device) / math.sqrt(h)).requires_grad_(True)
    w2 = (torch.randn(h, fd, dtype=dtype, device=device) / math.sqrt(fd)).requires_grad_(True)
    act = _act(args.gated)
    flops = 2 * tokens * args.batch * (rows * h + h * fd)
    return (lambda: torch.matmul(act(torch.matmul(x, w1.t())), w2.t())), [x, w1, w2], flops


def linear_case(tokens: int, k: int, n: int, args, dtype, device):
    x = torch.randn(tokens, args.batch, k, dtype=dtype, device=device, requires_grad=True)
    w = (torch.randn(n, k, dtype=dtype, device=device) / math.sqrt(k)).requires_grad_(True)
    return (lambda: torch.matmul(x, w.t())), [x, w], 2 * tokens * args.batch * k * n


def _attn_flops(q_len: int, kv_len: int, heads: int, hn: int, batch: int) -> float:
    """QK^T and PV over the unmasked bottom-right causal region (q_len <= kv_len)."""
    pairs = q_len * (kv_len - q_len) + q_len * (q_len + 1) / 2
    return 4 * batch * heads * hn * pairs


def tsp_attention_case(args, dtype, device, mode: str):
    """Rank 0's chunks 0 and 2D-1 (every rank does the same work under zigzag) of ONE head group.

    mode ``lower_right``: SDPA + causal_lower_right (the TSP code path); ``flash2``: per chunk an
    unmasked flash call on the prefix keys and an is_causal call on the diagonal block.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    d, s, b = args.d, args.seq, args.batch
    hn = args.hidden // args.heads
    heads, groups = args.heads // d, args.groups // d
    c = s // (2 * d)
    chunks = (0, 2 * d - 1)
    q = torch.randn(b, heads, 2 * c, hn, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(b, groups, s, hn, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(b, groups, s, hn, dtype=dtype, device=device, requires_grad=True)
    gqa = heads != groups
    flops = sum(_attn_flops(c, (ci + 1) * c, heads, hn, b) for ci in chunks)

    if mode == "lower_right":
        backend = _lower_right_backend(q[:, :, :c], k, v, gqa)

        def forward():
            outs = []
            for i, ci in enumerate(chunks):
                kv = (ci + 1) * c
                outs.append(F.scaled_dot_product_attention(
                    q[:, :, i * c:(i + 1) * c], k[:, :, :kv], v[:, :, :kv],
                    attn_mask=causal_lower_right(c, kv), enable_gqa=gqa))
            return torch.cat(outs, dim=2)
        return forward, [q, k, v], flops, backend

    backends = [SDPBackend.FLASH_ATTENTION]

    def forward():
        outs = []
        with sdpa_kernel(backends):
            for i, ci in enumerate(chunks):
                qc = q[:, :, i * c:(i + 1) * c]
                lo, hi = ci * c, (ci + 1) * c
                diag = F.scaled_dot_product_attention(qc, k[:, :, lo:hi], v[:, :, lo:hi],
                                                      is_causal=True, enable_gqa=gqa)
                outs.append(diag)
                if lo > 0:
                    outs.append(F.scaled_dot_product_attention(qc, k[:, :, :lo], v[:, :, :lo],
                                                               enable_gqa=gqa))
            return torch.cat(outs, dim=2)
    return forward, [q, k, v], flops, "FLASH_ATTENTION (forced)"


def _lower_right_backend(q, k, v, gqa: bool) -> str:
    """Which kernel ``CausalBias`` dispatches a lower-right causal SDPA to (torch >= 2.5)."""
    try:
        from torch.backends.cuda import (SDPAParams, can_use_efficient_attention,
                                         can_use_flash_attention)

        params = SDPAParams(q, k, v, None, 0.0, False, gqa)
        if q.device.type == "cuda" and can_use_flash_attention(params):
            return "flash (lower-right via CausalBias)"
        if q.device.type == "cuda" and can_use_efficient_attention(params):
            return "mem-efficient (lower-right mask type)"
    except Exception:  # older torch: no SDPAParams / signature differs
        return "CausalBias dispatch (unknown kernel)"
    return "materialised mask (SDPA with dense bias)"


def tp_attention_case(args, dtype, device):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    d, s, b = args.d, args.seq, args.batch
    hn = args.hidden // args.heads
    heads, groups = args.heads // d, args.groups // d
    q = torch.randn(b, heads, s, hn, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(b, groups, s, hn, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(b, groups, s, hn, dtype=dtype, device=device, requires_grad=True)
    gqa = heads != groups

    def forward():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return forward, [q, k, v], _attn_flops(s, s, heads, hn, b), "FLASH_ATTENTION (forced)"


def check_lower_right(device, dtype) -> float:
    """Max |SDPA(causal_lower_right) - dense-mask reference| on a tiny problem (sanity)."""
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, 2, 8, 16, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(1, 2, 24, 16, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(1, 2, 24, 16, generator=g).to(device=device, dtype=dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(8, 24))
    i = torch.arange(8, device=device)[:, None]
    j = torch.arange(24, device=device)[None, :]
    mask = j <= i + 16
    scores = (q.float() @ k.float().transpose(-1, -2)) / 4.0
    ref = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v.float()
    return float((out.float() - ref).abs().max())


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU {cpu}"


def _slug(name: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    for key in ("h200", "h100", "a100", "mi300x", "b200", "gh200"):
        if key in s:
            return key
    return "cpu" if s.startswith("cpu") else s[:40]


def run(args) -> Dict[str, object]:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    if device.type == "cpu":
        torch.manual_seed(0)
    d, s, h = args.d, args.seq, args.hidden
    hn = h // args.heads
    h_kv = args.groups * hn
    qkv_rows = (h + 2 * h_kv) // d
    started = time.time()
    cases = []  # (name, group, per_layer_multiplier, builder)
    cases += [
        ("tsp.qkv", "tsp", d, lambda: linear_case(s // d, h, qkv_rows, args, dtype, device)),
        ("tsp.attn", "tsp", d, lambda: tsp_attention_case(args, dtype, device, "lower_right")),
        ("tsp.attn_flash2", "tsp_ref", d, lambda: tsp_attention_case(args, dtype, device, "flash2")),
        ("tsp.proj", "tsp", d, lambda: linear_case(s // d, h // d, h, args, dtype, device)),
        ("tsp.mlp", "tsp", d, lambda: mlp_case(s // d, args, dtype, device)),
        ("tp.qkv", "tp_sp", 1, lambda: linear_case(s, h, qkv_rows, args, dtype, device)),
        ("tp.attn", "tp_sp", 1, lambda: tp_attention_case(args, dtype, device)),
        ("tp.proj", "tp_sp", 1, lambda: linear_case(s, h // d, h, args, dtype, device)),
        ("tp.mlp", "tp_sp", 1, lambda: mlp_case(s, args, dtype, device)),
    ]
    results = []
    for name, group, mult, build in cases:
        if time.time() - started > args.budget_s:
            results.append({"name": name, "group": group, "skipped": "time budget"})
            continue
        entry = {"name": name, "group": group, "per_layer": mult}
        try:
            built = build()
            forward, inputs, flops = built[0], built[1], built[2]
            entry["backend"] = built[3] if len(built) > 3 and built[3] else "default dispatch"
            fwd, fwdbwd = fwd_and_fwdbwd(forward, inputs)
            tf = time_fn(fwd, device, args.warmup, args.iters)
            tb = time_fn(fwdbwd, device, args.warmup, args.iters)
            entry.update(fwd_ms=statistics.median(tf), fwdbwd_ms=statistics.median(tb),
                         fwd_ms_all=tf, fwdbwd_ms_all=tb, fwd_flops=flops,
                         fwd_tflops=flops / statistics.median(tf) / 1e9,
                         fwdbwd_tflops=3 * flops / statistics.median(tb) / 1e9)
            del built, forward, inputs, fwd, fwdbwd
        except Exception as exc:  # record and go on: one unsupported kernel must not end the run
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        if device.type == "cuda":
            entry["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        results.append(entry)
        print(f"[gpu_kernels] {name:<16} " + (
            f"fwd {entry['fwd_ms']:9.3f} ms  fwd+bwd {entry['fwdbwd_ms']:9.3f} ms"
            if "fwd_ms" in entry else entry.get("error", entry.get("skipped", ""))),
            file=sys.stderr, flush=True)

    def total(group, key):
        rows = [r for r in results if r["group"] == group]
        if not rows or any(key not in r for r in rows):
            return None
        return sum(r["per_layer"] * r[key] for r in rows)

    totals = {}
    for group, label in (("tsp", "TSP"), ("tp_sp", "TP+SP")):
        f_, fb = total(group, "fwd_ms"), total(group, "fwdbwd_ms")
        totals[label] = {"fwd_ms": f_, "fwdbwd_ms": fb,
                         "as_implemented_ms": (f_ + fb) if (f_ is not None and fb is not None
                                                            and group == "tsp") else fb}
    info = {
        "device": device_name(device), "device_type": device.type, "dtype": args.dtype,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "shapes": {k: getattr(args, k) for k in ("hidden", "heads", "groups", "ffn", "seq", "d",
                                                 "batch", "gated")},
        "iters": args.iters, "warmup": args.warmup, "wall_s": time.time() - started,
        "lower_right_check_max_abs_err": check_lower_right(device, dtype),
    }
    return {"info": info, "kernels": results, "totals_per_layer_per_rank": totals}


def render(report) -> str:
    info, sh = report["info"], report["info"]["shapes"]
    lines = [
        f"# Per-rank kernel times: TSP vs Megatron TP+SP on {info['device']}", "",
        f"Shapes: h={sh['hidden']}, heads={sh['heads']}, query groups={sh['groups']}, "
        f"FFN={sh['ffn']}{' (SwiGLU)' if sh['gated'] else ''}, S={sh['seq']}, D={sh['d']}, "
        f"micro-batch={sh['batch']}, {info['dtype']}; torch {info['torch']}"
        f"{', CUDA ' + info['cuda'] if info['cuda'] else ''}. Median of {info['iters']} after "
        f"{info['warmup']} warm-up ({'CUDA events' if info['device_type'] == 'cuda' else 'perf_counter'}). "
        f"Run time {info['wall_s']:.0f} s. Lower-right causal SDPA vs dense reference: max abs "
        f"err {info['lower_right_check_max_abs_err']:.1e}.", "",
        "| kernel | x per layer | backend | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in report["kernels"]:
        if "fwd_ms" in r:
            lines.append(f"| {r['name']} | {r['per_layer']} | {r['backend']} | {r['fwd_ms']:.3f} | "
                         f"{r['fwdbwd_ms']:.3f} | {r['fwd_tflops']:.3g} | {r['fwdbwd_tflops']:.3g} |")
        else:
            lines.append(f"| {r['name']} | {r.get('per_layer', '')} | - | - | - | - | "
                         f"{r.get('error', r.get('skipped', ''))} |")
    t = report["totals_per_layer_per_rank"]
    lines += ["", "Per layer and rank (sum of kernels x multiplicity; no element-wise ops, "
              "no communication):", "",
              "| scheme | fwd ms | fwd+bwd ms | as implemented ms |", "|---|---:|---:|---:|"]
    for label, e in t.items():
        cells = [f"{e[k]:.2f}" if e[k] is not None else "-"
                 for k in ("fwd_ms", "fwdbwd_ms", "as_implemented_ms")]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if t["TSP"]["fwdbwd_ms"] and t["TP+SP"]["fwdbwd_ms"]:
        lines += ["", f"TSP / TP+SP: fwd {t['TSP']['fwd_ms'] / t['TP+SP']['fwd_ms']:.2f}, "
                  f"fwd+bwd {t['TSP']['fwdbwd_ms'] / t['TP+SP']['fwdbwd_ms']:.2f}, as implemented "
                  f"(TSP with full recompute of the forward in its backward) "
                  f"{t['TSP']['as_implemented_ms'] / t['TP+SP']['as_implemented_ms']:.2f}."]
    lines += ["", "\"as implemented\": TSP = fwd + (fwd+bwd), the upper bound of full recompute "
              "(`attention_backward='recompute'`; the default layers recompute less); TP+SP = "
              "fwd+bwd. `tsp.attn_flash2` is a reference (two flash calls per chunk, no softmax "
              "merge), not part of the totals."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    text = render(report)
    print(text)
    os.makedirs(args.out_dir, exist_ok=True)
    tag = args.tag or _slug(report["info"]["device"])
    base = os.path.join(args.out_dir, f"gpu_kernels_{tag}")
    with open(base + ".md", "w") as f:
        f.write(text)
    with open(base + ".json", "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {base}.md and {base}.json", file=sys.stderr)
    failed = [r["name"] for r in report["kernels"] if "error" in r and r["group"] != "tsp_ref"]
    if failed:
        print(f"error: kernels failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
