"""Analytic planner: memory, communication, time and throughput per parallel strategy.

``megatron-tsp plan --model 7b --seq-length 131072 --gpus 1024 --hardware mi300x``

Strategies over one group of size D (the rest of the GPUs are data parallel):
    tsp     TSP over D (Megatron TP group reused, sequence_parallel tagging)
    tp_sp   Megatron TP = D with --sequence-parallel
    hybrid  TP = D + SP attention with the TSP MLP ring (Megatron-LM ``--tsp-mlp``)
    tp      Megatron TP = D without sequence parallelism (the paper's baseline)
    cp      Megatron CP = D (distributed optimizer shards over CP x DP)
    tp_cp   TP (+SP) = T times CP = C with T*C = D (every factorisation with T, C >= 2); with
            ``--cp C``: TP+SP = D (inside a node) times CP = C (across nodes)
    tsp_cp  TSP = D (inside a node) times CP = C (across nodes), ``--cp C``: weights move inside
            the TSP group, each head group's K/V is all-gathered over the D*C sequence group
    tsp_cp_ring  WHAT-IF, not implemented in the layers: as tsp_cp, with the K/V passed around a
            P2P ring over the C nodes (one TSP all-gather per node block inside the node)
    fsdp_cp, fsdp_cp_ring  ZeRO-3 (Megatron-FSDP / FSDP2) x CP over the N = D (x C with
            ``--cp``) ranks, DP = 1 inside: whole layers gathered one layer ahead, gradients
            reduce-scattered per layer; CP K/V all-gathered (``all_gather``) or on TE's P2P ring
    gtp, gtp_mxfp8, gtp_nvfp4  Megatron-LM's Generalized Tensor Parallelism: D weight shards =
            TP(T)+SP x GTP_remat(R = D/T, ranks of the data-parallel axis), every T < D (x CP of
            each ``--cp`` C); each linear weight gathered one weight ahead in bf16 / MXFP8 / NVFP4

Models are the package's model files (``megatron_tsp/models/``, ``core.model_shape``), hardware
profiles JSON files in ``megatron_tsp/tools/estimator/hardware/``; ``--model`` and ``--hardware``
take a shipped name or a path to your own file with the same keys.

One module per concern: ``planner_inputs`` (hardware profiles, model files), ``strategies``
(strategies, the model's ``Options``, an MoE model's expert schedule), ``memory_model`` (one
GPU's peak memory), ``timing`` (communication terms, what compute hides, layer and step seconds,
throughput, crossovers); this one: ``plan``, the report and the CLI.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional, Sequence

from megatron_tsp.console.args import (
    ToolParser,
    UsageError,
    fraction,
    positive_int,
    positive_int_list,
)
from megatron_tsp.core.model_shape import ModelShape

from . import documents, moe
from . import formulas as fm
from .formulas import LayerShape
from .memory_model import analytic_memory
from .planner_inputs import GB, HardwareSpec, available, load_hardware, load_model
from .strategies import (
    MOE_KINDS,
    RECOMPUTE_FC1_HELP,
    STRATEGY_NAMES,
    Options,
    Strategy,
    default_strategies,
    make_strategy,
)
from .timing import (
    cheapest_fitting_layer_time,
    evaluate,
    layer_terms,
    num_microbatches,
    throughput_regions,
    tsp_cp_comparison,
)


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def assumptions(
    m: ModelShape, hw: HardwareSpec, o: Options, degree: int, gpus: int, seq: int
) -> List[str]:
    s = LayerShape.of(m, o.micro_batch, 1)
    a = [
        f"model {m.name}: h={m.hidden} layers={m.num_layers} heads={m.heads} "
        f"query_groups={s.groups} ffn={s.ffn_hidden} gated={m.gated} bias={m.bias} "
        f"{m.normalization} vocab={m.vocab} (padded to 128*T) tied={m.tied_embeddings} "
        f"dtype={m.dtype_bytes}B; {m.num_params(1) / 1e9:.2f}B params",
        *[f"model: {x}" for x in m.assumptions],
        f"hardware {hw.name}: {hw.peak_bf16_tflops} TFLOP/s bf16, {hw.hbm_gb} GB HBM, "
        f"{hw.gpus_per_node} GPUs/node, {hw.topology} {hw.link_GBps} GB/s per link per direction"
        f" x {hw.links_per_gpu}, NIC {hw.nic_per_node}x{hw.nic_gbps} Gb/s per node "
        f"({hw.nic_GBps_per_gpu:.0f} GB/s per GPU); compute efficiency {hw.compute_efficiency}, "
        f"comm efficiency {hw.comm_efficiency}",
        *[f"hardware: {x}" for x in hw.assumptions],
        f"group size D={degree} inside a node (stride 1), data parallel DP={gpus // degree} "
        f"across nodes; micro-batch {o.micro_batch}; micro-batches per step: "
        + (
            f"{o.num_microbatches}"
            if o.num_microbatches
            else f"ceil({o.global_batch_tokens:,} global-batch tokens / (DP*B*S)) = "
            f"{num_microbatches(o, gpus // degree, seq)}"
        ),
        "comm bytes = bytes RECEIVED per rank per layer per micro-batch (CommCounter conventions: "
        "all_gather f*n_out, reduce_scatter f*n_in, all_reduce 2f*n, broadcast/reduce f*n, recv n)",
        "TSP schedule: fwd bcast attn weights + all-gather K/V per head group + MLP weight ring; "
        f"bwd re-bcast, {'re-gather K/V, ' if o.tsp_regather_kv else ''}reduce-scatter dK/dV, "
        "reduce attn weight grads, MLP ring + grad accumulator ring; TSP recomputes "
        f"fc1={o.tsp_recompute_fc1}, attention core={o.tsp_recompute_attn} in the backward",
        "hybrid (--tsp-mlp): TP+SP's attention collectives (fwd f*2BSh, bwd f*3BSh) + TSP's "
        "MLP weight ring (fwd f*W_mlp, bwd ring + grad accumulator 2f*W_mlp); the MLP keeps its "
        f"fc1 outputs unless it recomputes fc1 (= {o.tsp_recompute_fc1}, TSP's opt-in)",
        "TP+SP (megatron-core 0.16.1 layers.py): fwd AG+RS per block = f*4BSh, bwd re-AG of the "
        "saved input + dgrad RS (both async next to GEMMs) + AG of the row-parallel output grad "
        "= f*6BSh",
        "CP modelled as all-gather K/V (TE's default P2P ring moves the same bytes per rank); "
        f"bwd re-gather K/V={o.cp_regather_kv}; K/V traffic hides only behind attention compute",
        "fsdp_cp (ZeRO-3 x CP over N ranks, DP = 1 inside): whole layer weights all-gathered "
        "fwd and bwd one layer ahead (hidden behind the previous layer's compute; 2 layers "
        "resident), gradients reduce-scattered per layer per micro-batch in "
        f"{o.fsdp_grad_reduce_bytes or m.dtype_bytes}-byte elements (Megatron-LM's default: "
        "the model dtype), whole-weight GEMMs on B*S/N tokens, CP K/V all-gathered "
        "(fsdp_cp) or on TE's P2P ring (fsdp_cp_ring), hidden behind attention compute "
        "(its compute: the measured kernels of its recorded layer, see below); "
        "gtp (GTP = TP(T) x GTP_remat(R), R from the data-parallel ranks): TP+SP (x CP) terms "
        "+ each linear weight's TP slice all-gathered fwd and bwd over R (bf16 2 B, MXFP8 "
        "8.25 bits, NVFP4 4.5 bits per element) + wgrad reduce-scatter in "
        f"{o.gtp_grad_reduce_bytes}-byte elements, every micro-batch, prefetched one weight "
        "ahead (hidden behind the neighbouring GEMMs); the FP8/FP4 GEMM speed-up is not "
        "modelled (bf16 compute for every strategy); gtp uses the FLOP compute model",
        "TSP x CP (tsp_cp, --cp C): TSP's weight traffic inside the node (TSP group of D), each "
        "head group's K/V all-gather / dK/dV reduce-scatter over the D*C sequence group across C "
        "nodes (the node's NICs), pipelined one head group ahead as without CP; tsp_cp_ring is a "
        "what-if (not in the layers): the TSP gather per node block over NVLink paced against "
        "a one-NIC P2P hop across nodes, hidden behind attention compute; both use the FLOP "
        "compute model",
        "overlap: TSP weight/grad traffic is data-independent (prefetch, hides behind any compute "
        "of the phase) except the first forward weight broadcast (and with attention recompute "
        "the first backward one); TSP K/V all-gathers / dK/dV reduce-scatters are "
        "pipelined one head group ahead (first group exposed: the forward's first all-gather "
        "and the backward's last reduce-scatter), except the backward's first K/V re-gather, "
        "posted by the layer's TSP MLP backward behind its dgrad GEMM and hidden (exposed with "
        "attention recompute and in MoE layers); TP/SP "
        "activation collectives are on the critical path, except Megatron's async bwd re-gather "
        "/ dgrad RS / dgrad all-reduce; hidden comm is assumed not to slow compute; comm ops "
        "share the fabric serially; no latency term",
        (
            "compute (TSP, TP+SP, FSDP x CP): every kernel the layer issues (FSDP x CP: whole-"
            "weight GEMMs on S/N tokens, the gradients' copy into the reduce-scatter buffer, TE's "
            "CP attention with its K/V reorders or ring merges), recorded on shape-only tensors "
            "at three sequence lengths and extrapolated exactly in S, priced max(FLOPs / "
            f"{hw.flops / 1e12:.0f} TFLOP/s, bytes / {hw.hbm_GBps * hw.hbm_efficiency:.0f} GB/s "
            f"HBM, {hw.kernel_launch_us} us launch floor) and summed per phase; other strategies: "
            "FLOPs as below"
            if o.compute_model == "measured"
            else "compute: FLOPs only (--compute-model flops)"
        ),
        "FLOPs: 2*B*S*W per GEMM, causal attention 2*2*B*S^2*h*0.5, backward = "
        f"{o.bwd_factor}x forward; zigzag balance assumed"
        + (
            f"; packed documents {o.documents}: attention x sum L^2 / S^2 (mean of "
            f"{documents.DRAWS} seeded draws), its time x the layout's max / mean rank work "
            "(TSP: global zigzag, CP: TE THD, TP / TP+SP: 1; megatron-tsp documents)"
            if o.documents
            else ""
        ),
        "memory: bf16 params + fp32 grads + fp32 master/Adam (18 B/param), optimizer part "
        f"sharded over DP(xCP) = {o.distributed_optimizer}; activations bf16 (LN in/out, QKV, "
        "attention out, MLP intermediates; flash attention, no dropout); recompute "
        f"{o.recompute!r} (auto = none if it fits in HBM else full)",
        f"DP: grad reduce-scatter in {o.grad_reduce_bytes}-byte grads + bf16 param all-gather "
        f"(distributed optimizer), overlapped with bwd/fwd = {o.overlap_dp}; a multi-node ring "
        "with k members per node uses k NIC shares",
        "tokens/s = DP * micro-batches * B * S / step time; 'layer-fwd tok/s' = DP*B*S / one "
        "layer's forward time (the paper's 173M tok/s is most likely this metric)",
    ]
    if m.is_moe:
        a += [
            "MoE layers: uniform routing (each expert T*k/E of a rank's T*k token copies, no "
            "token dropping); TSP's experts folded onto the TSP axis (EP = D, whole experts, "
            f"megatron-core's {o.moe_dispatcher} dispatcher, its token exchange on the critical "
            "path) or on the TSP expert ring (every expert 1/D per rank, weight hops prefetched "
            f"behind the experts' GEMMs); schedule {o.moe_schedule!r} (auto: the faster that "
            "fits); TP+SP with the experts folded the same way; MoE layers priced by FLOPs (the "
            "recorded kernels are dense layers'); activations and the backward working set "
            "as megatron-core's MoE layer saves them (within 5% of the fake-tensor tool, "
            "tests/estimator/test_planner_moe.py)",
        ]
    return a


def _unit(values: List[float]) -> tuple:
    big = max(values) if values else 0.0
    for name, scale in (("GB", GB), ("MB", 1e6), ("KB", 1e3)):
        if big >= 0.5 * scale:
            return name, scale
    return "B", 1.0


def format_table(rows: List[dict]) -> str:
    mu, ms = _unit([v for r in rows for v in r["memory_total_bytes"].values()])
    cu, cs_ = _unit([r["layer_comm_fwd"] + r["layer_comm_bwd"] for r in rows])
    t_all = [v for r in rows for k in ("layer_compute_s", "layer_comm_s") for v in r[k].values()]
    tu, ts = ("ms", 1e3) if max(t_all) >= 1e-3 else ("us", 1e6)
    hdr = (
        f"{'strategy':<16}{'DP':>5}{f'mem {mu} none/full':>18}{'rc':>6}{'fits':>5}"
        f"{f'comm/layer {cu} fwd+bwd':>23}{f'compute {tu} f/b':>16}{f'comm {tu} f/b':>14}"
        f"{f'exposed {tu} f/b':>16}{'step s':>8}{'tok/s':>10}{'layer-fwd tok/s':>17}{'MFU':>6}"
    )
    out = [hdr, "-" * len(hdr)]
    for r in rows:
        mt = r["memory_total_bytes"]
        cs, cm, ex = r["layer_compute_s"], r["layer_comm_s"], r["layer_exposed_s"]
        mem = f"{mt['none'] / ms:.1f}/{mt['full'] / ms:.1f}"
        com = f"{r['layer_comm_fwd'] / cs_:.2f}+{r['layer_comm_bwd'] / cs_:.2f}"
        out.append(
            f"{r['strategy']:<16}{r['dp']:>5}{mem:>18}"
            f"{r['recompute']:>6}{'yes' if r['fits'] else 'NO':>5}{com:>23}"
            f"{cs['fwd'] * ts:>8.1f}/{cs['bwd'] * ts:<7.1f}"
            f"{cm['fwd'] * ts:>6.1f}/{cm['bwd'] * ts:<7.1f}"
            f"{ex['fwd'] * ts:>8.1f}/{ex['bwd'] * ts:<7.1f}"
            f"{r['step_s']:>8.2f}{r['tokens_per_s'] / 1e6:>9.2f}M"
            f"{r['layer_fwd_tokens_per_s'] / 1e6:>16.1f}M{r['mfu']:>6.2f}"
        )
    return "\n".join(out)


def crossover_report(m: ModelShape, degree: int, o: Options) -> List[str]:
    shape = LayerShape.of(m, o.micro_batch, 1)
    h = m.hidden
    ca = fm.crossover_analysis(shape, degree)
    lines = []
    for key, txt in (
        ("fwd_vs_tp_sp", "forward, TSP vs TP+SP"),
        ("fwd_vs_tp", "forward, TSP vs TP"),
        ("total_vs_tp_sp", "fwd+bwd, TSP vs TP+SP"),
        ("total_vs_tp", "fwd+bwd, TSP vs TP"),
    ):
        c = ca[key]
        if math.isinf(c):
            lines.append(f"  {txt:<24}: never (TSP per-token traffic not below the baseline's)")
        else:
            lines.append(
                f"  {txt:<24}: B*S >= {c:.3g} h = {c * h:,.0f} tokens "
                f"(S >= {c * h / o.micro_batch:,.0f} at B={o.micro_batch})"
            )
    w, kvh = ca["weights_over_h2"], shape.kv_hidden / h
    lines.append(
        f"  derivation (forward): f*(W + 2*B*S*h_kv) <= f*4*B*S*h  <=>  B*S >= W / (4h - 2h_kv) "
        f"= {w:.4g} h^2 / ({4 - 2 * kvh:.4g} h) = {w / (4 - 2 * kvh):.4g} h"
    )
    pub = (m.published or {}).get("forward_crossover_bs_over_h")
    if pub is not None:
        lines.append(
            f"  paper: B*S > {pub}h. The counted bytes give {ca['fwd_vs_tp_sp']:.4g}h for this "
            f"model (W = {w:.4g} h^2 moved per layer); fwd+bwd gives {ca['total_vs_tp_sp']:.4g}h "
            f"(TP+SP) / {ca['total_vs_tp']:.4g}h (TP). {pub}h falls out of the same inequality "
            f"only if (a) W = {pub * (4 - 2 * kvh):.4g} h^2 is counted per layer (e.g. a 3-matrix "
            f"gated MLP at F=4h: 4h^2 + 12h^2), or (b) the weight term is counted without the "
            f"(D-1)/D factor: {ca['fwd_vs_tp_sp']:.4g}h * D/(D-1) = "
            f"{ca['fwd_weights_without_f']:.4g}h at D={degree} (8h at D=4). Both are printed; "
            f"the planner uses the counted {ca['fwd_vs_tp_sp']:.4g}h."
        )
    return lines


def paper_check(m: ModelShape, o: Options) -> List[str]:
    pub = m.published or {}
    mem = pub.get("memory_gb")
    if not mem:
        return []
    lines = [f"  published memory ({pub.get('source', '')}) vs this model, D=8 on 8 GPUs (DP=1):"]
    for seq, vals in mem.items():
        seq = int(seq)
        for kind, key in (("tsp", "tsp"), ("tp", "tp"), ("tp_sp", None)):
            ours = {
                r: sum(
                    analytic_memory(
                        m, kind, seq, o.micro_batch, degree=8, dp=1, recompute=r, options=o
                    ).values()
                )
                / GB
                for r in ("none", "full")
            }
            if key:
                pub_txt = f"{vals[key]}" if key in vals else "-"
            else:
                lay = vals.get("tp_x_sp_layouts")
                pub_txt = (
                    f"- (paper's 2-D TPxSP layouts: {' / '.join(map(str, lay))})" if lay else "-"
                )
            lines.append(
                f"    S={seq:>6} {kind:<6} ours none/full = {ours['none']:5.1f} / "
                f"{ours['full']:5.1f} GB   published: {pub_txt}"
            )
    thr = pub.get("throughput_tokens_per_s")
    if thr:
        lines.append(
            f"  published throughput on {thr['gpus']} {thr['hardware']} at S={thr['seq']}: "
            f"TSP {thr['tsp'] / 1e6:.0f}M tok/s vs TP+SP "
            f"{' / '.join(f'{x / 1e6:.1f}M' for x in thr['tp_sp'])} ({thr.get('note', '')})"
        )
    return lines


def sweep(model, hw, strategies: List[Strategy], seqs: List[int], gpus: int, o: Options) -> dict:
    return {s.label: [evaluate(model, hw, s, sq, gpus, o) for sq in seqs] for s in strategies}


def plan(
    model,
    hardware,
    seq: int,
    gpus: int,
    degree: int = 8,
    strategies: Optional[List[Strategy]] = None,
    options: Optional[Options] = None,
) -> dict:
    """Structured result of a plan (what the CLI prints)."""
    m, hw, o = load_model(model), load_hardware(hardware), options or Options()
    if m.is_moe:
        return _plan_moe(m, hw, seq, gpus, degree, strategies, o)
    strategies = strategies or default_strategies(degree)
    rows = [evaluate(m, hw, s, seq, gpus, o) for s in strategies]
    shape = LayerShape.of(m, o.micro_batch, seq)
    cross = {d: fm.crossover_seq_length(shape, degree, d, "tp_sp") for d in ("fwd", "total")}
    hybrid_cross = {
        d: fm.crossover_seq_length(shape, degree, d, "tp_sp", candidate="hybrid")
        for d in ("fwd", "total")
    }
    tsp, tp_sp = make_strategy("tsp", degree), make_strategy("tp_sp", degree)
    regions = throughput_regions(m, hw, tsp, tp_sp, gpus, o)
    thr = regions[-1][0] if regions and regions[-1][1] is None else None
    return {
        "model": m,
        "hardware": hw,
        "options": o,
        "seq": seq,
        "gpus": gpus,
        "degree": degree,
        "rows": rows,
        "bytes_crossover_seq": cross,
        "throughput_crossover_seq": thr,
        "hybrid_bytes_crossover_seq": hybrid_cross,
        "hybrid_throughput_regions": throughput_regions(
            m, hw, make_strategy("hybrid", degree), tp_sp, gpus, o
        ),
        "throughput_regions": regions,
        "strategies": strategies,
        "tsp_cp_comparison": (
            tsp_cp_comparison(m, hw, strategies, seq, gpus, o)
            if any(s.kind == "tsp_cp" for s in strategies)
            else []
        ),
    }


def _plan_moe(m, hw, seq, gpus, degree, strategies, o) -> dict:
    """``plan`` for an MoE model: TSP (its expert schedule chosen per ``o.moe_schedule``) and
    TP+SP with the experts folded onto the same D ranks; the bytes crossover of the expert ring
    against the alltoall dispatcher and where TSP trains faster than TP+SP."""
    strategies = strategies or default_strategies(degree, MOE_KINDS)
    rows = [evaluate(m, hw, s, seq, gpus, o) for s in strategies]
    tsp, tp_sp = make_strategy("tsp", degree), make_strategy("tp_sp", degree)
    return {
        "model": m,
        "hardware": hw,
        "options": o,
        "seq": seq,
        "gpus": gpus,
        "degree": degree,
        "rows": rows,
        "strategies": strategies,
        "moe_ring_crossover_seq": moe.ring_crossover_seq(m, degree, o.micro_batch),
        "throughput_regions": throughput_regions(m, hw, tsp, tp_sp, gpus, o, lo=4096, hi=2**21),
    }


def moe_report(p: dict) -> List[str]:
    """The MoE lines of ``render``: each TSP row's expert schedule, the bytes crossover, where
    TSP is faster than TP+SP."""
    m, o = p["model"], p["options"]
    lines = [
        f"Mixture of experts ({m.num_experts} experts, top-{m.moe_topk}, {m.moe_layers} "
        f"MoE layers of {m.num_layers}):"
    ]
    for r in p["rows"]:
        other = r.get("moe_alternative")
        alt = (
            f" (the {other['schedule']} schedule: {other['tokens_per_s'] / 1e6:.3f}M tok/s)"
            if other
            else ""
        )
        lines.append(
            f"  {r['strategy']}: experts {r['moe_schedule']}"
            + (f", {o.moe_dispatcher} dispatcher, EP = D" if r["moe_schedule"] == "folded" else "")
            + f"; {r['tokens_per_s'] / 1e6:.3f}M tok/s{alt}"
        )
    lines.append(
        f"  bytes: the expert ring receives fewer than the alltoall dispatcher (EP = D, uniform "
        f"routing) from S = {p['moe_ring_crossover_seq']:,.0f} (micro-batch {o.micro_batch})"
    )
    regs = p["throughput_regions"]
    txt = ", ".join(f"[{a:,.0f}, {'2M+' if b is None else f'{b:,.0f}'}]" for a, b in regs)
    lines.append(
        "  predicted tokens/s, TSP >= TP+SP on this hardware for S in: "
        + (txt if regs else "nowhere in [4k, 2M]")
    )
    return lines


def tsp_cp_report(rows: List[dict], hw: HardwareSpec) -> List[str]:
    """The lines ``render`` prints for ``tsp_cp_comparison``."""
    lines = [
        f"TSP x CP vs TP+SP x CP at equal C, each at its cheapest recompute that fits in "
        f"{hw.hbm_gb:g} GB (step s / tokens/s; 'ring' is a what-if the layers do not implement):"
    ]
    for r in rows:
        parts = []
        for key in ("tsp_cp", "tsp_cp_ring", "tp_cp"):
            if key not in r:
                continue
            res = r[key]
            b = res["best"]
            if b is None:
                least = min(res["candidates"], key=lambda x: x["mem_bytes"])
                parts.append(f"{res['strategy']}: nothing fits ({least['mem_bytes'] / GB:.1f} GB)")
                continue
            parts.append(
                f"{res['strategy']}: {b['setting']}, {b['mem_bytes'] / GB:.1f} GB, "
                f"{b['step_s']:.1f} s, {b['tokens_per_s'] / 1e3:.1f}k tok/s"
            )
        lines.append(f"  C={r['cp']:<4} DP={r['dp']:<4} " + " | ".join(parts))
        a, t = r.get("tsp_cp", {}).get("best"), r.get("tp_cp", {}).get("best")
        if a and t:
            lines.append(
                f"  {'':<16} TSPxCP / TP+SPxCP step time: {a['step_s'] / t['step_s']:.2f}x"
            )
    return lines


def layer_time_report(
    m: ModelShape, hw: HardwareSpec, seq: int, gpus: int, degree: int, o: Options
) -> List[str]:
    """TSP vs TP+SP per-layer step time, each at its cheapest recompute that fits."""
    res = {k: cheapest_fitting_layer_time(m, hw, k, seq, gpus, degree, o) for k in ("tsp", "tp_sp")}
    lines = [
        f"Per-layer step time at the cheapest recompute that fits in {hw.hbm_gb:g} GB "
        "(TSP K/V collectives pipelined, fill/drain exposed; MLP ring hidden):"
    ]
    for k, r in res.items():
        b = r["best"]
        if b is None:
            lines.append(f"  {r['strategy']:<7} nothing fits")
            continue
        lines.append(
            f"  {r['strategy']:<7} recompute {b['setting']:<24} mem {b['mem_bytes'] / GB:6.1f}"
            f" GB  layer {1e3 * b['layer_s']:7.1f} ms (exposed comm "
            f"{1e3 * b['exposed_s']:.1f} ms)"
        )
    if res["tsp"]["best"] and res["tp_sp"]["best"]:
        ratio = res["tsp"]["best"]["layer_s"] / res["tp_sp"]["best"]["layer_s"]
        lines.append(f"  TSP / TP+SP per-layer time: {ratio:.2f}x")
    return lines


def render(p: dict) -> str:
    m, hw, o = p["model"], p["hardware"], p["options"]
    lines = [
        f"megatron-tsp plan: model {m.name}, S={p['seq']:,}, {p['gpus']} x {hw.name} "
        f"({p['gpus'] // hw.gpus_per_node} nodes), group D={p['degree']}, "
        f"micro-batch {o.micro_batch}",
        "",
    ]
    lines.append(format_table(p["rows"]))
    lines.append(
        "  mem = analytic peak per GPU without / with full recompute; rc = recompute used; "
        "comm = received bytes per layer per micro-batch; times per layer per micro-batch"
    )
    lines.append("")
    if m.is_moe:
        lines += moe_report(p)
        lines += ["", "Assumptions:"]
        lines += [f"  - {a}" for a in assumptions(m, hw, o, p["degree"], p["gpus"], p["seq"])]
        return "\n".join(lines)
    lines.append("Crossover (counted bytes, TSP <= baseline):")
    lines += crossover_report(m, p["degree"], o)
    c = p["bytes_crossover_seq"]
    lines.append(
        f"  at B={o.micro_batch}: S* fwd = {c['fwd']:,.0f}, fwd+bwd = {c['total']:,.0f} tokens"
    )
    regs = p["throughput_regions"]
    txt = ", ".join(f"[{a:,.0f}, {'4M+' if b is None else f'{b:,.0f}'}]" for a, b in regs)
    lines.append(
        "  predicted tokens/s, TSP >= TP+SP on this hardware for S in: "
        + (txt if regs else "nowhere in [1k, 4M]")
        + f" (B={o.micro_batch})"
    )
    hc = p["hybrid_bytes_crossover_seq"]
    lines.append(
        f"  hybrid (TP+SP attention + TSP MLP, --tsp-mlp) <= TP+SP bytes at B={o.micro_batch}: "
        f"S* fwd = {hc['fwd']:,.0f}, fwd+bwd = {hc['total']:,.0f} tokens "
        "(forward: B*S >= W_mlp / 2h)"
    )
    hregs = p["hybrid_throughput_regions"]
    txt = ", ".join(f"[{a:,.0f}, {'4M+' if b is None else f'{b:,.0f}'}]" for a, b in hregs)
    lines.append(
        "  predicted tokens/s, hybrid >= TP+SP on this hardware for S in: "
        + (txt if hregs else "nowhere in [1k, 4M]")
        + f" (B={o.micro_batch})"
    )
    if "tsp" in [r["kind"] for r in p["rows"]] and p["seq"] % (2 * p["degree"]) == 0:
        lines += [""] + layer_time_report(m, hw, p["seq"], p["gpus"], p["degree"], o)
    if p.get("tsp_cp_comparison"):
        lines += [""] + tsp_cp_report(p["tsp_cp_comparison"], hw)
    pc = paper_check(m, o)
    thr = (m.published or {}).get("throughput_tokens_per_s")
    if thr and thr["gpus"] == p["gpus"] and thr["hardware"] == hw.name and thr["seq"] == p["seq"]:
        by = {r["kind"]: r for r in p["rows"]}
        for kind in ("tsp", "tp_sp"):
            if kind in by:
                r = by[kind]
                layer_fwd = r["layer_fwd_tokens_per_s"] / 1e6
                pc.append(
                    f"    ours {r['strategy']:<7}: layer-fwd {layer_fwd:6.1f}M "
                    f"tok/s, end-to-end training {r['tokens_per_s'] / 1e6:5.2f}M tok/s"
                )
        if "tsp" in by and "tp_sp" in by:
            a, b = by["tsp"], by["tp_sp"]
            layer_fwd_ratio = a["layer_fwd_tokens_per_s"] / b["layer_fwd_tokens_per_s"]
            pc.append(
                f"    ratio TSP/TP+SP: ours layer-fwd {layer_fwd_ratio:.2f}x, "
                f"end-to-end {a['tokens_per_s'] / b['tokens_per_s']:.2f}x; published "
                + " / ".join(f"{thr['tsp'] / x:.2f}x" for x in thr["tp_sp"])
            )
    if pc:
        lines += ["", "Published numbers (for comparison, not used by the model):", *pc]
    lines += ["", "Assumptions:"]
    lines += [f"  - {a}" for a in assumptions(m, hw, o, p["degree"], p["gpus"], p["seq"])]
    return "\n".join(lines)


def _to_jsonable(p: dict) -> dict:
    out = {k: v for k, v in p.items() if k not in ("model", "hardware", "options", "strategies")}
    out["model"] = asdict(p["model"])
    out["hardware"] = asdict(p["hardware"])
    out["options"] = asdict(p["options"])
    out["assumptions"] = assumptions(
        p["model"], p["hardware"], p["options"], p["degree"], p["gpus"], p["seq"]
    )
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = ToolParser(
        prog="megatron-tsp plan",
        description="Analytic memory / communication / throughput plan for TSP vs TP+SP, CP, "
        "TPxCP and plain TP.",
    )
    ap.add_argument(
        "--model", default="7b", help=f"name ({', '.join(available('models'))}) or .json"
    )
    ap.add_argument(
        "--hardware", default="mi300x", help=f"name ({', '.join(available('hardware'))}) or .json"
    )
    ap.add_argument("--seq-length", type=positive_int, required=True)
    ap.add_argument("--gpus", type=positive_int, required=True)
    ap.add_argument("--degree", type=positive_int, default=8, help="group size D of every strategy")
    ap.add_argument("--micro-batch", type=positive_int, default=1)
    ap.add_argument(
        "--num-microbatches",
        type=positive_int,
        default=None,
        help="micro-batches per step (default: from --global-batch-tokens)",
    )
    ap.add_argument("--global-batch-tokens", type=positive_int, default=2**24)
    ap.add_argument(
        "--strategies",
        default="tsp,tp_sp,hybrid,cp,tp_cp,tp",
        help="comma-separated: tsp, tp_sp, hybrid (TP+SP attention + TSP MLP, "
        "--tsp-mlp), cp, tp_cp, tp, tsp_cp (TSP x CP, needs --cp), tsp_cp_ring (what-if: "
        "TSP x CP with a CP P2P ring across nodes, not implemented in the layers), fsdp_cp / "
        "fsdp_cp_ring (ZeRO-3 x CP over D, or D*C with --cp; K/V all-gather / P2P ring), gtp / "
        "gtp_mxfp8 / gtp_nvfp4 (Megatron-LM GTP: TP(T)+SP x GTP_remat(D/T), every T < D, "
        "weights gathered in bf16 / MXFP8 / NVFP4)",
    )
    ap.add_argument(
        "--cp",
        type=positive_int_list,
        default=[],
        help="comma-separated context-parallel sizes C: tsp_cp / tsp_cp_ring / tp_cp become "
        "TSP or TP+SP of --degree (inside a node) x CP of each C (across nodes); sizes whose "
        "D*C does not divide --gpus are skipped",
    )
    ap.add_argument("--recompute", choices=("auto", "none", "full"), default="auto")
    ap.add_argument("--no-distributed-optimizer", action="store_true")
    ap.add_argument("--efficiency", type=fraction, help="override the profile's compute efficiency")
    ap.add_argument(
        "--comm-efficiency", type=fraction, help="override the profile's comm efficiency"
    )
    ap.add_argument(
        "--tsp-recompute-fc1",
        action="store_true",
        help=RECOMPUTE_FC1_HELP,
    )
    ap.add_argument(
        "--tsp-recompute-attn",
        action="store_true",
        help="TSP attention_backward='recompute' (default: 'saved', as the layers)",
    )
    ap.add_argument(
        "--compute-model",
        choices=("measured", "flops"),
        default="measured",
        help="TSP / TP+SP / FSDP x CP layer compute time: 'measured' prices every kernel the "
        "layer issues (recorded once on shape-only tensors, ~1 min, cached; roofline of FLOPs, "
        "HBM bytes and a launch floor per kernel), 'flops' counts GEMM + attention FLOPs only",
    )
    ap.add_argument(
        "--tsp-kv-grad-reduce-in-fp32",
        action="store_true",
        help="TSP's dK/dV reduce-scatter in fp32 (Megatron-LM's --tsp-kv-grad-reduce-in-fp32; "
        "default: the compute dtype)",
    )
    ap.add_argument(
        "--tsp-activation-sums-in-fp32",
        action="store_true",
        help="TSP's MLP output and input gradients summed over shards in fp32 (Megatron-LM's "
        "--tsp-activation-sums-in-fp32; default: in place in the compute dtype)",
    )
    ap.add_argument(
        "--moe-schedule",
        choices=("auto", *moe.SCHEDULES),
        default="auto",
        help="MoE models, TSP: experts folded onto the TSP axis (EP = D), the TSP expert ring, "
        "or auto (the faster that fits)",
    )
    ap.add_argument(
        "--moe-token-dispatcher-type",
        choices=moe.DISPATCHERS,
        default="alltoall",
        help="MoE models: megatron-core's token dispatcher of the folded layout",
    )
    ap.add_argument(
        documents.MIX_FLAG,
        default="",
        metavar="MIX",
        help="packed documents, a length mix (single, uniform:LO-HI, heavy:ALPHA,LO-HI, "
        "long+short:L,LO-HI, fixed:L1,L2,...; k = 1024; see megatron-tsp documents): the "
        "attention FLOPs follow the in-document pairs (sum L^2 / S^2 of the one-document "
        "term, mean of 8 seeded draws per S) and its time the slowest rank of each strategy's "
        "layout (TSP: today's zigzag; CP layouts: TE's THD; TP / TP+SP: balanced). Memory is "
        "unchanged: flash attention saves per-token tensors whatever the mask, so "
        "megatron-tsp memory has no --documents (THD's padding, < 2 x CP tokens per document, "
        "is not priced)",
    )
    ap.add_argument("--plot", default="", help="also plot the sweep as a PNG at this path")
    ap.add_argument(
        "--sweep",
        type=positive_int_list,
        default=[],
        help="comma-separated sequence lengths for the plot (default 4k..max(256k, 2S))",
    )
    ap.add_argument("--json", default="", help="also write the result as JSON here")
    ap.add_argument("--verbose", action="store_true", help="per-term communication breakdown")
    ap.add_check(check_args)
    return ap


def check_args(args) -> None:
    """Before any planning: the model and hardware load, D divides --gpus, D*C >= 2 per --cp."""
    for flag, load in (("--model", load_model), ("--hardware", load_hardware)):
        value = getattr(args, flag[2:])
        try:
            setattr(args, flag[2:] + "_loaded", load(value))
        except SystemExit as exc:  # the loaders' refusal, already naming the choices
            raise UsageError(f"{flag} {value}", str(exc)) from None
    if args.gpus % args.degree:
        raise UsageError("--gpus", f"{args.gpus} is not a multiple of --degree {args.degree}")
    if args.documents:
        documents.parse_mix(args.documents)  # a ValueError naming --documents
    kinds = [k.strip() for k in args.strategies.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in STRATEGY_NAMES]
    if unknown:
        raise UsageError(
            "--strategies",
            f"unknown strategy {', '.join(unknown)} (choose from {', '.join(STRATEGY_NAMES)})",
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)  # every input checked
    m, hw = args.model_loaded, args.hardware_loaded
    if args.efficiency is not None:
        hw.compute_efficiency = args.efficiency
    if args.comm_efficiency is not None:
        hw.comm_efficiency = args.comm_efficiency
    o = Options(
        micro_batch=args.micro_batch,
        num_microbatches=args.num_microbatches,
        global_batch_tokens=args.global_batch_tokens,
        recompute=args.recompute,
        distributed_optimizer=not args.no_distributed_optimizer,
        tsp_recompute_fc1=args.tsp_recompute_fc1,
        tsp_recompute_attn=args.tsp_recompute_attn,
        compute_model=args.compute_model,
        tsp_kv_grad_fp32=args.tsp_kv_grad_reduce_in_fp32,
        tsp_activation_sums_fp32=args.tsp_activation_sums_in_fp32,
        moe_schedule=args.moe_schedule,
        moe_dispatcher=args.moe_token_dispatcher_type,
        documents=args.documents,
    )
    kinds = [k.strip() for k in args.strategies.split(",") if k.strip()]
    if m.is_moe:
        refused = [k for k in kinds if k not in MOE_KINDS]
        if refused and args.strategies != build_parser().get_default("strategies"):
            print(
                f"megatron-tsp plan: --strategies {','.join(refused)}: model {m.name} has "
                f"num_experts={m.num_experts}; MoE layers are modelled under "
                f"{', '.join(MOE_KINDS)} only",
                file=sys.stderr,
            )
            return 2
        kinds = [k for k in kinds if k in MOE_KINDS]
    cps = list(args.cp)
    bad = [c for c in cps if c < 2 or args.gpus % (args.degree * c)]
    if bad:
        print(
            f"megatron-tsp plan: skipping --cp {bad} (each C >= 2 with D*C dividing --gpus)",
            file=sys.stderr,
        )
    cps = [c for c in cps if c not in bad]
    if not cps and {"tsp_cp", "tsp_cp_ring"} & set(kinds):
        print("megatron-tsp plan: tsp_cp needs --cp C", file=sys.stderr)
        return 2
    strategies = default_strategies(args.degree, kinds, cps)
    # fsdp_cp over D*C ranks and gtp's T*C replicas with R of them per GTP_remat group need
    # their sizes to divide the GPUs
    fitting = [
        s
        for s in strategies
        if s.kind not in ("fsdp_cp", "gtp")
        or (args.gpus % s.degree == 0 and (args.gpus // s.degree) % s.remat == 0)
    ]
    if len(fitting) < len(strategies):
        skipped = [s.label for s in strategies if s not in fitting]
        print(
            f"megatron-tsp plan: skipping {', '.join(skipped)} (sizes do not divide --gpus)",
            file=sys.stderr,
        )
    strategies = fitting
    if not strategies:
        print("megatron-tsp plan: no strategy left to plan", file=sys.stderr)
        return 2
    if args.seq_length % (2 * args.degree):
        print(
            f"warning: S={args.seq_length} not divisible by 2D={2 * args.degree} "
            "(zigzag TSP/CP need it)",
            file=sys.stderr,
        )
    p = plan(m, hw, args.seq_length, args.gpus, args.degree, strategies, o)
    print(render(p))
    if args.verbose:
        shape = LayerShape.of(m, o.micro_batch, args.seq_length)
        for s in strategies:
            print(f"\n{s.label} per-layer terms (received MB per rank):")
            for t in layer_terms(shape, s, o):
                print(
                    f"  {t.phase:<9}{t.op:<15}{t.category:<11}{t.overlap:<10}"
                    f"{t.nbytes / 2**20:>11.1f}  {t.what}"
                )
    if args.plot or args.json:
        seqs = (
            list(args.sweep)
            if args.sweep
            else [
                4096 * 2**i
                for i in range(int(math.log2(max(262144, 2 * args.seq_length) / 4096)) + 1)
            ]
        )
        sw = sweep(m, hw, strategies, seqs, args.gpus, o)
    if args.plot:
        from .plot import plot_sweep

        path = plot_sweep(sw, seqs, p, args.plot)
        print(f"\nplot: {path}" if path else "\nplot: skipped (matplotlib is not installed)")
    if args.json:
        d = _to_jsonable(p)
        d["sweep"] = {"seqs": seqs, "rows": sw}
        Path(args.json).write_text(json.dumps(d, indent=1, default=float))
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
