"""The planner's time model: each strategy's communication terms, what compute hides of them,
one layer's and one step's seconds (measured kernels or FLOPs), throughput, and where one
strategy overtakes another."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Union

from megatron_tsp.core.model_shape import ModelShape

from . import documents, measured_traffic, moe
from . import formulas as fm
from .formulas import LayerShape
from .memory_model import analytic_memory, head_shape
from .planner_inputs import GB, HardwareSpec, load_hardware, load_model
from .strategies import (
    Options,
    Strategy,
    as_strategy,
    make_strategy,
    moe_schedule,
    wire_bytes,
)


def layer_terms(
    shape: LayerShape, s: Strategy, o: Options, tsp_mlp: bool = True
) -> List[fm.CommTerm]:
    """``tsp_mlp``: the layer's MLP is the TSP MLP, whose backward posts the TSP attention's first
    K/V re-gather (an MoE layer's is not)."""
    if shape.is_moe:  # the dense layer's attention terms, the MoE layer's MLP terms
        schedule = moe_schedule(shape, s, o)
        dense = layer_terms(moe.dense_layer(shape), s, o, tsp_mlp=False)
        attention = [t for t in dense if t.phase[:4] == "attn"]
        group = "tsp" if s.is_tsp else "tp"
        return attention + moe.comm_terms(shape, s.tp, schedule, o.moe_dispatcher, group)
    if s.kind == "tsp":
        return fm.tsp_layer_terms(
            shape,
            s.tp,
            grad_dtype_bytes=o.tsp_grad_comm_bytes,
            regather_kv_bwd=o.tsp_regather_kv,
            recompute_attn=o.tsp_recompute_attn,
            kv_grad_reduce_in_fp32=o.tsp_kv_grad_fp32,
            regather_handoff=tsp_mlp,
        )
    if s.kind == "tp_sp":
        return fm.tp_sp_layer_terms(shape, s.tp)
    if s.kind == "hybrid":
        return fm.hybrid_layer_terms(shape, s.tp, grad_dtype_bytes=o.tsp_grad_comm_bytes)
    if s.kind == "tp":
        return fm.tp_layer_terms(shape, s.tp)
    if s.kind == "cp":
        return fm.cp_layer_terms(shape, s.cp, regather_kv_bwd=o.cp_regather_kv)
    if s.kind == "tp_cp":
        return fm.tp_cp_layer_terms(shape, s.tp, s.cp, regather_kv_bwd=o.cp_regather_kv)
    if s.kind == "tsp_cp":
        return fm.tsp_cp_layer_terms(
            shape,
            s.tp,
            s.cp,
            kv_flavour=s.kv_flavour,
            grad_dtype_bytes=o.tsp_grad_comm_bytes,
            regather_kv_bwd=o.tsp_regather_kv,
            recompute_attn=o.tsp_recompute_attn,
            kv_grad_reduce_in_fp32=o.tsp_kv_grad_fp32,
            regather_handoff=tsp_mlp,
        )
    if s.kind == "fsdp_cp":
        return fm.fsdp_cp_layer_terms(
            shape,
            s.cp,
            kv_flavour=s.kv_flavour,
            grad_reduce_bytes=o.fsdp_grad_reduce_bytes,
            regather_kv_bwd=o.cp_regather_kv,
        )
    if s.kind == "gtp":
        return fm.gtp_layer_terms(
            shape,
            s.tp,
            s.cp,
            s.remat,
            wire_bytes=wire_bytes(s.wire),
            grad_reduce_bytes=o.gtp_grad_reduce_bytes,
            regather_kv_bwd=o.cp_regather_kv,
        )
    raise ValueError(s.kind)


def _term_time(t: fm.CommTerm, s: Strategy, hw: HardwareSpec) -> float:
    # (ranks, spacing) of each group: TP / TSP inside a node, CP's ranks D apart (one per node
    # when D fills the node), TSP x CP's sequence group all D*C ranks (C nodes, D per node)
    if t.group == "cp_ring":
        # what-if CP ring of TSP x CP: the next block's hop across nodes (one NIC share per
        # rank) runs while the node gathers the current block over NVLink: the slower link sets
        # the pace
        intra, inter = fm.ring_split(s.tp, s.cp)
        share = t.nbytes / (intra + inter)
        return max(
            intra * share / hw.bandwidth(s.tp, 1),
            inter * share / hw.bandwidth(s.cp, s.tp, "p2p"),
        )
    if s.kind == "fsdp_cp" and t.link == "p2p" and s.cp > hw.gpus_per_node:
        # TE's CP ring over several nodes: each step waits for the hop that crosses a node
        # boundary, one GPU's NIC share
        return t.nbytes / hw.bandwidth(s.cp, hw.gpus_per_node, "p2p")
    size, stride = {
        "tsp": (s.tp, 1),
        "tp": (s.tp, 1),
        "cp": (s.cp, s.tp),
        "seq": (s.tp * s.cp, 1),
        # fsdp_cp: ZeRO-3 over the whole sequence group; gtp: the GTP_remat ranks, one per
        # TP x CP replica (T*C apart: across nodes once T*C fills a node)
        "fsdp": (s.cp, 1),
        "gtp": (s.remat, s.tp * s.cp),
    }[t.group]
    return t.nbytes / hw.bandwidth(size, stride, t.link) if t.nbytes else 0.0


def exposed_comm(times: List[tuple], compute: float, attn_compute: float) -> float:
    """Exposed seconds of one phase. ``times``: (seconds, overlap class, chunks).

    critical: all exposed; pipelined: the first of ``chunks`` exposed, the rest hideable;
    attn_core: hideable behind attention-core compute only; prefetch / async: behind any compute
    of the phase. Hidden comm is assumed not to slow the compute."""
    crit = attn = rest = 0.0
    for sec, cls, chunks in times:
        if cls == "critical":
            crit += sec
        elif cls == "pipelined":
            crit += sec / chunks
            rest += sec * (1 - 1 / chunks)
        elif cls == "attn_core":
            attn += sec
        else:
            rest += sec
    hid_a = min(attn, attn_compute)
    hid_r = min(rest, max(compute - hid_a, 0.0))
    return crit + attn - hid_a + rest - hid_r


def _flop_kw(s: Strategy, o: Options, full: bool, seq: int = 0, balance: bool = True) -> dict:
    return dict(
        recompute_fc1=(s.kind in ("tsp", "tsp_cp", "hybrid") and o.tsp_recompute_fc1),
        recompute_attn_core=(s.is_tsp and o.tsp_recompute_attn),
        full_recompute=full,
        causal_fraction=causal_fraction(s, o, seq, balance),
        bwd_factor=o.bwd_factor,
    )


def causal_fraction(s: Strategy, o: Options, seq: int, balance: bool = True) -> float:
    """The attention core's share of 2*2*B*S^2*h: ``o.causal_fraction`` for one causal document;
    with packed documents (``o.documents``) times sum L^2 / S^2 (the in-document pairs) and,
    for the time (``balance``), the max / mean work of the strategy's layout over its ranks
    (``documents.strategy_layout``)."""
    if not o.documents or not seq:
        return o.causal_fraction
    layout, ranks = documents.strategy_layout(s)
    pairs, time = documents.attention_factors(o.documents, seq, ranks, layout)
    return o.causal_fraction * (time if balance else pairs)


def measured_layer(m: ModelShape, s: Strategy, hw: HardwareSpec, o: Options, seq: int):
    """The kernels one rank's layer issues at ``seq``, per phase (kernels, bytes, FLOPs, seconds:
    the sum of their rooflines), or None where the compute model is "flops" or the strategy has
    no recorded layer."""
    scheme = measured_traffic.scheme_of(s)  # fsdp_cp: its K/V flavour's recording
    if o.compute_model == "flops" or scheme is None or m.is_moe:
        return None  # the recorded layers are dense: an MoE model's layers are priced by FLOPs
    if o.compute_model != "measured":
        raise ValueError(f"compute_model must be 'measured' or 'flops', got {o.compute_model!r}")
    dtype = {2: "bf16", 4: "fp32"}[m.dtype_bytes]
    curves = measured_traffic.layer_curves(m, s.degree, o.micro_batch, dtype)
    if scheme not in curves:  # its layer does not split over this D: not recorded
        return None
    return measured_traffic.phase_totals(curves[scheme], seq, hw.kernel_costs())


def _layer_time(
    shape: LayerShape,
    s: Strategy,
    hw: HardwareSpec,
    o: Options,
    full: bool,
    measured: Optional[dict] = None,
) -> dict:
    """One layer on one rank: compute (every strategy splits a layer's work evenly over its D
    ranks; with ``measured`` kernels, the sum of their rooflines, full recompute repeating the
    forward's), communication, and what of it the compute cannot hide."""
    D = s.degree
    fl = fm.layer_flops(shape, **_flop_kw(s, o, full, shape.seq))
    if measured is None:
        compute = {
            "fwd": fl["fwd"] / D / hw.flops,
            "bwd": (fl["bwd"] + fl["recompute"]) / D / hw.flops,
        }
    else:
        # the recorded layer runs the layers' defaults (attention core saved); the options the
        # recording did not run add their FLOPs
        fwd, bwd = measured["fwd"]["seconds"], measured["bwd"]["seconds"]
        fl0 = fm.layer_flops(shape, **_flop_kw(s, o, full))  # one causal document, as recorded
        extra = fl0["recompute_attn_core"] / D / hw.flops if not full else 0.0
        # packed documents (--documents): the attention FLOPs the documents and the layout's
        # balance add (or save) against the recorded one-document layer
        doc_fwd = (fl["fwd"] - fl0["fwd"]) / D / hw.flops
        doc_bwd = (fl["bwd"] + fl["recompute"] - fl0["bwd"] - fl0["recompute"]) / D / hw.flops
        compute = {"fwd": fwd + doc_fwd, "bwd": bwd + extra + (fwd if full else 0.0) + doc_bwd}
    attn_core = {
        "fwd": fl["fwd_attn_core"] / D / hw.flops,
        "bwd": (fl["bwd_attn_core"] + fl["recompute_attn_core"]) / D / hw.flops,
    }
    terms = layer_terms(shape, s, o)
    times = {"fwd": [], "bwd": []}
    comm_time = {"fwd": 0.0, "bwd": 0.0}
    for t in terms:
        d = "fwd" if t.phase.endswith("fwd") else "bwd"
        sec = _term_time(t, s, hw)
        times[d].append((sec, t.overlap, t.chunks))
        comm_time[d] += sec
    exposed = {d: exposed_comm(times[d], compute[d], attn_core[d]) for d in ("fwd", "bwd")}
    return {
        "terms": terms,
        "compute": compute,
        "comm_time": comm_time,
        "exposed": exposed,
        "fwd": compute["fwd"] + exposed["fwd"],
        "bwd": compute["bwd"] + exposed["bwd"],
    }


def _head_time(
    m: ModelShape,
    shape: LayerShape,
    s: Strategy,
    hw: HardwareSpec,
    o: Options,
    seq: int,
    full: bool,
):
    """The output layer's GEMM over the group and its (critical) collectives; returns its FLOPs
    and seconds per micro-batch."""
    hf = fm.head_flops(shape, m.padded_vocab(s.weight_shards), o.bwd_factor)
    head_kind = {
        "tsp": "tsp",
        "tp_sp": "tp_sp",
        "hybrid": "tp_sp",
        "tp": "tp",
        "cp": "cp",
        "tp_cp": "tp_sp",
        "tsp_cp": "tsp",
        "fsdp_cp": "cp",
        "gtp": "tp_sp",
    }[s.kind]
    hc = fm.head_comm(head_shape(shape, s, seq), s.tp, head_kind, vocab_ring=o.tsp_vocab_ring)
    head_bw = hw.bandwidth(s.tp, 1)
    seconds = (
        hf["total"] / s.degree / hw.flops
        + (hc["fwd"] + hc["bwd"]) / head_bw
        + (hf["fwd"] / s.degree / hw.flops if full else 0.0)
    )
    return hf, seconds


def _step_comm(
    m: ModelShape,
    shape: LayerShape,
    s: Strategy,
    hw: HardwareSpec,
    o: Options,
    local_params: float,
    dp: int,
    layer: dict,
) -> dict:
    """Once per step: the replicated-grad all-reduce (SP-tagged params) and the data-parallel
    gradient reduce / parameter gather, with what the layers' compute does not hide."""
    repl = 0.0
    if s.kind in ("tsp", "tp_sp", "hybrid", "tp_cp", "tsp_cp", "gtp"):
        repl = fm.replicated_grad_allreduce(
            shape, s.tp, m.num_layers, m.final_norm_params(), o.grad_reduce_bytes
        ) / hw.bandwidth(s.tp, 1)
    with_cp = s.kind in ("cp", "tp_cp", "tsp_cp")
    dp_group = dp * (s.cp if with_cp else 1)
    dp_stride = s.tp if with_cp else s.degree
    if s.kind == "fsdp_cp":  # ZeRO-3 reduces per layer (layer terms); DP replicas of the group
        with_cp, dp_group, dp_stride = False, dp, s.degree
    elif s.kind == "gtp":
        # GTP_remat reduce-scatters its linear weights per micro-batch (layer terms); the rest of
        # DP x CP (the distributed optimizer's replicate group) reduces per step as usual
        dp_group, dp_stride = dp * s.cp, s.tp
    dpc = fm.dp_step_comm(
        local_params,
        dp_group,
        distributed_optimizer=o.distributed_optimizer,
        grad_dtype_bytes=o.grad_reduce_bytes,
        param_dtype_bytes=m.dtype_bytes,
    )
    dp_bw = hw.bandwidth(dp_group, dp_stride)
    t_rs, t_ag = dpc["grad_reduce"] / dp_bw, dpc["param_gather"] / dp_bw
    if o.overlap_dp:
        dp_exposed = max(0.0, t_rs - m.num_layers * layer["bwd"]) + max(
            0.0, t_ag - m.num_layers * layer["fwd"]
        )
    else:
        dp_exposed = t_rs + t_ag
    return {
        "replicated_allreduce_s": repl,
        "dp_comm_bytes": dpc,
        "dp_comm_s": {"grad_reduce": t_rs, "param_gather": t_ag},
        "dp_exposed_s": dp_exposed,
    }


def evaluate(
    model: Union[str, ModelShape],
    hw: Union[str, HardwareSpec],
    s: Strategy,
    seq: int,
    gpus: int,
    o: Optional[Options] = None,
) -> dict:
    """All numbers for one strategy at one sequence length. An MoE model under TSP with
    ``moe_schedule="auto"``: both expert schedules are evaluated and the one that fits and
    trains faster is returned (``moe_alternative``: the other's schedule and tokens/s); the
    schedule's bytes alone (``moe.choose_schedule``) would miss that the ring, which saves
    less per token, can avoid a recompute the folded layout needs."""
    m, o = load_model(model), o or Options()
    if not (m.is_moe and s.is_tsp and o.moe_schedule == "auto"):
        return _evaluate(m, hw, s, seq, gpus, o)
    rows = [_evaluate(m, hw, s, seq, gpus, replace(o, moe_schedule=x)) for x in moe.SCHEDULES]
    best, other = sorted(rows, key=lambda r: (not r["fits"], -r["tokens_per_s"]))
    best["moe_alternative"] = {
        "schedule": other["moe_schedule"],
        "tokens_per_s": other["tokens_per_s"],
    }
    return best


def _evaluate(
    m: ModelShape, hw: Union[str, HardwareSpec], s: Strategy, seq: int, gpus: int, o: Options
) -> dict:
    hw = load_hardware(hw)
    D = s.degree
    if gpus % D:
        raise ValueError(f"{gpus} GPUs not divisible by group size {D}")
    dp = gpus // D
    if dp % s.remat:
        raise ValueError(f"{s.label}: GTP_remat {s.remat} does not divide DP = {dp}")
    nmb = num_microbatches(o, dp, seq)
    shape = LayerShape.of(m, o.micro_batch, seq)
    mem = {
        r: analytic_memory(
            m,
            s,
            seq,
            o.micro_batch,
            dp=dp,
            recompute=r,
            distributed_optimizer=o.distributed_optimizer,
            options=o,
        )
        for r in ("none", "full")
    }
    tot = {r: sum(v.values()) for r, v in mem.items()}
    recompute = o.recompute
    if recompute == "auto":
        recompute = "none" if tot["none"] <= hw.hbm_gb * GB else "full"
    full = recompute == "full"

    measured = measured_layer(m, s, hw, o, seq)
    layer = _layer_time(shape, s, hw, o, full, measured)
    hf, head_time = _head_time(m, shape, s, hw, o, seq, full)
    n_moe = m.moe_layers  # an MoE model: ``layer`` is an MoE layer, the first ones are dense
    per_layer = layer["fwd"] + layer["bwd"]
    micro = m.num_layers * per_layer + head_time
    if n_moe:
        dense = _layer_time(moe.dense_layer(shape), s, hw, o, full, measured)
        micro += (m.num_layers - n_moe) * (dense["fwd"] + dense["bwd"] - per_layer)
    per_step = _step_comm(m, shape, s, hw, o, mem["none"]["params"] / m.dtype_bytes, dp, layer)
    step = nmb * micro + per_step["replicated_allreduce_s"] + per_step["dp_exposed_s"]
    tokens = dp * nmb * o.micro_batch * seq

    def flops(layer_shape):  # model FLOPs: the documents' pairs, no imbalance
        kw = dict(causal_fraction=causal_fraction(s, o, seq, False), bwd_factor=o.bwd_factor)
        return fm.layer_flops(layer_shape, **kw)["total"]

    layer_flops = m.num_layers * flops(shape)
    if n_moe:
        layer_flops = (m.num_layers - n_moe) * flops(moe.dense_layer(shape)) + n_moe * flops(shape)
    model_flops = (layer_flops + hf["total"]) * nmb * dp
    comm = fm.sum_terms(layer["terms"])
    return {
        "strategy": s.label,
        "kind": s.kind,
        "moe_schedule": moe_schedule(shape, s, o),
        "tp": s.tp,
        "cp": s.cp,
        "dp": dp,
        "seq": seq,
        "num_microbatches": nmb,
        "memory_bytes": mem,
        "memory_total_bytes": tot,
        "recompute": recompute,
        "fits": tot[recompute] <= hw.hbm_gb * GB,
        "layer_comm_bytes": comm,
        "layer_comm_fwd": fm.fwd(comm),
        "layer_comm_bwd": fm.bwd(comm),
        "layer_comm_split": fm.split_terms(layer["terms"]),
        "layer_compute_s": layer["compute"],
        "compute_model": "flops" if measured is None else "measured",
        "layer_kernels": measured,
        "layer_comm_s": layer["comm_time"],
        "layer_exposed_s": layer["exposed"],
        "head_s": head_time,
        **per_step,
        "step_s": step,
        "tokens_per_s": tokens / step,
        "layer_fwd_tokens_per_s": dp * o.micro_batch * seq / layer["fwd"],
        "mfu": model_flops / step / (gpus * hw.peak_bf16_tflops * 1e12),
    }


def num_microbatches(o: Options, dp: int, seq: int) -> int:
    if o.num_microbatches:
        return o.num_microbatches
    return max(1, -(-o.global_batch_tokens // (dp * o.micro_batch * seq)))


def throughput_regions(
    model,
    hw,
    a: Strategy,
    b: Strategy,
    gpus: int,
    o: Options,
    lo: int = 1024,
    hi: int = 4 * 1048576,
    key: str = "tokens_per_s",
    points_per_octave: int = 4,
) -> List[tuple]:
    """Intervals [S0, S1] of sequence length (log grid, sign changes refined by bisection) where
    strategy ``a`` is at least as fast as ``b``. S1 = None: up to ``hi``."""

    def ahead(sq: float) -> bool:
        sq = int(round(sq))
        return evaluate(model, hw, a, sq, gpus, o)[key] >= evaluate(model, hw, b, sq, gpus, o)[key]

    def refine(lo_s: float, hi_s: float, left_state: bool) -> float:
        for _ in range(25):
            mid = math.sqrt(lo_s * hi_s)
            if ahead(mid) == left_state:
                lo_s = mid
            else:
                hi_s = mid
        return hi_s

    n = int(points_per_octave * math.log2(hi / lo))
    grid = [lo * 2 ** (i / points_per_octave) for i in range(n + 1)]
    states = [ahead(x) for x in grid]
    regions, start = [], (grid[0] if states[0] else None)
    for i in range(1, len(grid)):
        if states[i] != states[i - 1]:
            x = refine(grid[i - 1], grid[i], states[i - 1])
            if states[i]:
                start = x
            else:
                regions.append((start, x))
                start = None
    if start is not None:
        regions.append((start, None))
    return regions


def throughput_crossover(
    model, hw, a: Strategy, b: Strategy, gpus: int, o: Options, **kw
) -> Optional[float]:
    """Start of the last region where ``a`` is at least as fast as ``b`` and stays so up to the
    top of the range; None if ``a`` is slower at the top."""
    regions = throughput_regions(model, hw, a, b, gpus, o, **kw)
    if regions and regions[-1][1] is None:
        return regions[-1][0]
    return None


def cheapest_fitting_layer_time(
    model, hw, kind: Union[str, Strategy], seq: int, gpus: int, degree: int, o: Options
) -> dict:
    """Per-layer step time (fwd + bwd incl. exposed comm, one micro-batch) of ``kind`` (a name
    with group size ``degree``, or a ``Strategy``) at the cheapest recompute setting whose
    analytic peak fits in the GPU's HBM. Settings, cheapest first: TSP saved attention, TSP
    attention recompute, full recompute; TP+SP / others: none, full. Returns the chosen setting,
    its memory, layer and step time (and every candidate)."""
    m, hw = load_model(model), load_hardware(hw)
    if isinstance(kind, Strategy):
        s = kind
    else:
        s = make_strategy(kind, degree) if kind != "tp_cp" else as_strategy(kind, degree)
    settings = [("none", False)] + ([("none", True)] if s.is_tsp else []) + [("full", False)]
    candidates = []
    for recompute, attn in settings:
        oo = replace(o, recompute=recompute, tsp_recompute_attn=attn)
        r = evaluate(m, hw, s, seq, gpus, oo)
        mem = sum(
            analytic_memory(
                m,
                s,
                seq,
                o.micro_batch,
                dp=gpus // s.degree,
                recompute=recompute,
                distributed_optimizer=o.distributed_optimizer,
                options=oo,
            ).values()
        )
        layer = sum(r["layer_compute_s"].values()) + sum(r["layer_exposed_s"].values())
        label = recompute + (" (attention recompute)" if attn else "")
        candidates.append(
            {
                "setting": label,
                "mem_bytes": mem,
                "layer_s": layer,
                "exposed_s": sum(r["layer_exposed_s"].values()),
                "step_s": r["step_s"],
                "tokens_per_s": r["tokens_per_s"],
                "fits": mem <= hw.hbm_gb * GB,
            }
        )
    fitting = [c for c in candidates if c["fits"]]
    best = min(fitting, key=lambda c: c["layer_s"]) if fitting else None
    return {"strategy": s.label, "best": best, "candidates": candidates}


def tsp_cp_comparison(
    m: ModelShape,
    hw: HardwareSpec,
    strategies: Sequence[Strategy],
    seq: int,
    gpus: int,
    o: Options,
) -> List[dict]:
    """For every CP size C among ``strategies``' TSP x CP / TP+SP x CP: each layout at its
    cheapest fitting recompute setting (``cheapest_fitting_layer_time``), side by side."""
    by_c: Dict[int, Dict[str, Strategy]] = {}
    for s in strategies:
        if s.kind == "tsp_cp":
            by_c.setdefault(s.cp, {})["tsp_cp_ring" if s.kv_flavour == "ring" else "tsp_cp"] = s
        elif s.kind == "tp_cp":
            by_c.setdefault(s.cp, {})["tp_cp"] = s
    out = []
    for c in sorted(by_c):
        row = {"cp": c, "dp": None}
        for key, s in by_c[c].items():
            row["dp"] = gpus // s.degree
            row[key] = cheapest_fitting_layer_time(m, hw, s, seq, gpus, s.degree, o)
        out.append(row)
    return out
