"""TSP beside the layouts long-context users pick: one table from the planner's numbers.

``megatron-tsp compare --hardware h100``

For every (model, sequence length, GPU count) row and every strategy family (TSP, TSP x CP,
TP+SP, TP+SP x CP, FSDP x CP with either K/V exchange, GTP in any of its gather wires), the
planner's candidate configurations (CP size, TP / GTP_remat split, wire) are evaluated at each
recompute setting the planner tries (``timing.cheapest_fitting_layer_time``'s list: none, TSP's
attention recompute, full), and the fastest one (tokens/s) whose analytic peak fits in HBM is
the family's cell. Every number in a cell is a field of ``timing.evaluate``'s row for the picked
configuration; nothing is typed.

Where TSP (the faster of TSP and TSP x CP) is not the fastest layout, the reason is computed:
each row's step time splits exactly into terms (``step_terms``) and the verdict names the terms
by which TSP's step is longer than the winner's.

This module only reads the planner; it prices nothing itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megatron_tsp.console.args import ToolParser, UsageError, positive_int_list
from megatron_tsp.core.model_shape import ModelShape

from . import formulas as fm
from . import measured_traffic, moe
from .formulas import LayerShape
from .planner_inputs import GB, HardwareSpec, load_hardware, load_model
from .strategies import (
    GTP_WIRES,
    MOE_KINDS,
    Options,
    Strategy,
    default_strategies,
)
from .timing import evaluate, layer_terms

MODELS = ("7b", "llama2-70b", "mixtral-8x7b")
SEQS = (32768, 131072, 1048576)
GPUS = (8, 64, 512)

# the table's columns: (family name, the planner's strategy kinds it draws candidates from)
FAMILIES = (
    ("TSP", ("tsp",)),
    ("TSP x CP", ("tsp_cp",)),
    ("TP+SP", ("tp_sp",)),
    ("TP+SP x CP", ("tp_cp",)),
    ("FSDP x CP", ("fsdp_cp",)),
    ("FSDP x CP ring", ("fsdp_cp_ring",)),
    ("GTP", tuple(GTP_WIRES)),
)
TSP_FAMILIES = ("TSP", "TSP x CP")

# the terms a step time splits into (``step_terms``), in the words the verdict uses
TERMS = {
    "flops": "FLOPs",
    "hbm": "HBM traffic",
    "launches": "kernel launches",
    "recompute": "recompute (memory)",
    "exposed": "exposed communication",
    "head": "output layer",
    "sync": "gradient sync",
    "rest": "dense layers",
}
# a term is named in a verdict when it is at least this share of the positive differences
REASON_SHARE = 0.1
SETTING_NAMES = {(False, "none"): "none", (True, "none"): "attn", (False, "full"): "full"}
SUMMARY_HEAD = "| model | S |"


@dataclass
class Cell:
    """One family at one row: the picked configuration's planner row and its step terms, or
    why there is none (``note``)."""

    family: str
    row: Optional[dict] = None
    setting: str = ""
    strategy: Optional[Strategy] = None
    options: Optional[Options] = None
    terms: Dict[str, float] = field(default_factory=dict)
    kernels: Optional[Dict[str, float]] = None  # per layer: launches, HBM bytes (recorded)
    wire_bytes: float = 0.0
    note: str = ""


def _settings(s: Strategy):
    """The recompute settings the planner tries (``cheapest_fitting_layer_time``'s list)."""
    return [("none", False)] + ([("none", True)] if s.is_tsp else []) + [("full", False)]


def candidates(kinds: Sequence[str], degree: int, gpus: int) -> List[Strategy]:
    """The planner's configurations of ``kinds`` on ``gpus``: group ``degree`` inside a node,
    CP of every C >= 2 with D*C dividing the GPUs (tp_cp also its in-node factorisations),
    FSDP over D*C, GTP's every T < D with its GTP_remat dividing DP (``planner.main``'s filter)."""
    cps = [c for c in range(2, gpus // degree + 1) if gpus % (degree * c) == 0]
    out: List[Strategy] = []
    for k in kinds:
        if k == "tp_cp":
            out += default_strategies(degree, ["tp_cp"])
            out += default_strategies(degree, ["tp_cp"], cps) if cps else []
        elif k == "tsp_cp":
            out += default_strategies(degree, ["tsp_cp"], cps) if cps else []
        elif k in ("fsdp_cp", "fsdp_cp_ring") or k in GTP_WIRES:
            out += default_strategies(degree, [k], [1] + cps)
        else:
            out += default_strategies(degree, [k])
    return [s for s in out if gpus % s.degree == 0 and (gpus // s.degree) % s.remat == 0]


def kernel_split(m: ModelShape, s: Strategy, hw: HardwareSpec, o: Options, seq: int) -> dict:
    """A recorded layer's compute seconds (fwd + bwd, no recompute) split per kernel into its
    FLOP time, the HBM time above it and the launch floor above both (their sum is each kernel's
    roofline, ``KernelCosts.seconds``); with its launches and HBM bytes."""
    dtype = {2: "bf16", 4: "fp32"}[m.dtype_bytes]
    # the recorded scheme of s, as the planner reads it (fsdp_cp: its K/V exchange's recording)
    scheme = measured_traffic.scheme_of(s)
    curves = measured_traffic.layer_curves(m, s.degree, o.micro_batch, dtype)[scheme]
    c = hw.kernel_costs()
    out = {"flops": 0.0, "hbm": 0.0, "launches": 0.0, "kernels": 0, "bytes": 0.0}
    for k in curves:
        flops, nbytes = k.at(seq)
        t_f, t_b = flops / c.flops_per_s, nbytes / c.hbm_bytes_per_s
        out["flops"] += t_f
        out["hbm"] += max(0.0, t_b - t_f)
        out["launches"] += max(0.0, c.launch_s - max(t_f, t_b))
        out["kernels"] += 1
        out["bytes"] += nbytes
    return out


def step_terms(m: ModelShape, s: Strategy, hw, o: Options, seq: int, gpus: int, row: dict):
    """``row``'s step time as a sum of terms (``TERMS``), each from the planner's numbers:
    micro-batches x layers x (base compute split into FLOPs / HBM / launches, the recompute
    the setting adds, exposed communication), micro-batches x the output layer, the per-step
    gradient sync; ``rest`` is what an MoE model's dense layers change. Returns (terms, the
    recorded layer's kernels and HBM bytes or None)."""
    base_o = replace(o, recompute="none", tsp_recompute_attn=False)
    base = evaluate(m, hw, s, seq, gpus, base_o)
    base_compute = sum(base["layer_compute_s"].values())
    n = row["num_microbatches"] * m.num_layers
    kernels = None
    if row["compute_model"] == "measured":
        k = kernel_split(m, s, hw, o, seq)
        rec = base["layer_kernels"]
        recorded = rec["fwd"]["seconds"] + rec["bwd"]["seconds"]
        if abs(k["flops"] + k["hbm"] + k["launches"] - recorded) > 1e-9 * recorded:
            raise ValueError(f"{s.label}: the recorded kernels' split does not sum to the layer")
        split = {x: n * k[x] for x in ("flops", "hbm", "launches")}
        kernels = {"kernels": k["kernels"], "bytes": k["bytes"]}
    else:
        split = {"flops": n * base_compute, "hbm": 0.0, "launches": 0.0}
    terms = {
        **split,
        "recompute": n * (sum(row["layer_compute_s"].values()) - base_compute),
        "exposed": n * sum(row["layer_exposed_s"].values()),
        "head": row["num_microbatches"] * row["head_s"],
        "sync": row["replicated_allreduce_s"] + row["dp_exposed_s"],
    }
    terms["rest"] = row["step_s"] - sum(terms.values())
    return terms, kernels


def wire_bytes_per_step(m: ModelShape, s: Strategy, o: Options, seq: int, row: dict) -> float:
    """Bytes one GPU receives per step: every layer's collectives (an MoE model's dense layers
    their own) times the micro-batches, and the data-parallel reduce / gather once."""
    per_layer = row["layer_comm_fwd"] + row["layer_comm_bwd"]
    layers = m.num_layers * per_layer
    if m.moe_layers and m.moe_layers < m.num_layers:
        dense = layer_terms(moe.dense_layer(LayerShape.of(m, o.micro_batch, seq)), s, o)
        comm = fm.sum_terms(dense)
        layers += (m.num_layers - m.moe_layers) * (fm.fwd(comm) + fm.bwd(comm) - per_layer)
    return row["num_microbatches"] * layers + sum(row["dp_comm_bytes"].values())


def pick(family: str, kinds, m: ModelShape, hw: HardwareSpec, seq: int, gpus: int, o: Options):
    """The family's fastest configuration (tokens/s) that fits, over its candidates and the
    planner's recompute settings."""
    if m.is_moe and not set(kinds) <= set(MOE_KINDS):
        return Cell(
            family,
            note=f"not modelled (the planner models MoE layers under {' / '.join(MOE_KINDS)} only)",
        )
    degree = hw.gpus_per_node
    cands = candidates(kinds, degree, gpus)
    if not cands:
        return Cell(family, note=f"none on {gpus} GPUs (CP needs D*C > {degree} GPUs)")
    best, least = None, None
    for s in cands:
        for recompute, attn in _settings(s):
            oo = replace(o, recompute=recompute, tsp_recompute_attn=attn)
            r = evaluate(m, hw, s, seq, gpus, oo)
            mem = r["memory_total_bytes"][recompute]
            if least is None or mem < least:
                least = mem
            if r["fits"] and (best is None or r["tokens_per_s"] > best[0]["tokens_per_s"]):
                best = (r, s, oo, SETTING_NAMES[(attn, recompute)])
    if best is None:
        return Cell(family, note=f"nothing fits (least {least / GB:.1f} GB)")
    r, s, oo, setting = best
    terms, kernels = step_terms(m, s, hw, oo, seq, gpus, r)
    wire = wire_bytes_per_step(m, s, oo, seq, r)
    return Cell(family, r, setting, s, oo, terms, kernels, wire)


def flops_ratio(a: Cell, b: Cell, m: ModelShape, hw: HardwareSpec, seq: int, gpus: int):
    """tokens/s of ``a`` over ``b`` with both priced by the FLOP model, where the planner priced
    one by its recorded kernels and the other by FLOPs (None where both are priced alike): how
    much of a verdict is the two compute models."""
    if a.row["compute_model"] == b.row["compute_model"]:
        return None
    ra, rb = (
        evaluate(m, hw, c.strategy, seq, gpus, replace(c.options, compute_model="flops"))
        for c in (a, b)
    )
    return ra["tokens_per_s"] / rb["tokens_per_s"]


def verdict(cells: Dict[str, Cell], m: ModelShape, hw: HardwareSpec, seq: int, gpus: int) -> dict:
    """The fastest family, TSP's best cell, and, where TSP is slower, the terms (``TERMS``) that
    make its step longer, largest first (those of at least ``REASON_SHARE`` of the positive
    differences, at most three); ``alike``: the fastest's tokens/s over TSP's with both priced by
    the FLOP model, where their compute models differ."""
    fitting = [c for c in cells.values() if c.row is not None]
    out = {"fastest": None, "tsp": None, "reasons": [], "ratio": None, "alike": None}
    if not fitting:
        out["text"] = "nothing fits"
        return out
    fastest = max(fitting, key=lambda c: c.row["tokens_per_s"])
    tsps = [cells[f] for f in TSP_FAMILIES if f in cells and cells[f].row is not None]
    tsp = max(tsps, key=lambda c: c.row["tokens_per_s"]) if tsps else None
    out.update(fastest=fastest, tsp=tsp)
    if tsp is None:
        notes = "; ".join(f"{f}: {cells[f].note}" for f in TSP_FAMILIES if f in cells)
        out["text"] = f"TSP loses: {notes}"
        return out
    if tsp is fastest:
        out["text"] = f"{tsp.row['strategy']} fastest"
        return out
    diff = {k: tsp.terms[k] - fastest.terms[k] for k in TERMS}
    pos = sum(v for v in diff.values() if v > 0)
    reasons = sorted((k for k in diff if diff[k] >= REASON_SHARE * pos > 0), key=lambda k: -diff[k])
    out["reasons"] = reasons[:3]
    out["ratio"] = fastest.row["tokens_per_s"] / tsp.row["tokens_per_s"]
    out["alike"] = flops_ratio(fastest, tsp, m, hw, seq, gpus)
    alike = "" if out["alike"] is None else f"; {out['alike']:.2f}x with both priced by FLOPs"
    why = ", ".join(f"{TERMS[k]} +{diff[k]:.3g} s" for k in out["reasons"])
    out["text"] = (
        f"TSP loses ({fastest.row['strategy']} {out['ratio']:.2f}x its tokens/s{alike}): "
        f"{why} per step"
    )
    return out


def build(models, seqs, gpus_list, hw: HardwareSpec, o: Options) -> List[dict]:
    """Every row: model, S, GPUs, each family's ``Cell``, the ``verdict``."""
    rows = []
    for name in models:
        m = load_model(name)
        for seq in seqs:
            for gpus in gpus_list:
                cells = {f: pick(f, kinds, m, hw, seq, gpus, o) for f, kinds in FAMILIES}
                v = verdict(cells, m, hw, seq, gpus)
                rows.append({"model": m, "seq": seq, "gpus": gpus, "cells": cells, "verdict": v})
    return rows


# ---------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------
def seq_label(seq: int) -> str:
    return f"{seq // 1048576}M" if seq % 1048576 == 0 else f"{seq // 1024}k"


def cell_columns(c: Cell) -> List[str]:
    """A family's table cells: picked, recompute, peak GB, wire GB/step, HBM GB and launches
    per layer (recorded kernels; FLOP model marked), step s, MFU %."""
    if c.row is None:
        return [c.note] + [""] * 7
    r = c.row
    mem = r["memory_total_bytes"][r["recompute"]]
    if c.kernels:
        again = 2 if r["recompute"] == "full" else 1  # full recompute runs the forward twice
        fwd = r["layer_kernels"]["fwd"]
        hbm = c.kernels["bytes"] + (again - 1) * fwd["bytes"]
        launches = c.kernels["kernels"] + (again - 1) * fwd["kernels"]
        hbm_txt, launch_txt, mark = f"{hbm / GB:.1f}", f"{launches}", ""
    else:
        hbm_txt, launch_txt, mark = "—", "—", " ᶠ"
    return [
        r["strategy"],
        c.setting,
        f"{mem / GB:.1f}",
        f"{c.wire_bytes / GB:.1f}",
        hbm_txt,
        launch_txt,
        f"{r['step_s']:.2f}{mark}",
        f"{100 * r['mfu']:.1f}",
    ]


def render_table(rows: List[dict], hw: HardwareSpec) -> str:
    head = (
        "| S | GPUs | strategy | picked | recompute | peak GB | wire GB/step | HBM GB/layer "
        "| launches/layer | step s | MFU % |\n"
        "|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|"
    )
    out: List[str] = []
    model = None
    for row in rows:
        m = row["model"]
        if m is not model:
            model = m
            out += ["", f"#### {m.name} (`megatron_tsp/models/{m.name}.json`)", "", head]
        for i, (fam, c) in enumerate(row["cells"].items()):
            lead = [seq_label(row["seq"]), str(row["gpus"])] if i == 0 else ["", ""]
            out.append("| " + " | ".join(lead + [fam] + cell_columns(c)) + " |")
        out.append(f"| | | **verdict** | {row['verdict']['text']} |" + " |" * 7)
    notes = [
        "",
        f"{hw.name}, {hw.gpus_per_node} GPUs per node, group D = {hw.gpus_per_node} inside a "
        "node, the planner's defaults otherwise (micro-batch 1, 2^24 tokens per step, "
        "distributed optimizer). picked: the fastest configuration that fits (CP size C, GTP's "
        "TP x GTP_remat and wire); recompute: none, attn (TSP's attention recompute) or full. "
        "wire: bytes one GPU receives per step (every layer's collectives x micro-batches, "
        "data-parallel reduce / gather; the output layer's and the replicated parameters' "
        "collectives are in the step time only). HBM and launches: the recorded layer's "
        "kernels (`bench --traffic`), forward and backward, the forward twice under full "
        "recompute.",
        "ᶠ no recorded kernels for this strategy (or an MoE layer): its compute is priced by "
        "the FLOP model (GEMM + attention FLOPs at the profile's efficiency), HBM bytes and "
        "launches are not modelled.",
        "verdict: where TSP (the faster of TSP and TSP x CP) is slower than the fastest layout, "
        "the step-time terms by which it is longer: "
        + ", ".join(TERMS.values())
        + " (FLOPs / HBM traffic / kernel launches: each recorded kernel's roofline split into "
        "its FLOP time, the HBM time above it and the launch floor above both).",
    ]
    return "\n".join(out[1:] + notes)


def render_summary(rows: List[dict], hw: HardwareSpec, gpus_list: Sequence[int]) -> str:
    """One line per (model, S): the fastest layout per GPU count and TSP's tokens/s beside it."""
    head = (
        SUMMARY_HEAD
        + "".join(f" {g} {hw.name.upper()} |" for g in gpus_list)
        + "\n|---|---:|"
        + "---|" * len(gpus_list)
    )
    lines = [head]
    by = {(r["model"].name, r["seq"], r["gpus"]): r for r in rows}
    for name, seq in dict.fromkeys((r["model"].name, r["seq"]) for r in rows):
        cells = []
        for g in gpus_list:
            v = by[(name, seq, g)]["verdict"]
            if v["fastest"] is None:
                cells.append("nothing fits")
            elif v["tsp"] is v["fastest"]:
                cells.append(f"**{v['tsp'].row['strategy']}**")
            elif v["tsp"] is None:
                cells.append(f"{v['fastest'].row['strategy']} (TSP: nothing fits)")
            else:
                alike = "" if v["alike"] is None else f", {1 / v['alike']:.2f}x priced alike"
                why = TERMS[v["reasons"][0]]
                cells.append(
                    f"{v['fastest'].row['strategy']} (TSP {1 / v['ratio']:.2f}x{alike}: {why})"
                )
        lines.append(f"| {name} | {seq_label(seq)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def to_json(rows: List[dict]) -> List[dict]:
    out = []
    for row in rows:
        cells = {}
        for f, c in row["cells"].items():
            cells[f] = {
                "note": c.note,
                "strategy": c.row["strategy"] if c.row else None,
                "recompute": c.setting,
                "step_s": c.row["step_s"] if c.row else None,
                "tokens_per_s": c.row["tokens_per_s"] if c.row else None,
                "mfu": c.row["mfu"] if c.row else None,
                "wire_bytes_per_step": c.wire_bytes,
                "terms": c.terms,
            }
        out.append(
            {
                "model": row["model"].name,
                "seq": row["seq"],
                "gpus": row["gpus"],
                "cells": cells,
                "verdict": row["verdict"]["text"],
            }
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = ToolParser(
        prog="megatron-tsp compare",
        description="TSP beside TSP x CP, TP+SP, TP+SP x CP, FSDP x CP and GTP: each layout's "
        "fastest configuration that fits, from the planner, as markdown (table and summary).",
    )
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    ap.add_argument("--seq-lengths", type=positive_int_list, default=list(SEQS))
    ap.add_argument("--gpus", type=positive_int_list, default=list(GPUS))
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--table", action="store_true", help="only the table (default: both)")
    ap.add_argument("--summary", action="store_true", help="only the summary (default: both)")
    ap.add_argument("--json", default="", help="also write the rows as JSON here")
    ap.add_check(check_args)
    return ap


def check_args(args) -> None:
    try:
        args.hardware_loaded = load_hardware(args.hardware)
    except SystemExit as exc:
        raise UsageError(f"--hardware {args.hardware}", str(exc)) from None
    args.model_list = [x.strip() for x in args.models.split(",") if x.strip()]
    for name in args.model_list:
        try:
            load_model(name)
        except SystemExit as exc:
            raise UsageError(f"--models {name}", str(exc)) from None
    d = args.hardware_loaded.gpus_per_node
    bad = [g for g in args.gpus if g % d]
    if bad:
        raise UsageError("--gpus", f"{bad} not multiples of {d} GPUs per node ({args.hardware})")
    bad = [s for s in args.seq_lengths if s % (2 * max(args.gpus))]
    if bad:
        raise UsageError(
            "--seq-lengths", f"{bad} not divisible by 2 x {max(args.gpus)} (the zigzag's chunks)"
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    hw = args.hardware_loaded
    rows = build(args.model_list, args.seq_lengths, args.gpus, hw, Options())
    both = args.table == args.summary
    if args.table or both:
        print(render_table(rows, hw))
    if both:
        print()
    if args.summary or both:
        print(render_summary(rows, hw, args.gpus))
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
