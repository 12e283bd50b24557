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

Models are the package's model files (``megatron_tsp/models/``, ``core.model_shape``), hardware
profiles JSON files in ``megatron_tsp/tools/estimator/hardware/``; ``--model`` and ``--hardware``
take a shipped name or a path to your own file with the same keys.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from megatron_tsp.core import model_shape
from megatron_tsp.core.model_shape import ModelShape, available_models

from . import formulas as fm
from . import measured_traffic, moe
from .formulas import LayerShape

HERE = Path(__file__).resolve().parent
GB = 1e9


# ---------------------------------------------------------------------------------------------
# data files
# ---------------------------------------------------------------------------------------------
@dataclass
class HardwareSpec:
    name: str
    peak_bf16_tflops: float
    hbm_gb: float
    gpus_per_node: int
    topology: str  # full_mesh | switch
    link_GBps: float
    links_per_gpu: int
    nic_per_node: int
    nic_gbps: float
    compute_efficiency: float
    comm_efficiency: float
    description: str = ""
    assumptions: List[str] = field(default_factory=list)
    # the measured-traffic compute model (``measured_traffic``): HBM bandwidth, the share of it
    # element-wise kernels sustain, and the floor a kernel costs however small it is
    hbm_GBps: float = 0.0
    hbm_efficiency: float = 0.8
    kernel_launch_us: float = 0.0

    @property
    def nic_GBps_per_gpu(self) -> float:
        return self.nic_per_node * self.nic_gbps / 8 / self.gpus_per_node

    def bandwidth(self, size: int, stride: int = 1, link: str = "collective") -> float:
        """Bytes/s one rank receives at, in a group of ``size`` ranks spaced ``stride`` apart.

        Inside a node: switch -> full link bandwidth for any op; full mesh -> a collective uses
        one link per peer (size-1 links), a P2P step one link. Across nodes: a ring with k members
        per node pushes its inter-node traffic through those k GPUs' NICs (k x NIC share),
        capped by the intra-node bandwidth of the k local members."""
        size = max(size, 2)
        if size * stride <= self.gpus_per_node:
            return self._intra(size, link) * GB * self.comm_efficiency
        k = max(1, min(size, self.gpus_per_node // stride)) if stride < self.gpus_per_node else 1
        inter = k * self.nic_GBps_per_gpu
        bw = min(inter, self._intra(k, link)) if k > 1 else inter
        return bw * GB * self.comm_efficiency

    def _intra(self, size: int, link: str) -> float:
        if self.topology == "switch" or link == "p2p":
            return self.link_GBps
        return min(size - 1, self.links_per_gpu) * self.link_GBps

    @property
    def flops(self) -> float:
        return self.peak_bf16_tflops * 1e12 * self.compute_efficiency

    def kernel_costs(self) -> "measured_traffic.KernelCosts":
        if self.hbm_GBps <= 0:
            raise ValueError(
                f"hardware {self.name!r} gives no hbm_GBps: the measured-traffic compute model "
                "needs it (or use --compute-model flops)"
            )
        return measured_traffic.KernelCosts(
            flops_per_s=self.flops,
            hbm_bytes_per_s=self.hbm_GBps * GB * self.hbm_efficiency,
            launch_s=self.kernel_launch_us * 1e-6,
        )


def _resolve(kind: str, name_or_path: str) -> Path:
    """A hardware profile (``hardware/<name>.json``) by name, or a ``.json`` path."""
    p = Path(name_or_path)
    if p.suffix == ".json" and p.exists():
        return p
    p = HERE / kind / f"{name_or_path.lower()}.json"
    if p.exists():
        return p
    avail = sorted(x.stem for x in (HERE / kind).glob("*.json"))
    raise SystemExit(f"unknown {kind[:-1]} {name_or_path!r}: give one of {avail} or a .json path")


def available(kind: str) -> List[str]:
    """Shipped names: ``models`` (``megatron_tsp/models``, shared with configs and the memory
    tool) or ``hardware``."""
    if kind == "models":
        return available_models()
    return sorted(x.stem for x in (HERE / kind).glob("*.json"))


def load_model(name_or_path: Union[str, ModelShape]) -> ModelShape:
    try:
        return model_shape.load_model(name_or_path)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc


def load_hardware(name_or_path: Union[str, HardwareSpec]) -> HardwareSpec:
    if isinstance(name_or_path, HardwareSpec):
        return name_or_path
    d = json.loads(_resolve("hardware", name_or_path).read_text())
    intra, nic, eff = d["intra_node"], d["nic"], d["efficiency"]
    return HardwareSpec(
        name=d["name"],
        peak_bf16_tflops=d["peak_bf16_tflops"],
        hbm_gb=d["hbm_gb"],
        gpus_per_node=d["gpus_per_node"],
        topology=intra["topology"],
        link_GBps=intra["link_GBps"],
        links_per_gpu=intra["links_per_gpu"],
        nic_per_node=nic["per_node"],
        nic_gbps=nic["gbps"],
        compute_efficiency=eff["compute"],
        comm_efficiency=eff["comm"],
        description=d.get("description", ""),
        assumptions=d.get("assumptions", []) + ([intra["note"]] if "note" in intra else []),
        hbm_GBps=d.get("hbm_GBps", 0.0),
        hbm_efficiency=eff.get("hbm", 0.8),
        kernel_launch_us=d.get("kernel_launch_us", 0.0),
    )


# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Strategy:
    kind: str  # tsp, tp_sp, hybrid, tp, cp, tp_cp, tsp_cp
    tp: int = 1  # tensor (or TSP) degree
    cp: int = 1
    # TSP x CP's K/V exchange: "all_gather" over the D*C sequence group (what the layers do) or
    # "ring" (what-if: a CP P2P ring across nodes, the TSP gather inside the node)
    kv_flavour: str = "all_gather"

    @property
    def degree(self) -> int:
        return self.tp * self.cp

    @property
    def label(self) -> str:
        return {
            "tsp": f"TSP{self.tp}",
            "tp_sp": f"TP{self.tp}+SP",
            "hybrid": f"TP{self.tp}+SP+TSP-MLP",
            "tp": f"TP{self.tp}",
            "cp": f"CP{self.cp}",
            "tp_cp": f"TP{self.tp}+SPxCP{self.cp}",
            "tsp_cp": f"TSP{self.tp}xCP{self.cp}" + (" ring" if self.kv_flavour == "ring" else ""),
        }[self.kind]

    @property
    def is_tsp(self) -> bool:
        """TSP layers (weights move, tokens stay), with or without CP."""
        return self.kind in ("tsp", "tsp_cp")

    @property
    def weight_shards(self) -> int:
        return self.tp  # CP replicates the weights


def make_strategy(kind: str, degree: int, tp: Optional[int] = None) -> Strategy:
    """``degree``: the whole group (T*C for tp_cp / tsp_cp, whose ``tp`` must divide it)."""
    if kind in ("tsp", "tp_sp", "hybrid", "tp"):
        return Strategy(kind, tp=degree)
    if kind == "cp":
        return Strategy(kind, cp=degree)
    if kind in ("tp_cp", "tsp_cp", "tsp_cp_ring"):
        if tp is None or degree % tp:
            raise ValueError(f"{kind} needs tp dividing {degree}")
        if kind == "tp_cp":
            return Strategy(kind, tp=tp, cp=degree // tp)
        flavour = "ring" if kind == "tsp_cp_ring" else "all_gather"
        return Strategy("tsp_cp", tp=tp, cp=degree // tp, kv_flavour=flavour)
    raise ValueError(f"unknown strategy {kind!r}")


def default_strategies(
    degree: int,
    kinds: Sequence[str] = ("tsp", "tp_sp", "hybrid", "cp", "tp_cp", "tp"),
    cps: Sequence[int] = (),
) -> List[Strategy]:
    """One strategy per kind over a group of ``degree``; with ``cps`` (context-parallel sizes C),
    tp_cp / tsp_cp / tsp_cp_ring are TP+SP or TSP of ``degree`` times CP of each C."""
    out = []
    for k in kinds:
        if k in ("tsp_cp", "tsp_cp_ring") or (k == "tp_cp" and cps):
            if not cps:
                raise ValueError(f"{k} needs the context-parallel sizes (--cp C)")
            out += [make_strategy(k, degree * c, degree) for c in cps]
        elif k == "tp_cp":
            out += [
                make_strategy(k, degree, t)
                for t in range(2, degree)
                if degree % t == 0 and degree // t >= 2
            ]
        else:
            out.append(make_strategy(k, degree))
    return out


def _as_strategy(strategy: Union[str, Strategy], degree: Optional[int]) -> Strategy:
    if isinstance(strategy, Strategy):
        return strategy
    if degree is None:
        raise ValueError("give degree= with a strategy name")
    if strategy in ("tsp_cp", "tsp_cp_ring"):
        raise ValueError(f"{strategy}: give a Strategy (TSP and CP sizes)")
    if strategy == "tp_cp":
        t = int(math.isqrt(degree))
        while degree % t:
            t -= 1
        return make_strategy("tp_cp", degree, t)
    return make_strategy(strategy, degree)


# ---------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------
@dataclass
class Options:
    """Knobs of the analytic model (defaults = what the implementation does)."""

    micro_batch: int = 1
    num_microbatches: Optional[int] = None  # None: ceil(global_batch_tokens / (DP * B * S))
    global_batch_tokens: int = 2**24
    recompute: str = "auto"  # none | full | auto (none if it fits in HBM, else full)
    distributed_optimizer: bool = True
    # TSP's opt-in fc1 recompute (``mlp_recompute_activation=True``); the default keeps the
    # per-shard fc1 outputs and recomputes only what Megatron's flags ask for
    tsp_recompute_mlp: bool = False
    tsp_recompute_attn: bool = False  # TSP attention_backward="recompute" (default: "saved")
    tsp_regather_kv: bool = True
    # attention kernel backend (layers/kernels.py): "aten_flash" (one call per zigzag chunk,
    # native GQA), "cudnn" / "cpu_flash" (top-left causal: a chunk runs as prefix + diagonal,
    # whose dK/dV parts are not joined; they repeat K/V for GQA), "te_fused" (one call per chunk
    # on contiguous bshd copies of K/V). The layers pick cudnn on sm90+ for MHA; there its memory
    # equals aten_flash's, so the default models both.
    attn_kernel: str = "aten_flash"
    cp_regather_kv: bool = True
    # the dX GEMM's fp32 accumulation copies its bf16 operands to fp32 (``precision.matmul_acc``
    # off CUDA, where the GEMM cannot write fp32 from bf16 inputs); None: iff attn_kernel is the
    # CPU kernel ("cpu_flash"), i.e. a CPU run such as the fake-tensor tool's
    cpu_gemm_upcast: Optional[bool] = None
    grad_reduce_bytes: int = 4  # fp32 grad reduction (bf16 runs accumulate-allreduce-grads-in-fp32)
    # TSP weight-gradient traffic (owner reduce, MLP gradient ring) bytes per element: None = the
    # accumulation dtype, as the layers send it (fp32 in bf16 runs); 2 is a what-if (bf16 wire)
    tsp_grad_comm_bytes: Optional[int] = None
    # TSP's dK/dV reduce-scatter in the accumulation dtype (--tsp-kv-grad-reduce-in-fp32);
    # default: the compute dtype, after the local fp32 sum over the chunks
    tsp_kv_grad_fp32: bool = False
    # the TSP MLP output and the input gradients summed over shards / head groups in fp32
    # (--tsp-activation-sums-in-fp32); default: in place in the compute dtype
    tsp_activation_sums_fp32: bool = False
    # TSP's loss on the vocabulary ring: its policy (--tsp-vocab-ring auto | always | never;
    # auto: where it receives fewer bytes than Megatron's output layer)
    tsp_vocab_ring: str = "auto"
    # MoE models: TSP's expert schedule ("folded": experts whole, EP = D; "ring": the TSP expert
    # ring; "auto": the ring where it receives fewer bytes, ``moe.choose_schedule``) and the
    # folded layout's token dispatcher (TP+SP runs the folded layout with it too)
    moe_schedule: str = "auto"
    moe_dispatcher: str = "alltoall"
    bwd_factor: float = 2.0
    causal_fraction: float = 0.5
    overlap_dp: bool = True  # overlap_grad_reduce / overlap_param_gather
    # compute time of a TSP / TP+SP layer: "measured" prices the kernels the layer really issues
    # (recorded once by the traffic benchmark, see measured_traffic); "flops" is GEMM + attention
    # FLOPs at the profile's efficiency (the other strategies always use it)
    compute_model: str = "measured"


MOE_KINDS = ("tsp", "tp_sp")


def moe_schedule(shape: LayerShape, s: Strategy, o: Options) -> Optional[str]:
    """The expert schedule of ``s``'s MoE layers (None for a dense layer): TSP's per
    ``o.moe_schedule``, TP+SP's the folded layout (EP = D). Other strategies have no MoE model
    here: refused by name."""
    if not shape.is_moe:
        return None
    if s.kind not in MOE_KINDS:
        raise ValueError(
            f"strategy {s.kind}: the planner models MoE layers (model {shape.name or '?'}, "
            f"num_experts={shape.num_experts}) under {', '.join(MOE_KINDS)} only"
        )
    if s.kind == "tp_sp":
        return "folded"
    tokens = shape.tokens // s.tp
    return moe.choose_schedule(shape, s.tp, tokens, o.moe_schedule, o.moe_dispatcher)


def _layer_activation_bytes(
    shape: LayerShape, s: Strategy, o: Options, rope: bool = True
) -> Dict[str, float]:
    """Bytes one layer keeps for its backward on one rank (no full recompute), tensor by tensor,
    as the code saves them (measured with saved-tensor hooks and the fake-tensor tool).

    TSP (t = local tokens B*S/D, B*S/(D*C) under TSP x CP): the two norm inputs and outputs
    (the layer input, the attention Function's input, the residual, the MLP Function's input),
    the norms' statistics; saved attention backward: the rotated q and each head group's packed
    local K/V, the attention output (kept once, saved once) and fp32 log-sum-exp; the MLP its
    per-shard fc1 outputs (only its input with TSP's opt-in fc1 recompute,
    ``tsp_recompute_mlp=True``). The RoPE tables are per step (``_tsp_step_tables``).
    Megatron TP(+SP) / CP (t = B*S/C tokens, T = TP): norm inputs/outputs (1/T of t with SP), the
    QKV GEMM output (kept alive by the v view), the rotated q and k, the attention output, the
    fp32 log-sum-exp, unfused RoPE's cos/sin (two [t, hn] bf16 per rotated tensor), the MLP
    intermediates (fc1 output, activation output, and for GLUs the activated half)."""
    if shape.is_moe:  # the dense layer's attention, norms and residual, the MoE layer's MLP
        out = _layer_activation_bytes(moe.dense_layer(shape), s, o, rope)
        out = {k: v for k, v in out.items() if not k.startswith("mlp_")}
        return {**out, **moe.saved_bytes(shape, s.tp, moe_schedule(shape, s, o))}
    h, hkv, hn = shape.hidden, shape.kv_hidden, shape.head_dim
    b = shape.dtype_bytes
    F_, rows = shape.ffn_hidden, shape.fc1_rows
    bs = shape.tokens
    norm_stats = 2 if shape.normalization == "LayerNorm" else 1  # mean + rstd, or rstd
    if s.is_tsp:
        t = bs / s.degree  # TSP x CP: the tokens are spread over the D*C sequence ranks
        out = {
            # the layer input (saved by the input norm), the attention Function's input (the
            # norm output), the residual after attention and the MLP Function's input
            "norm_in_out": 4 * t * h * b,
            "norm_stats": 2 * norm_stats * t * b,
            # the RoPE tables are built once per step (``_tsp_step_tables``), not per layer
        }
        if not o.tsp_recompute_attn:
            out["attn_qkv"] = t * (h + 2 * hkv) * b
            out["attn_out"] = t * h * b  # saved once (the chunks' output rows)
            out["attn_lse"] = t * shape.heads * 4
        if not o.tsp_recompute_mlp:
            out["mlp_fc1_out"] = t * rows * b
        return out
    t = bs / s.cp
    sp = s.kind in ("tp_sp", "hybrid", "tp_cp", "cp")
    rep = t / s.tp if sp else t  # tensors in the residual-stream layout
    T = s.tp
    mid = rows + F_ + (F_ if shape.gated else 0)
    out = {
        "norm_in_out": 4 * rep * h * b,
        "norm_stats": 2 * norm_stats * rep * b,
        "qkv_gemm_out": t * (h + 2 * hkv) / T * b,
        "rotated_qk": t * (h + hkv) / T * b if rope else 0.0,
        "rope_cos_sin": 4 * t * hn * b if rope else 0.0,
        "attn_out": t * h / T * b,
        "attn_lse": t * shape.heads / T * 4,
        "mlp_mid": t * mid / T * b,
    }
    if s.kind == "hybrid":
        # The TSP MLP keeps only its (local) input, already counted in norm_in_out, unless it
        # keeps the per-shard fc1 outputs (B*S/D tokens x every shard's fc1 rows).
        out["mlp_mid"] = 0.0 if o.tsp_recompute_mlp else (bs / s.tp) * rows * b
    return out


def _head_groups(shape: LayerShape, D: int) -> int:
    """Head groups TSP attention walks: D (one weight shard each), or the query-group count when
    there are fewer K/V heads than ranks (a group then spans D / groups shards: its step holds
    all of the group's np/ng query heads and its one K/V head, megatron-core's TP layout)."""
    return min(D, shape.groups)


def _tsp_comm_workspace(
    shape: LayerShape,
    D: int,
    kv_grad_fp32: bool = False,
    saved_attention: bool = True,
    grad_slots: Optional[int] = None,
    cp: int = 1,
    kv_flavour: str = "all_gather",
):
    """Bytes of TSP attention's persistent communication buffers (``comm.WORKSPACE``, shared by
    all layers, allocated on first use): (in forward, in backward). G: the head groups
    (``_head_groups``: D, or the query groups when fewer); a kind of buffer has one slot per
    head group in flight, min(2, G) slots. Forward, per slot: the gathered [S, b, 2 h_kv / G]
    K/V (``attention._post_kv_gather``: late chunks in owner order, then the early chunks, read
    as they arrive, then a copy of this rank's late chunk); with recomputed attention also the
    packed local K/V send buffers [S/D, b, 2 h_kv / G] (one per slot; saved attention keeps a
    fresh send buffer per head group instead, counted with the saved tensors). Backward adds,
    per slot, a dK/dV send buffer [S, b, 2 h_kv / G] and its receive buffer [S/D, ...] in the
    dK/dV wire dtype (the model dtype; the accumulation dtype with ``kv_grad_fp32``).
    ``grad_slots``: how many of the backward slots exist (default: all; the first layer's
    backward allocates them one head group at a time, see ``_tsp_backward_peak``). TSP x CP
    (``cp`` = C): the gathered buffers still span the whole sequence, the local ones are
    [S/(DC), ...]; the what-if ring (``kv_flavour="ring"``, not in the layers) holds two node
    blocks [S/C, ...] (the one attended and the one in flight) where the all-gather holds the
    whole sequence."""
    b = shape.dtype_bytes
    acc = fm.accumulation_bytes(b) if kv_grad_fp32 else b
    G = _head_groups(shape, D)
    slots = min(2, G)
    kv_full = 2 * shape.tokens * shape.kv_hidden / G
    kv_local = kv_full / (D * cp)
    if kv_flavour == "ring" and cp > 1:
        kv_full = 2 * kv_full / cp
        gathered = slots * kv_full + kv_full  # per slot the block in flight, one attended
    else:  # per slot the gathered K/V (``attention._post_kv_gather``: no reordered copy) and
        # the copy of this rank's late chunk after it (half its local K/V)
        gathered = slots * (kv_full + (kv_local / 2 if D * cp > 1 else 0))
    fwd = (gathered + (0 if saved_attention else slots * kv_local)) * b
    grad_slots = slots if grad_slots is None else grad_slots
    return fwd, fwd + grad_slots * (kv_full + kv_local) * acc


_TOP_LEFT_KERNELS = ("cudnn", "cpu_flash")
_REPEAT_KV_KERNELS = ("cudnn", "cpu_flash")
_COPY_KV_KERNELS = ("te_fused",)  # contiguous copies of the chunk's K/V beside their dK/dV


def _kernel_dkv_bytes(shape: LayerShape, D: int, kernel: str) -> float:
    """What the attention kernel's backward holds for the largest zigzag chunk (its keys span the
    whole sequence S), before ``TSPLayout.key_pieces`` are summed into the send buffer: the kernel's
    dK and dV over S keys for one head group. A top-left kernel runs the bottom-right chunk as a
    prefix block and a diagonal block and hands both parts over as they are (no concatenation,
    ``backward_parts``): S keys' worth, as one call would; te_fused holds contiguous copies of
    the chunk's K and V (as many bytes as its dK/dV) while its backward runs; a kernel without
    native GQA computes dK/dV per query head from K/V repeated to the query heads, then folds them
    to the key/value heads."""
    if kernel not in _TOP_LEFT_KERNELS + _COPY_KV_KERNELS + ("aten_flash", "sdpa_recompute"):
        raise ValueError(
            f"Options.attn_kernel={kernel!r}: choose aten_flash, cudnn, te_fused, "
            "cpu_flash or sdpa_recompute"
        )
    b = shape.dtype_bytes
    # K+V (or dK+dV) over S keys of one hidden unit, times the fraction of the heads one step has
    per_head_group = 2 * shape.tokens / _head_groups(shape, D) * b
    repeat = kernel in _REPEAT_KV_KERNELS and shape.heads != shape.groups
    width = shape.hidden if repeat else shape.kv_hidden  # heads the kernel computes dK/dV for
    out = per_head_group * width * (2 if kernel in _COPY_KV_KERNELS else 1)
    if repeat:  # the repeated K/V inputs and the folded dK/dV
        out += per_head_group * (shape.hidden + shape.kv_hidden)
    return out


def _tsp_backward_working_sets(
    shape: LayerShape, s: Strategy, o: Options
) -> Tuple[Dict[str, float], Dict[str, float]]:
    """One TSP layer's backward working set beyond what it saved and the comm workspace, in its
    two phases (they do not overlap: the MLP backward runs first and frees its buffers):
    (MLP backward, attention backward), tensor by tensor as ``mlp.py`` / ``attention.py`` hold
    them at their largest."""
    b = shape.dtype_bytes
    acc = fm.accumulation_bytes(b)
    bs, h = shape.tokens, shape.hidden
    D = s.tp
    gb = acc if o.tsp_grad_comm_bytes is None else o.tsp_grad_comm_bytes
    sums = acc if o.tsp_activation_sums_fp32 else b  # ``precision.activation_sum_dtype``
    t = bs / s.degree  # local tokens (TSP x CP: over the D*C sequence ranks)
    F_, rows = shape.ffn_hidden, shape.fc1_rows
    G = _head_groups(shape, D)
    m = D // G  # weight shards per head group: fewer K/V heads than D read several at once
    if shape.is_moe:
        _, attn = _tsp_backward_working_sets(moe.dense_layer(shape), s, o)
        return moe.backward_working_set(shape, D, moe_schedule(shape, s, o)), attn
    mlp = {
        "grad_out": t * h * b,  # the layer output's gradient, held through the layer
        "grad_x_accumulator": t * h * sums,
        # the shard being read and the next one in flight (the packed own shard is let go)
        "weight_shard_buffers": min(2, D) * shape.w_mlp / D * b,
        # own shard, two send buffers (one on the wire while the next is filled), one receive
        "grad_accumulators": (4 if D > 1 else 1) * shape.w_mlp / D * gb,
        # step t's activation output, its gradient and d(fc1 output), while step t-1's
        # activation output and d(fc1 output) rows are still referenced (they are rebound only
        # when ``input_grads`` returns)
        "mlp_shard_mid": (3 * F_ + 2 * rows) * t / D * b,
    }
    if o.tsp_recompute_mlp:
        mlp["mlp_shard_fc1_recomputed"] = t * rows / D * b
    if _cpu_gemm_upcast(o) and o.tsp_activation_sums_fp32:
        # ``precision.matmul_acc`` off CUDA: fp32 copies of d(fc1 output) and the fc1 shard
        mlp["dx_gemm_fp32_operands"] = (t * rows / D + rows * h / D) * acc
    hold = 3 if o.tsp_recompute_attn else 2
    attn = {
        "grad_out": t * h * b,
        "grad_x_accumulator": t * h * sums,
        "context_grad": t * h * b,  # d(context) [s/D, b, h] from the one projection GEMM
        # the packed own shard and the stream's spare buffers (``head_groups.GroupStream``)
        "weight_shard_buffers": (1 + min((hold + 1) * m, D)) * shape.w_attn / D * b,
        "weight_grad_partials": m * shape.w_attn / D * acc,  # one fp32 shard per weight shard
        # the first causal block's dK/dV (the kernel's output, up to half the sequence: rank
        # D-1's early chunk) kept while the second block's backward runs, until both are
        # summed into the send buffer
        "first_block_dkv": (bs * shape.kv_hidden / G) * b,
        "kernel_dkv_outputs": _kernel_dkv_bytes(shape, D, o.attn_kernel),
    }
    if s.kv_flavour == "ring":
        # what-if: the kernel sees one node block of S/C keys at a time
        attn["first_block_dkv"] /= s.cp
        attn["kernel_dkv_outputs"] /= s.cp
    if o.tsp_recompute_attn:
        # the head group's recomputed rotated q, attention output and fp32 log-sum-exp (its K/V
        # are recomputed into the workspace's send slots)
        attn["recomputed_q_out_lse"] = t * (2 * h * b + shape.heads * 4) / G
    return mlp, attn


def _tsp_step_tables(shape: LayerShape, s: Strategy, rope: bool) -> float:
    """Per-step tensors every TSP layer reads: Megatron's rotary frequencies [S, 1, 1, hn]
    (fp32, built by GPTModel; [S/C, ...] under CP, Megatron keeps this CP rank's chunks) and
    TSP's local RoPE tables (cos and the signed sines, [s/D, hn] in the model dtype, s/(DC)
    under CP, built once per step: ``rope.local_tables``)."""
    if not rope:
        return 0.0
    return shape.tokens / s.cp * shape.head_dim * 4 + 2 * shape.tokens / s.degree * (
        shape.head_dim * shape.dtype_bytes
    )


def _tsp_backward_peak(
    shape: LayerShape, s: Strategy, o: Options, num_layers: int, recompute: str, rope: bool
) -> float:
    """TSP's backward peak beyond params/grads/optimizer and the layers' stored activations
    (``num_layers`` x saved tensors, or x the layer input with full recompute), the largest of:
    the first backward layer (the last one) in its MLP and its attention phase, when the comm
    workspace holds only the forward buffers (its dK/dV buffers are allocated per head group
    as the attention backward reaches them), and a later layer in both phases, with the whole
    workspace but one layer less stored (its activations were freed)."""
    b = shape.dtype_bytes
    t = shape.tokens / s.degree
    saved = _layer_activation_bytes(shape, s, o, rope)
    full = sum(saved.values())
    # the MLP part of the saved tensors (freed by the time the attention backward runs): the
    # residual, the MLP Function's input with its norm statistics, the kept fc1 outputs
    mlp_part = 2 * t * shape.hidden * b + saved["norm_stats"] / 2
    mlp_part += sum(v for k, v in saved.items() if k.startswith(("mlp_", "moe_")))
    per_layer = full
    if recompute == "full":
        # the recomputed layer's saved tensors; its input is already stored (the checkpoint)
        full -= t * shape.hidden * b
        per_layer = t * shape.hidden * b
    mlp_work, attn_work = _tsp_backward_working_sets(shape, s, o)
    G = _head_groups(shape, s.tp)
    saved_attn = not o.tsp_recompute_attn
    ws = dict(cp=s.cp, kv_flavour=s.kv_flavour)
    _, ws_first_mlp = _tsp_comm_workspace(shape, s.tp, o.tsp_kv_grad_fp32, saved_attn, 0, **ws)
    # the first layer's attention: the kernel of the last group runs with the earlier groups'
    # send/receive slots allocated
    _, ws_first_attn = _tsp_comm_workspace(
        shape, s.tp, o.tsp_kv_grad_fp32, saved_attn, min(2, G - 1), **ws
    )
    _, ws_all = _tsp_comm_workspace(shape, s.tp, o.tsp_kv_grad_fp32, saved_attn, **ws)
    mlp_phase = full + sum(mlp_work.values())
    attn_phase = full - mlp_part + sum(attn_work.values())
    if recompute == "full":
        # the checkpoint's backward holds the recomputed layer output and its gradient until the
        # whole layer is done; the attention backward's incoming gradient (output gradient +
        # the MLP branch's) is then a second [s/D, b, h] tensor
        mlp_phase += t * shape.hidden * b
        attn_phase += 2 * t * shape.hidden * b
    # bytes beyond num_layers x per_layer: without recompute the current layer's saved tensors
    # are one of the stored layers; with full recompute its stored input is, and the recomputed
    # tensors (``full``) come on top
    offset = 0.0 if recompute == "full" else per_layer
    cands = [mlp_phase + ws_first_mlp - offset, attn_phase + ws_first_attn - offset]
    if num_layers > 1:  # a later layer: the layer after it (in forward order) was freed
        cands += [mlp_phase + ws_all - offset - per_layer, attn_phase + ws_all - offset - per_layer]
    extra = max(cands)
    if recompute == "full" and rope:
        extra += 3 * t * shape.head_dim * b  # the recomputed forward rebuilds the local tables
    return extra


def _layer_transient_bytes(shape: LayerShape, s: Strategy, o: Options) -> Dict[str, float]:
    """One layer's working set in its backward, beyond what it saved."""
    b = shape.dtype_bytes
    bs, h, hkv = shape.tokens, shape.hidden, shape.kv_hidden
    if s.is_tsp:
        mlp, attn = _tsp_backward_working_sets(shape, s, o)
        return mlp if sum(mlp.values()) >= sum(attn.values()) else attn
    t = bs / s.cp
    if s.kind == "hybrid":
        # attention: Megatron's gathered QKV input + dgrad; MLP: TSP's shard buffers, fp32
        # accumulators and one shard's intermediate
        D = s.tp
        gb = fm.accumulation_bytes(b) if o.tsp_grad_comm_bytes is None else o.tsp_grad_comm_bytes
        out = {
            "gathered_input_and_dgrad": 2 * t * h * b,
            "weight_shard_buffers": 2 * shape.w_mlp / D * b,
            "grad_accumulators": 4 * shape.w_mlp / D * gb,
            "grad_x_accumulator": (bs / D)
            * h
            * (fm.accumulation_bytes(b) if o.tsp_activation_sums_fp32 else b),
        }
        mid = shape.ffn_hidden + (shape.fc1_rows if o.tsp_recompute_mlp else 0)
        out["mlp_shard_mid"] = (bs / D) * mid / D * b
        return out
    if shape.is_moe:  # the MoE backward (no gathered input), then the attention's
        moe_work = moe.backward_working_set(shape, s.tp, moe_schedule(shape, s, o))
        attn_work = {"gathered_input_and_dgrad": 2 * t * h * b}
        return moe_work if sum(moe_work.values()) >= sum(attn_work.values()) else attn_work
    # the MLP backward holds the gradients of its saved intermediates next to them
    out = {"mlp_mid_grads": t * (shape.fc1_rows + shape.ffn_hidden) / s.tp * b}
    if s.kind in ("tp_sp", "tp_cp"):
        out["gathered_input_and_dgrad"] = 2 * t * h * b
    elif s.kind == "tp":
        out["row_output_before_allreduce"] = t * h * b
    if s.kind in ("cp", "tp_cp"):
        out["gathered_kv_and_dkv"] = 2 * (2 * bs * hkv / s.tp) * b
    return out


def _head_shape(shape: LayerShape, s, seq: int) -> LayerShape:
    """The micro-batch the output layer sees: under CP, this CP rank's S/C tokens."""
    return shape if s.cp == 1 else shape.with_seq(seq // s.cp)


def _cpu_gemm_upcast(o) -> bool:
    """Whether a GEMM with an fp32 result copies its bf16 operands to fp32 first
    (``Options.cpu_gemm_upcast``)."""
    return o.cpu_gemm_upcast if o.cpu_gemm_upcast is not None else o.attn_kernel == "cpu_flash"


def _vocab_ring_head_bytes(m: ModelShape, local_tokens: float, T: int, vpad: int, o) -> float:
    """The vocabulary ring's working set (``core.layers.vocab_ring``), the larger of its forward
    and its backward: the fp32 logits of the rank's own tokens over the whole vocabulary (the
    softmax and then its gradient, in place), one shard's GEMM output / gradient in the compute
    dtype, the weight ring's packed shard and spares, and in backward the four fp32
    gradient-accumulator shards and the dX accumulator."""
    b = m.dtype_bytes
    shard = vpad / T * m.hidden
    logits = local_tokens * vpad * fm.accumulation_bytes(b)  # fp32 (fp64 models: fp64)
    step = local_tokens * vpad / T * b
    weights = (1 + min(T - 1, 2)) * shard * b if T > 1 else 0.0
    forward = logits + step + weights
    sums = fm.accumulation_bytes(b) if o.tsp_activation_sums_fp32 else b
    grads = (4 if T > 1 else 1) * shard * fm.accumulation_bytes(b)
    backward = logits + step + weights + grads + local_tokens * m.hidden * sums
    if _cpu_gemm_upcast(o):  # the weight-gradient GEMM's fp32 operand copies (CPU)
        backward += (local_tokens * vpad / T + local_tokens * m.hidden) * 4
    return max(forward, backward)


def analytic_memory(
    model: Union[str, ModelShape],
    strategy: Union[str, Strategy],
    seq: int,
    micro_batch: int = 1,
    *,
    degree: Optional[int] = None,
    dp: int = 1,
    recompute: str = "none",
    distributed_optimizer: bool = True,
    options: Optional[Options] = None,
) -> Dict[str, float]:
    """Peak-memory model of one GPU in BYTES, by category (sum the values for the total).

    params      bf16 weights held by the rank (1/T of the sharded matrices and vocab-parallel
                embeddings, replicated norms / row biases; CP holds everything)
    grads       fp32 main grads for the local params (4 B/param)
    optimizer   fp32 master params + Adam m, v (12 B/param), divided over the data-parallel
                group (DP, or DP x CP for CP) when ``distributed_optimizer``
    activations tensors every layer keeps for its backward (``recompute='full'``: only each
                layer's input in the residual-stream layout)
    transient   (backward peak only) one layer's working set: TSP: two weight-shard buffers
                (current + prefetched), four fp32 gradient-accumulator shards, the fp32 grad_x
                accumulator, one head group's full-sequence K/V and dK/dV, one MLP shard's
                intermediate; TP+SP: gathered input + full dgrad; CP: gathered K/V and dK/dV;
                with full recompute also the recomputed layer's activations
    logits      (forward peak only) the all-gathered final hidden state, the output-layer logits
                [tokens, vocab/T] bf16 and the fp32 copy kept by the cross-entropy
    The peak is the larger of forward (activations + logits) and backward (activations +
    transient); the category not at the peak is 0.
    Not counted: dropout masks (dropout 0), softmax statistics, RNG state, allocator
    fragmentation, framework/NCCL workspaces, the embedding's own output.
    """
    m = load_model(model)
    o = options or Options()
    s = _as_strategy(strategy, degree)
    shape = LayerShape.of(m, micro_batch, seq)
    b = m.dtype_bytes
    T = s.weight_shards
    vpad = m.padded_vocab(T)
    moe_schedule(shape, s, o)  # an MoE model under a strategy without MoE layers: refused
    dense = moe.dense_layer(shape)
    sharded = dense.w_qkv + dense.b_qkv + dense.w_proj + dense.w_fc1 + dense.b_fc1 + dense.w_fc2
    n_moe = m.moe_layers
    layer_params = (m.num_layers - n_moe) * (sharded / T + dense.replicated_params)
    if n_moe:
        layer_params += n_moe * moe.layer_params(m, T)
    emb = vpad * m.hidden * (1 if m.tied_embeddings else 2)
    local_params = layer_params + emb / T + m.final_norm_params()
    dp_opt = dp * (s.cp if s.kind in ("cp", "tp_cp", "tsp_cp") else 1)
    opt_div = dp_opt if distributed_optimizer else 1

    # an MoE model's layers are dense first (``moe_dense_layers``), MoE after: the layer whose
    # backward runs first, and the largest, is an MoE layer
    layer_act = sum(_layer_activation_bytes(shape, s, o, m.rope).values())
    dense_act = sum(_layer_activation_bytes(dense, s, o, m.rope).values()) if n_moe else 0.0
    transient = sum(_layer_transient_bytes(shape, s, o).values())
    if recompute == "full":
        resid = shape.tokens / (s.degree if s.kind != "tp" else 1) * m.hidden * b
        activations = m.num_layers * resid
        backward_extra = layer_act + transient  # the recomputed layer and its backward
    elif recompute == "none":
        activations = (m.num_layers - n_moe) * (dense_act if n_moe else layer_act)
        activations += n_moe * layer_act
        backward_extra = transient
    else:
        raise ValueError(f"recompute must be none or full, got {recompute!r}")
    # Forward peak: every layer's saved tensors plus the output layer's: the final hidden state
    # (all-gathered over TP/TSP) and the bf16 logits [tokens, vocab/T] with the fp32 copy the
    # unfused cross-entropy keeps. Backward peak: the saved tensors plus one layer's working set
    # (the logits are gone by then). The peak is the larger of the two.
    head_tokens = shape.tokens / s.cp
    stream_tokens = head_tokens if s.kind == "tp" else head_tokens / T  # residual-stream layout
    vocab_ring = s.is_tsp and fm.vocab_ring_taken(_head_shape(shape, s, seq), T, o.tsp_vocab_ring)
    if vocab_ring:
        head = _vocab_ring_head_bytes(m, head_tokens / T, T, vpad, o)
    else:
        head = (
            head_tokens * vpad / T * (b + 4)  # bf16 logits + the cross-entropy's fp32 copy
            + head_tokens * m.hidden * b  # final hidden state all-gathered for the GEMM
        )
    logits = (
        head
        # last layer's output, final-norm output, the norm's normalised intermediate
        + 3 * stream_tokens * m.hidden * b
        # per-token ids/labels/positions (int64), loss and the cross-entropy's max,
        # sum-exp, predicted logit (fp32), target index (int64), mask: ~47 B
        + 47 * head_tokens
    )
    if s.is_tsp:
        ws_fwd, _ = _tsp_comm_workspace(
            shape,
            s.tp,
            o.tsp_kv_grad_fp32,
            saved_attention=not o.tsp_recompute_attn,
            cp=s.cp,
            kv_flavour=s.kv_flavour,
        )
        tables = _tsp_step_tables(shape, s, m.rope)
        logits += ws_fwd + tables
        backward_extra = (
            _tsp_backward_peak(shape, s, o, m.num_layers, recompute, m.rope)
            + tables
            # Megatron's global memory buffer keeps the output layer's all-gathered input
            # [tokens, b, h] (sequence-parallel GEMM) through the backward; the vocabulary
            # ring gathers nothing
            + (0.0 if vocab_ring else head_tokens * m.hidden * b)
        )
    forward_peak = logits >= backward_extra
    return {
        "params": local_params * b,
        "grads": local_params * 4,
        "optimizer": local_params * 12 / opt_div,
        "activations": activations,
        "transient": 0.0 if forward_peak else backward_extra,
        "logits": logits if forward_peak else 0.0,
    }


# ---------------------------------------------------------------------------------------------
# time
# ---------------------------------------------------------------------------------------------
def layer_terms(shape: LayerShape, s: Strategy, o: Options) -> List[fm.CommTerm]:
    if shape.is_moe:  # the dense layer's attention terms, the MoE layer's MLP terms
        schedule = moe_schedule(shape, s, o)
        attention = [t for t in layer_terms(moe.dense_layer(shape), s, o) if t.phase[:4] == "attn"]
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
    size, stride = {
        "tsp": (s.tp, 1),
        "tp": (s.tp, 1),
        "cp": (s.cp, s.tp),
        "seq": (s.tp * s.cp, 1),
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


def _flop_kw(s: Strategy, o: Options, full: bool) -> dict:
    return dict(
        recompute_mlp_fc1=(s.kind in ("tsp", "tsp_cp", "hybrid") and o.tsp_recompute_mlp),
        recompute_attn_core=(s.is_tsp and o.tsp_recompute_attn),
        full_recompute=full,
        causal_fraction=o.causal_fraction,
        bwd_factor=o.bwd_factor,
    )


def measured_layer(m: ModelShape, s: Strategy, hw: HardwareSpec, o: Options, seq: int):
    """The kernels one rank's layer issues at ``seq``, per phase (kernels, bytes, FLOPs, seconds:
    the sum of their rooflines), or None where the compute model is "flops" or the strategy has
    no recorded layer."""
    if o.compute_model == "flops" or s.kind not in measured_traffic.SCHEME_OF_KIND or m.is_moe:
        return None  # the recorded layers are dense: an MoE model's layers are priced by FLOPs
    if o.compute_model != "measured":
        raise ValueError(f"compute_model must be 'measured' or 'flops', got {o.compute_model!r}")
    dtype = {2: "bf16", 4: "fp32"}[m.dtype_bytes]
    curves = measured_traffic.layer_curves(m, s.degree, o.micro_batch, dtype)
    scheme = measured_traffic.SCHEME_OF_KIND[s.kind]
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
    fl = fm.layer_flops(shape, **_flop_kw(s, o, full))
    if measured is None:
        compute = {
            "fwd": fl["fwd"] / D / hw.flops,
            "bwd": (fl["bwd"] + fl["recompute"]) / D / hw.flops,
        }
    else:
        # the recorded layer runs the layers' defaults (attention core saved); the options the
        # recording did not run add their FLOPs
        fwd, bwd = measured["fwd"]["seconds"], measured["bwd"]["seconds"]
        extra = fl["recompute_attn_core"] / D / hw.flops if not full else 0.0
        compute = {"fwd": fwd, "bwd": bwd + extra + (fwd if full else 0.0)}
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
    }[s.kind]
    hc = fm.head_comm(_head_shape(shape, s, seq), s.tp, head_kind, vocab_ring=o.tsp_vocab_ring)
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
    if s.kind in ("tsp", "tp_sp", "hybrid", "tp_cp", "tsp_cp"):
        repl = fm.replicated_grad_allreduce(
            shape, s.tp, m.num_layers, m.final_norm_params(), o.grad_reduce_bytes
        ) / hw.bandwidth(s.tp, 1)
    with_cp = s.kind in ("cp", "tp_cp", "tsp_cp")
    dp_group = dp * (s.cp if with_cp else 1)
    dp_stride = s.tp if with_cp else s.degree
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

    def flops(layer_shape):
        kw = dict(causal_fraction=o.causal_fraction, bwd_factor=o.bwd_factor)
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
        f"fc1={o.tsp_recompute_mlp}, attention core={o.tsp_recompute_attn} in the backward",
        "hybrid (--tsp-mlp): TP+SP's attention collectives (fwd f*2BSh, bwd f*3BSh) + TSP's "
        "MLP weight ring (fwd f*W_mlp, bwd ring + grad accumulator 2f*W_mlp); the MLP keeps its "
        f"fc1 outputs unless it recomputes fc1 (= {o.tsp_recompute_mlp}, TSP's opt-in)",
        "TP+SP (megatron-core 0.16.1 layers.py): fwd AG+RS per block = f*4BSh, bwd re-AG of the "
        "saved input + dgrad RS (both async next to GEMMs) + AG of the row-parallel output grad "
        "= f*6BSh",
        "CP modelled as all-gather K/V (TE's default P2P ring moves the same bytes per rank); "
        f"bwd re-gather K/V={o.cp_regather_kv}; K/V traffic hides only behind attention compute",
        "TSP x CP (tsp_cp, --cp C): TSP's weight traffic inside the node (TSP group of D), each "
        "head group's K/V all-gather / dK/dV reduce-scatter over the D*C sequence group across C "
        "nodes (the node's NICs), pipelined one head group ahead as without CP; tsp_cp_ring is a "
        "what-if (not in the layers): the TSP gather per node block over NVLink paced against "
        "a one-NIC P2P hop across nodes, hidden behind attention compute; both use the FLOP "
        "compute model",
        "overlap: TSP weight/grad traffic is data-independent (prefetch, hides behind any compute "
        "of the phase) except the first forward weight broadcast (and with attention recompute "
        "the first backward one), the last attention weight-grad reduce and the MLP gradient "
        "ring's last hop; TSP K/V all-gathers / dK/dV reduce-scatters are "
        "pipelined one head group ahead (first group exposed); TP/SP "
        "activation collectives are on the critical path, except Megatron's async bwd re-gather "
        "/ dgrad RS / dgrad all-reduce; hidden comm is assumed not to slow compute; comm ops "
        "share the fabric serially; no latency term",
        (
            "compute (TSP, TP+SP): every kernel the layer issues, recorded on shape-only tensors "
            "at three sequence lengths and extrapolated exactly in S, priced max(FLOPs / "
            f"{hw.flops / 1e12:.0f} TFLOP/s, bytes / {hw.hbm_GBps * hw.hbm_efficiency:.0f} GB/s "
            f"HBM, {hw.kernel_launch_us} us launch floor) and summed per phase; other strategies: "
            "FLOPs as below"
            if o.compute_model == "measured"
            else "compute: FLOPs only (--compute-model flops)"
        ),
        "FLOPs: 2*B*S*W per GEMM, causal attention 2*2*B*S^2*h*0.5, backward = "
        f"{o.bwd_factor}x forward; zigzag balance assumed",
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
    tsp, tpsp = make_strategy("tsp", degree), make_strategy("tp_sp", degree)
    regions = throughput_regions(m, hw, tsp, tpsp, gpus, o)
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
            m, hw, make_strategy("hybrid", degree), tpsp, gpus, o
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
    tsp, tpsp = make_strategy("tsp", degree), make_strategy("tp_sp", degree)
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
        "throughput_regions": throughput_regions(m, hw, tsp, tpsp, gpus, o, lo=4096, hi=2**21),
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
        s = make_strategy(kind, degree) if kind != "tp_cp" else _as_strategy(kind, degree)
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
        "(TSP K/V collectives pipelined, fill/drain exposed; MLP ring hidden except the "
        "gradient's last hop):"
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
    ap = argparse.ArgumentParser(
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
    ap.add_argument("--seq-length", type=int, required=True)
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--degree", type=int, default=8, help="group size D of every strategy")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument(
        "--num-microbatches",
        type=int,
        default=None,
        help="micro-batches per step (default: from --global-batch-tokens)",
    )
    ap.add_argument("--global-batch-tokens", type=int, default=2**24)
    ap.add_argument(
        "--strategies",
        default="tsp,tp_sp,hybrid,cp,tp_cp,tp",
        help="comma-separated: tsp, tp_sp, hybrid (TP+SP attention + TSP MLP, "
        "--tsp-mlp), cp, tp_cp, tp, tsp_cp (TSP x CP, needs --cp), tsp_cp_ring (what-if: "
        "TSP x CP with a CP P2P ring across nodes, not implemented in the layers)",
    )
    ap.add_argument(
        "--cp",
        default="",
        help="comma-separated context-parallel sizes C: tsp_cp / tsp_cp_ring / tp_cp become "
        "TSP or TP+SP of --degree (inside a node) x CP of each C (across nodes); sizes whose "
        "D*C does not divide --gpus are skipped",
    )
    ap.add_argument("--recompute", choices=("auto", "none", "full"), default="auto")
    ap.add_argument("--no-distributed-optimizer", action="store_true")
    ap.add_argument("--efficiency", type=float, help="override the profile's compute efficiency")
    ap.add_argument("--comm-efficiency", type=float, help="override the profile's comm efficiency")
    ap.add_argument(
        "--tsp-recompute-mlp",
        action="store_true",
        help="TSP / hybrid MLP: TSP's opt-in fc1 recompute (keeps only the MLP input and "
        "recomputes each shard's fc1 in the backward; default: keep the fc1 outputs)",
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
        help="TSP / TP+SP layer compute time: 'measured' prices every kernel the layer issues "
        "(recorded once on shape-only tensors, ~1 min, cached; roofline of FLOPs, HBM bytes and "
        "a launch floor per kernel), 'flops' counts GEMM + attention FLOPs only",
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
    ap.add_argument("--plot", default="megatron_tsp_plan.png", help="PNG path ('' to skip)")
    ap.add_argument(
        "--sweep",
        default="",
        help="comma-separated sequence lengths for the plot (default 4k..max(256k, 2S))",
    )
    ap.add_argument("--json", default="", help="also write the result as JSON here")
    ap.add_argument("--verbose", action="store_true", help="per-term communication breakdown")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    m, hw = load_model(args.model), load_hardware(args.hardware)
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
        tsp_recompute_mlp=args.tsp_recompute_mlp,
        tsp_recompute_attn=args.tsp_recompute_attn,
        compute_model=args.compute_model,
        tsp_kv_grad_fp32=args.tsp_kv_grad_reduce_in_fp32,
        tsp_activation_sums_fp32=args.tsp_activation_sums_in_fp32,
        moe_schedule=args.moe_schedule,
        moe_dispatcher=args.moe_token_dispatcher_type,
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
    cps = [int(c) for c in args.cp.split(",") if c.strip()]
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
    if args.seq_length % (2 * args.degree):
        print(
            f"warning: S={args.seq_length} not divisible by 2D={2 * args.degree} "
            "(zigzag TSP/CP need it)",
            file=sys.stderr,
        )
    if args.gpus % args.degree:
        print(
            f"megatron-tsp plan: --gpus {args.gpus} is not a multiple of --degree {args.degree}",
            file=sys.stderr,
        )
        return 2
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
            [int(x) for x in args.sweep.split(",")]
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
