"""What the planner compares: the parallel strategies over one group of D ranks (``Strategy``)
and the knobs of its analytic model (``Options``), including an MoE model's expert schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

from . import moe
from .formulas import LayerShape

# Issue 33's layouts (one name per strategy; the CLI's --strategies takes these):
# fsdp_cp / fsdp_cp_ring: ZeRO-3 (Megatron-FSDP optim_grads_params, or FSDP2) over the whole
# sequence group of N = D*C ranks, DP = 1 inside it, CP = N with all-gathered K/V
# (--cp-comm-type all_gather) or TE's P2P ring (p2p, TE's default)
FSDP_CP, FSDP_CP_RING = "fsdp_cp", "fsdp_cp_ring"
# gtp / gtp_mxfp8 / gtp_nvfp4: Megatron-LM's Generalized Tensor Parallelism (GTP = TP x
# GTP_remat) on top of TP+SP (x CP with --cp), its per-weight all-gather in bf16 / MXFP8 / NVFP4
GTP_WIRES = {"gtp": "bf16", "gtp_mxfp8": "mxfp8", "gtp_nvfp4": "nvfp4"}
FSDP_GTP_KINDS = (FSDP_CP, FSDP_CP_RING, *GTP_WIRES)

# bits per weight element on GTP's gather wire (the formats' definitions): bf16 16; MXFP8 8-bit
# elements + one 8-bit E8M0 scale per 32 = 8.25; NVFP4 4-bit elements + one FP8 E4M3 scale per
# 16 = 4.5 (its per-tensor fp32 scale, 4 bytes per tensor, is left out)
WIRE_BITS = {"bf16": 16.0, "mxfp8": 8 + 8 / 32, "nvfp4": 4 + 8 / 16}


def wire_bytes(wire: str) -> float:
    """Bytes per weight element on a gather wire (``WIRE_BITS`` / 8)."""
    if wire not in WIRE_BITS:
        raise ValueError(f"wire must be one of {', '.join(WIRE_BITS)}, got {wire!r}")
    return WIRE_BITS[wire] / 8


# every name ``--strategies`` accepts
STRATEGY_NAMES = ("tsp", "tp_sp", "hybrid", "cp", "tp_cp", "tp", "tsp_cp", "tsp_cp_ring")
STRATEGY_NAMES += FSDP_GTP_KINDS


@dataclass(frozen=True)
class Strategy:
    kind: str  # tsp, tp_sp, hybrid, tp, cp, tp_cp, tsp_cp, fsdp_cp, gtp
    tp: int = 1  # tensor (or TSP) degree
    cp: int = 1
    # TSP x CP's K/V exchange: "all_gather" over the D*C sequence group (what the layers do) or
    # "ring" (what-if: a CP P2P ring across nodes, the TSP gather inside the node); fsdp_cp:
    # Megatron CP's all-gather K/V or TE's P2P ring
    kv_flavour: str = "all_gather"
    # gtp: the GTP_remat degree R (ranks of the data-parallel axis that shard each TP slice of
    # a linear weight, ZeRO-3 style) and the gather wire format (``WIRE_BITS``)
    remat: int = 1
    wire: str = "bf16"

    @property
    def degree(self) -> int:
        return self.tp * self.cp

    @property
    def layout(self) -> str:
        """The Megatron layout whose activations and compute the strategy has: fsdp_cp is CP
        with TP = 1 (the weights only gathered), gtp is TP+SP (x CP)."""
        if self.kind == "fsdp_cp":
            return "cp"
        if self.kind == "gtp":
            return "tp_cp" if self.cp > 1 else "tp_sp"
        return self.kind

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
            "fsdp_cp": f"FSDPxCP{self.cp}" + (" ring" if self.kv_flavour == "ring" else ""),
            "gtp": f"GTP{self.tp}x{self.remat}"
            + (f"xCP{self.cp}" if self.cp > 1 else "")
            + ("" if self.wire == "bf16" else f" {self.wire}"),
        }[self.kind]

    @property
    def is_tsp(self) -> bool:
        """TSP layers (weights move, tokens stay), with or without CP."""
        return self.kind in ("tsp", "tsp_cp")

    @property
    def weight_shards(self) -> int:
        return self.tp  # CP replicates the weights


def make_strategy(
    kind: str, degree: int, tp: Optional[int] = None, remat: Optional[int] = None
) -> Strategy:
    """``degree``: the whole group (T*C for tp_cp / tsp_cp, whose ``tp`` must divide it; N = D*C
    for fsdp_cp; T*C for gtp, whose ``remat`` R is the GTP_remat degree)."""
    if kind in (FSDP_CP, FSDP_CP_RING):
        return Strategy(
            "fsdp_cp", cp=degree, kv_flavour="ring" if kind == FSDP_CP_RING else "all_gather"
        )
    if kind in GTP_WIRES:
        t = tp or degree
        if degree % t or not remat or remat < 2:
            raise ValueError(f"{kind} needs tp dividing {degree} and remat >= 2")
        return Strategy("gtp", tp=t, cp=degree // t, remat=remat, wire=GTP_WIRES[kind])
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
        if k in (FSDP_CP, FSDP_CP_RING):  # ZeRO-3 x CP over the whole sequence group
            out += [make_strategy(k, degree * c) for c in (cps or [1])]
            continue
        if k in GTP_WIRES:  # GTP of D weight shards = TP(T) x GTP_remat(D/T), every T < D
            for c in cps or [1]:
                out += [
                    make_strategy(k, t * c, t, degree // t)
                    for t in range(1, degree)
                    if degree % t == 0
                ]
            continue
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


def as_strategy(strategy: Union[str, Strategy], degree: Optional[int]) -> Strategy:
    if isinstance(strategy, Strategy):
        return strategy
    if degree is None:
        raise ValueError("give degree= with a strategy name")
    if strategy in ("tsp_cp", "tsp_cp_ring", *GTP_WIRES):
        raise ValueError(f"{strategy}: give a Strategy (TSP and CP sizes)")
    if strategy == "tp_cp":
        t = int(math.isqrt(degree))
        while degree % t:
            t -= 1
        return make_strategy("tp_cp", degree, t)
    return make_strategy(strategy, degree)


# the planner's and the memory tool's --tsp-recompute-fc1
RECOMPUTE_FC1_HELP = (
    "TSP / hybrid MLP: TSP's opt-in fc1 recompute (keep only the MLP input, recompute each "
    "shard's fc1 in the backward; default: keep the per-shard fc1 outputs)"
)


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
    tsp_recompute_fc1: bool = False
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
    # packed documents (``documents.parse_mix`` spec, --documents): the attention term follows
    # the in-document pairs and the slowest rank of the strategy's layout (documents.py)
    documents: str = ""
    overlap_dp: bool = True  # overlap_grad_reduce / overlap_param_gather
    # fsdp_cp's per-layer gradient reduce-scatter, bytes per element: None = the model dtype,
    # Megatron-LM's default (--use-megatron-fsdp builds megatron_fsdp from the DDP config,
    # grad_reduce_in_fp32=False: megatron/core/distributed/distributed_data_parallel_config.py);
    # 4 = --grad-reduce-in-fp32 (the standalone MegatronFSDP's own fallback config)
    fsdp_grad_reduce_bytes: Optional[int] = None
    # gtp's per-weight wgrad reduce-scatter, bytes per element (bf16 in GTP's docs, any wire)
    gtp_grad_reduce_bytes: int = 2
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
