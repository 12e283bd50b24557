"""A layer's compute time from its recorded kernels: the planner's measured-traffic model.

``megatron-tsp bench --traffic`` (``tools/traffic.py``) records every kernel one rank's layer
issues, forward and backward, with the bytes it reads and writes and its FLOPs. The planner prices
those kernels instead of an idealised FLOP count, so what the implementation really launches and
moves (element-wise passes, copies, RoPE, accumulations) is in its step time. TP+SP is recorded
as ``bench --traffic`` records it by default: Megatron's fused RoPE (``apply_rope_fusion``, one
kernel per tensor and direction, as with Transformer Engine), so the planner compares TSP with the
TP+SP users run on GPUs. FSDP x CP (``fsdp_cp`` / ``fsdp_cp_ring``) is recorded as
``tools/traffic_fsdp_cp.py`` writes it: Megatron's layer with whole weights on the rank's S/N
tokens, the ZeRO-3 gathers and gradient reduce-scatter, and TE's CP attention (K/V all-gather, or
the P2P ring with its per-step log-sum-exp merges).

Why three recordings are enough: the kernels a layer issues, and their order, do not depend on the
sequence length S (checked: the op sequences must match; each length is recorded after a
discarded warm-up run, so one-time uploads of cached index tables are not counted); each
kernel's bytes are affine in S (activations are O(S), weights O(1)) and its FLOPs at most
quadratic (causal attention). So every
kernel's bytes and FLOPs recorded at S1, 2 S1 and 3 S1 determine them exactly at any S (a quadratic
through three points; the test checks a fourth recording). One recording costs seconds whatever
S is (shape-only tensors), and the curves are cached per (model, D, micro-batch, dtype, code).

A kernel's time is its roofline with a launch floor:
``max(FLOPs / sustained FLOP/s, bytes / sustained HBM bytes/s, launch floor)``; a phase's time is
the sum over its kernels (kernels of one stream run one after another). Collectives are not in it:
the planner's communication model prices them and their overlap.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from megatron_tsp.core.model_shape import ModelShape
from megatron_tsp.tools import traffic

# the traffic recorder's schemes the planner prices: TSP, TP+SP and FSDP x CP (all-gather K/V or
# TE's P2P ring: the planner's fsdp_cp strategy with its ``kv_flavour``)
RECORDED_SCHEMES = traffic.SCHEMES
RECORDED_KINDS = ("tsp", "tp_sp", "fsdp_cp")  # the planner's strategy kinds among them


def scheme_of(strategy) -> "str | None":
    """The recorded scheme of a planner ``Strategy`` (None: the planner prices it by FLOPs)."""
    if strategy.kind == "fsdp_cp":
        return "fsdp_cp_ring" if strategy.kv_flavour == "ring" else "fsdp_cp"
    return strategy.kind if strategy.kind in RECORDED_KINDS else None


PHASES = {"forward": "fwd", "backward": "bwd"}
SAMPLE_MULTIPLES = (1, 2, 3)
_FITTED: Dict[str, Dict[str, List["KernelCurve"]]] = {}  # cache file -> curves, this process


@dataclass(frozen=True)
class KernelCurve:
    """One recorded kernel: its phase and its FLOPs and bytes as quadratics in S
    (``value(S) = c0 + c1 S + c2 S^2``)."""

    name: str
    phase: str  # "fwd" | "bwd"
    flops: Tuple[float, float, float]
    bytes: Tuple[float, float, float]

    def at(self, seq: int) -> Tuple[float, float]:
        def poly(c):
            return c[0] + c[1] * seq + c[2] * seq * seq

        return poly(self.flops), poly(self.bytes)


def _quadratic(xs: Sequence[int], ys: Sequence[float]) -> Tuple[float, float, float]:
    """Coefficients of the quadratic through three points (Lagrange, expanded)."""
    (x0, x1, x2), (y0, y1, y2) = xs, ys
    d0, d1, d2 = (x0 - x1) * (x0 - x2), (x1 - x0) * (x1 - x2), (x2 - x0) * (x2 - x1)
    c2 = y0 / d0 + y1 / d1 + y2 / d2
    c1 = -(y0 * (x1 + x2) / d0 + y1 * (x0 + x2) / d1 + y2 * (x0 + x1) / d2)
    c0 = y0 * x1 * x2 / d0 + y1 * x0 * x2 / d1 + y2 * x0 * x1 / d2
    return c0, c1, c2


def fit_curves(records_by_seq: Dict[int, List[dict]]) -> List[KernelCurve]:
    """Per-kernel curves from the kernel records of three recordings (``tools/traffic.py``
    ``OpRecord`` dicts). The recordings must issue the same kernels in the same order."""
    seqs = sorted(records_by_seq)
    if len(seqs) != 3:
        raise ValueError(f"three recordings are needed, got sequence lengths {seqs}")
    kernels = {s: [r for r in records_by_seq[s] if r["kind"] == "kernel"] for s in seqs}
    first = kernels[seqs[0]]
    for s in seqs[1:]:
        names = [(r["name"], r["phase"]) for r in kernels[s]]
        if names != [(r["name"], r["phase"]) for r in first]:
            at = next(
                (i for i, (a, b) in enumerate(zip(names, first)) if a != (b["name"], b["phase"])),
                min(len(names), len(first)),
            )
            raise ValueError(
                f"the layer issues different kernels at S={seqs[0]} and S={s} (first difference "
                f"at kernel {at} of {len(first)} / {len(names)}): its traffic cannot be "
                "extrapolated in S; record it at the sequence length you plan for"
            )
    curves = []
    for i, r in enumerate(first):
        flops = [kernels[s][i]["flops"] for s in seqs]
        nbytes = [kernels[s][i]["read"] + kernels[s][i]["written"] for s in seqs]
        curves.append(
            KernelCurve(
                r["name"], PHASES[r["phase"]], _quadratic(seqs, flops), _quadratic(seqs, nbytes)
            )
        )
    return curves


@dataclass(frozen=True)
class KernelCosts:
    """What a kernel costs on a device: sustained FLOP/s and HBM bytes/s, and the launch floor."""

    flops_per_s: float
    hbm_bytes_per_s: float
    launch_s: float

    def seconds(self, flops: float, nbytes: float) -> float:
        return max(flops / self.flops_per_s, nbytes / self.hbm_bytes_per_s, self.launch_s)


def phase_totals(curves: Sequence[KernelCurve], seq: int, costs: KernelCosts) -> Dict[str, dict]:
    """Per phase: kernels, bytes, FLOPs and seconds (the sum of the kernels' rooflines)."""
    out = {p: {"kernels": 0, "bytes": 0.0, "flops": 0.0, "seconds": 0.0} for p in ("fwd", "bwd")}
    for c in curves:
        flops, nbytes = c.at(seq)
        e = out[c.phase]
        e["kernels"] += 1
        e["bytes"] += nbytes
        e["flops"] += flops
        e["seconds"] += costs.seconds(flops, nbytes)
    return out


def sample_seqs(d: int) -> Tuple[int, ...]:
    """Three sequence lengths the zigzag layout of D ranks splits (multiples of 2D)."""
    base = 2 * d * 64
    return tuple(k * base for k in SAMPLE_MULTIPLES)


def _code_fingerprint() -> str:
    """The layer code and the libraries the recording depends on: a cache entry recorded with
    other code is not reused."""
    import megatron.core
    import torch

    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256(f"{torch.__version__} {megatron.core.__version__}".encode())
    for sub in ("core", "megatron_lm"):
        for p in sorted((root / sub).rglob("*.py")):
            h.update(p.read_bytes())
    h.update((root / "tools" / "traffic.py").read_bytes())
    h.update((root / "tools" / "traffic_fsdp_cp.py").read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    base = os.environ.get("MEGATRON_TSP_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "megatron_tsp"
    )
    return Path(base) / "traffic"


def record(
    model: ModelShape, d: int, micro_batch: int, dtype: str, seqs: Sequence[int] = ()
) -> Dict[str, Dict[str, List[dict]]]:
    """Kernel records of every scheme (``RECORDED_SCHEMES``) whose layer splits over ``d``
    (``traffic.scheme_fits``), ``{scheme: {str(S): [record, ...]}}``, at ``seqs`` (default:
    the three sample lengths), in one fresh interpreter (the CUDA stand-in must be loaded before
    torch)."""
    from megatron_tsp.tools.estimator.fake_run import run_in_fresh_process

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{model.name or 'model'}.json")
        with open(path, "w") as f:
            json.dump(model.to_json(), f)
        payload = {
            "model": path,
            "world_size": d,
            "micro_batch": micro_batch,
            "dtype": dtype,
            "seqs": list(seqs or sample_seqs(d)),
            "schemes": list(RECORDED_SCHEMES),
        }
        code = (
            "import json, sys, warnings; warnings.filterwarnings('ignore'); "
            "from megatron_tsp.tools import cuda_standin; cuda_standin.load(); "
            "from megatron_tsp.tools import traffic as t; p = json.loads(sys.stdin.read()); "
            "seqs = p.pop('seqs'); out = {}\n"
            # only the schemes whose layer splits over D (TSP / TP+SP shard heads and groups)
            "p['schemes'] = [x for x in p['schemes'] if t.scheme_fits(p['model'], x, "
            "p['world_size'])]\n"
            "for s in seqs:\n"
            # a first, discarded run at each length: the index tables the layers build once per
            # process and length and keep on the device (their uploads) are not per-step traffic
            "    t.measure(t.TrafficConfig(seq=s, **p))\n"
            "    for scheme, r in t.measure(t.TrafficConfig(seq=s, **p)).items():\n"
            "        keep = ('name', 'phase', 'kind', 'read', 'written', 'flops')\n"
            "        out.setdefault(scheme, {})[str(s)] = [{k: x[k] for k in keep} "
            "for x in r['records']]\n"
            "print('@@RESULT@@' + json.dumps(out))"
        )
        return run_in_fresh_process(code, json.dumps(payload), timeout=1800)


def cache_path(model: ModelShape, d: int, micro_batch: int, dtype: str) -> Path:
    """Where the recordings of this layer by this code are kept (``record``'s result)."""
    key = json.dumps(
        [model.to_json(), d, micro_batch, dtype, _code_fingerprint()], sort_keys=True
    ).encode()
    return cache_dir() / f"{hashlib.sha256(key).hexdigest()[:24]}.json"


def layer_curves(
    model: ModelShape, d: int, micro_batch: int = 1, dtype: str = "bf16"
) -> Dict[str, List[KernelCurve]]:
    """Per scheme (``RECORDED_SCHEMES``), the layer's kernel curves; recorded once and cached."""
    path = cache_path(model, d, micro_batch, dtype)
    if str(path) in _FITTED:
        return _FITTED[str(path)]
    if path.is_file():
        raw = json.loads(path.read_text())
    else:
        raw = record(model, d, micro_batch, dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(raw))
        tmp.replace(path)
    fitted = {
        scheme: fit_curves({int(s): recs for s, recs in by_seq.items()})
        for scheme, by_seq in raw.items()
    }
    _FITTED[str(path)] = fitted
    return fitted


def curves_as_json(curves: Sequence[KernelCurve]) -> List[dict]:
    return [dataclasses.asdict(c) for c in curves]
