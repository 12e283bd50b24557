"""One rank of a real training step, measured without GPUs.

``run_step(RunConfig)`` builds megatron-core's ``GPTModel`` for one rank of a TSP, TP, TP+SP or
TP x CP job, wraps it in Megatron's ``DistributedDataParallel`` (fp32 ``main_grad`` buffer),
builds a mixed-precision Adam (fp32 master weights + m + v, optionally sharded over data
parallelism like Megatron's distributed optimizer) and runs forward, backward, gradient
finalisation and the optimizer step once. FSDP x CP (``fsdp_cp``) shards the TP = 1, CP = N
model with torch FSDP2 instead of the DDP wrapper and steps Adam on the shards (``fsdp_run``).
With ``fake=True`` every tensor is a ``FakeTensor`` (shapes only, no storage) and the process
group is torch's ``fake`` backend (collectives return at once), so one 2-core machine can run one
rank of a 7B / 128k / D=8 job. torch's ``MemTracker`` categorises every live storage
(parameters, gradients, optimizer state, activations, temporaries) and records the peak;
``FlopCounterMode`` counts GEMM and attention FLOPs on the same run, and
``CommCounter`` records the collectives.

With ``fake=False`` the same code runs with real tensors (small shapes) and the peak is read from
the CPU allocator itself (torch profiler memory events, "Total Allocated"), an independent check
of the fake-tensor number.

Attention. Megatron's local ``DotProductAttention`` materialises the ``[b, np, s, s]`` score
matrix (137 GB per layer at 128k) and rejects context parallelism; GPU runs use TE's flash
attention. Every scheme here therefore runs the TSP layers' own attention-kernel interface
(``megatron_tsp/core/layers/kernels.py``; on CPU and fake CPU tensors its ``cpu_flash`` backend,
which saves only the output and the fp32 log-sum-exp and recomputes the probabilities in backward):

* TSP: the layers themselves, unmodified (no stand-in).
* TP / TP+SP: ``BaselineCoreAttention``, one causal call over the local heads and the sequence.
* TP x CP (and FSDP x CP, TP = 1): Megatron's zigzag layout (CP rank r holds chunks r and
  2CP-1-r); K/V all-gathered over the CP group with the TSP layers' packed K/V gather (TE's
  ``cp_comm_type="all_gather"``), each local chunk attends to keys [0, (c+1)C) bottom-right
  aligned, only the local q/k/v/out/lse are saved, backward re-gathers K/V and reduce-scatters
  dK/dV with the layers' code.
* The same with ``cp_comm_type="p2p"`` (``--cp-comm-type p2p``, TE's default): ``KVRingAttention``,
  TE's P2P ring as it allocates (K/V blocks of S/N tokens passed N-1 steps around the CP group,
  per-step fp32 log-sum-exp merges, dK/dV travelling the ring with the K/V in backward).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_tsp.core import rejections
from megatron_tsp.core.model_shape import ModelShape, load_model
from megatron_tsp.megatron_lm import patches
from megatron_tsp.tools.estimator import flops_count

SCHEMES = ("tsp", "tp", "tp_sp", "hybrid", "tp_cp", "fsdp_cp")
# TE's CP K/V exchanges stood in for tp_cp and fsdp_cp (--cp-comm-type)
CP_COMM_TYPES = ("all_gather", "p2p")
GB = 1e9
GIB = 2**30


# --------------------------------------------------------------------------------------------
# configuration


@dataclass
class RunConfig:
    # tsp | tp | tp_sp | hybrid (TP+SP attention + TSP MLP) | tp_cp (TP x CP) | fsdp_cp (FSDP2
    # ZeRO-3 x CP over the whole group: TP = 1, CP = --cp = --world-size)
    scheme: str = "tsp"
    model: ModelShape = field(default_factory=lambda: load_model("7b"))
    world_size: int = 8
    tp: int = 8  # the TSP group size D for scheme "tsp"
    cp: int = 1
    seq: int = 16384
    micro_batch: int = 1
    dtype: str = "bf16"  # bf16 | fp32
    recompute: str = "none"  # none | full (Megatron: granularity full, method uniform, 1 layer)
    distributed_optimizer: bool = False
    fake: bool = True
    count_flops: bool = True
    count_comm: bool = True
    make_vocab_size_divisible_by: int = 128
    track_real: bool = False  # diagnostics: also run MemTracker on a real-tensor run
    # TSP layer options (None: the spec's defaults): "saved" | "recompute"; True: TSP's opt-in
    # fc1 recompute (the spec default keeps the per-shard fc1 outputs)
    tsp_attention_backward: Optional[str] = None
    tsp_mlp_recompute_activation: Optional[bool] = None
    tsp_kv_grad_fp32: Optional[bool] = None  # dK/dV reduce-scatter in fp32 (default: compute)
    tsp_kv_grad_a2a: bool = False  # dK/dV summed by an all-to-all (--tsp-kv-grad-all-to-all)
    # MLP output / input gradients summed in fp32 (--tsp-activation-sums-in-fp32)
    tsp_activation_sums_fp32: bool = False
    # TSP's loss on the vocabulary ring: its policy (--tsp-vocab-ring auto | always | never)
    tsp_vocab_ring: str = "auto"
    # MoE models (``model.num_experts``): "folded" (experts whole on the expert-model-parallel
    # ranks, folded onto the TSP / TP axis) or "ring" (TSP only: the TSP expert ring, every
    # expert sharded 1/D); megatron-core's token dispatcher for the folded layout; the
    # expert-model-parallel size (None: the TSP / TP group size for "folded", 1 for "ring").
    # ``moe_routing``: "uniform" (every expert its uniform-routing share of the token copies,
    # ``uniform_routing``; shape-only tensors have no other) or, real tensors without token
    # exchange only (the expert ring, or EP 1), "router": what the model's router picks.
    moe_schedule: str = "folded"
    moe_dispatcher: str = "alltoall"
    ep: Optional[int] = None
    moe_routing: str = "uniform"
    # tp_cp / fsdp_cp: TE's CP K/V exchange stood in (BaselineCoreAttention's all-gather, or
    # KVRingAttention's P2P ring)
    cp_comm_type: str = "all_gather"

    @property
    def expert_parallel(self) -> int:
        if self.ep is not None:
            return self.ep
        return 1 if self.moe_schedule == "ring" else self.tp

    @property
    def expert_tensor_parallel(self) -> int:
        return self.tp if self.moe_schedule == "ring" else 1

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp)

    @property
    def sequence_parallel(self) -> bool:
        return self.scheme in ("tsp", "tp_sp", "hybrid") or (self.scheme == "tp_cp" and self.tp > 1)

    @property
    def label(self) -> str:
        return self._layout_label() + self._moe_label()

    def _moe_label(self) -> str:
        if not self.model.is_moe:
            return ""
        if self.moe_schedule == "ring":
            return " ring"
        return f" EP{self.expert_parallel} {self.moe_dispatcher}"

    def _layout_label(self) -> str:
        if self.scheme == "tsp":
            suffix = f"xCP{self.cp}" if self.cp > 1 else ""
            suffix += " attn-rec" if self.tsp_attention_backward == "recompute" else ""
            if self.tsp_mlp_recompute_activation:
                suffix += " rec-fc1"
            if self.tsp_kv_grad_fp32:
                suffix += " dkv-fp32"
            if self.tsp_kv_grad_a2a:
                suffix += " dkv-a2a"
            if self.tsp_activation_sums_fp32:
                suffix += " sums-fp32"
            return f"TSP D={self.tp}{suffix}"
        if self.scheme == "hybrid":
            rec = " rec-fc1" if self.tsp_mlp_recompute_activation else ""
            rec += " sums-fp32" if self.tsp_activation_sums_fp32 else ""
            return f"TP={self.tp}+SP+TSP-MLP{rec}"
        ring = " p2p" if self.cp_comm_type == "p2p" else ""
        if self.scheme == "tp_cp":
            sp = " (SP)" if self.sequence_parallel else ""
            return f"TP{self.tp}xCP{self.cp}{ring}{sp}"
        if self.scheme == "fsdp_cp":
            return f"FSDPxCP{self.cp}{ring}"
        return f"TP={self.tp}" if self.scheme == "tp" else f"TP={self.tp}+SP"

    def validate(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if self.model.is_moe:
            self._validate_moe()
        if self.scheme not in ("tp_cp", "tsp", "fsdp_cp") and self.cp != 1:
            raise ValueError(
                f"--cp {self.cp} needs scheme 'tp_cp' (TP x CP), 'tsp' (TSP x CP) or 'fsdp_cp'"
            )
        if self.scheme == "fsdp_cp":
            self._validate_fsdp_cp()
        if self.scheme == "tp_cp" and self.cp < 2:
            raise ValueError("scheme 'tp_cp' needs --cp >= 2")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(
                f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)}, got "
                f"{self.cp_comm_type!r}"
            )
        if self.cp_comm_type != "all_gather" and self.scheme not in ("tp_cp", "fsdp_cp"):
            raise ValueError(
                f"--cp-comm-type {self.cp_comm_type} is TE's CP attention of --scheme tp_cp / "
                f"fsdp_cp, not --scheme {self.scheme}"
            )
        m = self.model
        # the rejection table's shape rows (TSP, the hybrid and plain TP shard alike)
        mode = {"tsp": rejections.TSP, "hybrid": rejections.TSP_MLP}.get(self.scheme, rejections.TP)
        rejections.check_divisible(
            self.tp,
            mode,
            num_attention_heads=m.heads,
            num_query_groups=m.groups,
            ffn_hidden_size=m.ffn_hidden,
        )
        if self.world_size % (self.tp * self.cp):
            raise ValueError(
                f"--world-size {self.world_size} is not divisible by --tp {self.tp} x --cp "
                f"{self.cp} = {self.tp * self.cp}"
            )
        split = {
            "tsp": 2 * self.tp * self.cp,
            "tp_cp": 2 * self.cp * self.tp,
            "fsdp_cp": 2 * self.cp,
            "tp_sp": self.tp,
            "hybrid": self.tp,
            "tp": 1,
        }[self.scheme]
        if self.seq % split:
            raise ValueError(f"--seq {self.seq} must be divisible by {split} for {self.label}")
        if self.tsp_attention_backward not in (None, "saved", "recompute"):
            raise ValueError("tsp_attention_backward must be 'saved' or 'recompute'")
        if self.recompute not in ("none", "full"):
            raise ValueError("recompute must be 'none' or 'full'")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError("dtype must be bf16 or fp32")

    def _validate_fsdp_cp(self) -> None:
        """FSDP x CP shards every weight over the whole sequence group (ZeRO-3, DP = 1 inside
        it, the planner's ``fsdp_cp``): TP 1, CP = the world."""
        if self.tp != 1:
            raise ValueError(
                f"--scheme fsdp_cp has no tensor parallelism: --tp must be 1, got {self.tp}"
            )
        if self.cp < 2 or self.cp != self.world_size:
            raise ValueError(
                f"--scheme fsdp_cp shards over the whole CP group: --cp must equal --world-size "
                f"and be >= 2, got --cp {self.cp}, --world-size {self.world_size}"
            )
        if self.distributed_optimizer:
            raise ValueError(
                "--scheme fsdp_cp shards the optimizer state with the weights already: drop "
                "--distributed-optimizer"
            )

    def _validate_moe(self) -> None:
        from megatron_tsp.tools.estimator.uniform_routing import DISPATCHERS

        m, ep = self.model, self.expert_parallel
        if self.scheme not in ("tsp", "tp_sp"):
            raise ValueError(
                f"model {m.name or '?'} has num_experts={m.num_experts}: the fake-tensor run "
                f"models MoE layers under TSP (--scheme tsp) and TP+SP (--scheme tp_sp), not "
                f"--scheme {self.scheme}"
            )
        if self.moe_schedule not in ("folded", "ring"):
            raise ValueError(f"--moe-schedule must be folded or ring, got {self.moe_schedule!r}")
        if self.moe_schedule == "ring" and (self.scheme != "tsp" or ep != 1):
            raise ValueError(
                f"--moe-schedule ring is the TSP expert ring: --scheme tsp with EP 1 (got "
                f"--scheme {self.scheme}, EP {ep})"
            )
        if self.moe_dispatcher not in DISPATCHERS:
            raise ValueError(
                f"--moe-token-dispatcher-type must be one of {DISPATCHERS}, got "
                f"{self.moe_dispatcher!r}"
            )
        if self.cp != 1:
            raise ValueError("MoE models: the fake-tensor run takes --cp 1")
        # megatron-core's own requirement (not a TSP rule: rejections.py holds those), which its
        # MoELayer asserts without a message
        _, rest = divmod(m.num_experts, ep)
        if rest:
            raise ValueError(
                f"--expert-model-parallel-size {ep}: num_experts={m.num_experts} must be a "
                f"multiple of it (megatron-core places {m.num_experts}/{ep} experts per rank)"
            )
        if self.moe_routing not in ("uniform", "router"):
            raise ValueError(f"moe_routing must be uniform or router, got {self.moe_routing!r}")
        if self.moe_routing == "router" and (self.fake or ep != 1):
            raise ValueError(
                "moe_routing='router' needs real tensors and no token exchange (EP 1): the fake "
                "process group brings no other rank's routing"
            )

    def padded_vocab(self) -> int:
        mult = self.make_vocab_size_divisible_by * self.tp
        return int(math.ceil(self.model.vocab / mult) * mult)


@dataclass
class RunResult:
    config: dict
    label: str
    peak_bytes: int
    peak_breakdown: Dict[str, int]  # MemTracker categories at the peak
    static_bytes: Dict[str, int]  # params / grads / optimizer state allocated before the step
    params_local: int
    flops: Dict[str, int] = field(default_factory=dict)
    comm: Dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    real_peak_bytes: Optional[int] = None  # allocator peak (real runs only)
    peak_phase: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, default=str)


# --------------------------------------------------------------------------------------------
# baseline core attention through the TSP layers' kernels and K/V collectives


def _gather_kv(k, v, group, size):
    """The packed K/V all-gather of the TSP layers with per-call buffers (TE's CP allocates per
    call; the persistent ``comm.WORKSPACE`` is TSP's own): natural-order views (K, V)."""
    from megatron_tsp.core import zigzag
    from megatron_tsp.core.comm import all_gather_seq

    groups = k.shape[2]
    kv = zigzag.unpermute(all_gather_seq(torch.cat([k, v], dim=2), group), size, dim=0)
    return kv.narrow(2, 0, groups), kv.narrow(2, groups, groups)


class BaselineCoreAttention(torch.autograd.Function):
    """Core attention of the TP / TP+SP / TP x CP baselines, built from the TSP layers' own code:
    the attention-kernel interface (``megatron_tsp.core.layers.kernels``, the backend the layers
    would select for these tensors) and, for CP, the layers' packed K/V all-gather and dK/dV
    reduce-scatter (TE's ``cp_comm_type="all_gather"``).

    q: [sq, b, np, hn]; k, v: [sk, b, ng, hn], natural order, or with ``group`` this rank's
    zigzag slice. ``blocks``: the causal blocks of the local queries (``TSPLayout.causal_blocks``
    of the CP layout, or ``layout.whole_sequence_blocks(sq)`` for plain causal attention). Saves
    q, k, v (local), the output and the fp32 log-sum-exps.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale, blocks, group):
        from megatron_tsp.core.layers import kernels

        kernel = kernels.select_kernel(q.device, q.dtype, q.shape[-1], q.shape[2] != k.shape[2])
        size = dist.get_world_size(group) if group is not None else 1
        k_nat, v_nat = _gather_kv(k, v, group, size) if group is not None else (k, v)
        outs, lses = kernels.zigzag_forward(kernel, q, k_nat, v_nat, blocks, scale)
        del k_nat, v_nat
        out = torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
        del outs
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.scale, ctx.blocks, ctx.group, ctx.kernel = scale, blocks, group, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        from megatron_tsp.core.layers import kernels

        q, k, v, out, *lses = ctx.saved_tensors
        group, blocks = ctx.group, ctx.blocks
        size = dist.get_world_size(group) if group is not None else 1
        k_nat, v_nat = _gather_kv(k, v, group, size) if group is not None else (k, v)
        outs = [out.narrow(0, block.query_start, block.query_len) for block in blocks]
        dq, dkv = kernels.zigzag_backward(
            ctx.kernel, dout.contiguous(), q, k_nat, v_nat, blocks, ctx.scale, outs, lses
        )
        del k_nat, v_nat
        if group is not None:
            from megatron_tsp.core import zigzag
            from megatron_tsp.core.comm import reduce_scatter_seq

            # per-call buffers, like TE's CP (TSP's persistent workspace is TSP's own)
            dkv = reduce_scatter_seq(zigzag.permute(dkv.to(q.dtype), size, dim=0), group)
        else:
            dkv = dkv.to(q.dtype)
        groups = k.shape[2]
        return dq, dkv.narrow(2, 0, groups), dkv.narrow(2, groups, groups), None, None, None


def _ring_send_recv(send, recv, group, to_next: bool) -> None:
    """One ring step's P2P exchange over ``group``: ``send`` to the next rank and ``recv`` from
    the previous one (``to_next``), or the other way round."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    step = 1 if to_next else -1
    dst = dist.get_global_rank(group, (rank + step) % size)
    src = dist.get_global_rank(group, (rank - step) % size)
    ops = [dist.P2POp(dist.isend, send, dst, group), dist.P2POp(dist.irecv, recv, src, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _ring_block(owner: int, rank: int, c: int):
    """What rank ``rank`` computes against the K/V block of CP rank ``owner`` (zigzag chunks
    owner and 2N-1-owner, ``c`` tokens each): ``(query rows, key rows, alignment)``. Its own
    block is the causal diagonal (top-left over the two chunks: chunk 2N-1-r sees chunk r
    whole); an earlier rank's block: both local chunks against its first chunk; a later rank's:
    the second local chunk against both of its chunks; no mask off the diagonal."""
    from megatron_tsp.core.layers import kernels

    if owner == rank:
        return slice(0, 2 * c), slice(0, 2 * c), kernels.TOP_LEFT
    if owner < rank:
        return slice(0, 2 * c), slice(0, c), kernels.NO_MASK
    return slice(c, 2 * c), slice(0, 2 * c), kernels.NO_MASK


class KVRingAttention(torch.autograd.Function):
    """Core attention of TP x CP / FSDP x CP with Transformer Engine's P2P ring
    (``cp_comm_type="p2p"``, TE's default; ``AttnFuncWithCPAndKVP2P``), allocating as TE does.
    q: [2C, b, np, hn], k, v: [2C, b, ng, hn], this rank's zigzag chunks r and 2N-1-r (S/N
    tokens). Kernel calls: the attention-kernel interface of the layers (``kernels``).

    Communication (P2P over the CP group; a K/V block = K and V of S/N tokens, packed on a
    leading dimension of 2 as TE packs them):

    * forward: N-1 steps, each sends the block it attends to the next rank and receives the
      previous rank's (N-1 K/V blocks received);
    * backward: the ring runs the other way round (TE sends to rank r-1), starting from the last
      block the forward received (rank r+1's) and ending on the rank's own (the diagonal). A
      step sends [K/V, dK/dV] of the block it holds: step 0 the K/V alone, the last step the
      dK/dV alone, which thereby reaches its owner (N-1 K/V blocks and N-1 dK/dV blocks
      received).

    Memory, as TE allocates it (what is live at once):

    * forward: the packed K/V (one copy of k, v) and every block received: TE keeps each
      step's receive buffer in its ``p2p_comm_buffers`` list until the function returns (N
      blocks at the last step); every step's output (model dtype) and fp32 log-sum-exp, kept
      for the output correction after the loop; the merged fp32 log-sum-exp [b, np, S/N]
      (TE's ``softmax_lse``, merged per step in place); the output, zero-filled, into which
      every step's output is added, rescaled (TE's fused correction: no temporary). Saved for
      backward: q, the last received K/V block, the output and the merged log-sum-exp.
    * backward: dq [2C, ...] in the model dtype and two [K/V, dK/dV] buffers of 2 blocks each
      (TE's two ``torch.empty((2, *kv.shape))``), four K/V-sized blocks in the model dtype;
      dK/dV are accumulated in the model dtype in the buffer that travels (TE has no fp32
      dK/dV accumulator off FP8); the second half of the log-sum-exp made contiguous once; per
      step the kernel's dq, dk, dv of the step's rows and keys.

    With the fake process group the received blocks are fresh tensors of the right shape
    (real-tensor runs: their values are whatever the allocator held; memory is measured, not
    numerics)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, group):
        from megatron_tsp.core.layers import kernels

        size, rank = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[0] // 2
        kernel = kernels.select_kernel(q.device, q.dtype, q.shape[-1], q.shape[2] != k.shape[2])
        heads = kernels._heads_view
        buffers = [torch.stack((k, v))]  # TE's p2p_comm_buffers: every block stays listed
        parts, lse = [], None
        for step in range(size):
            if step < size - 1:
                buffers.append(torch.empty_like(buffers[step]))
                _ring_send_recv(buffers[step], buffers[step + 1], group, to_next=True)
            kv = buffers[step]
            rows, keys, align = _ring_block((rank - step) % size, rank, c)
            o, lse_i = kernel.forward(
                heads(q[rows]), heads(kv[0][keys]), heads(kv[1][keys]), align, scale
            )
            parts.append((rows, o, lse_i))
            if step == 0:
                lse = lse_i.clone()
            else:  # the per-step fp32 log-sum-exp merge, in place (TE's lse correction)
                merged = lse[..., rows]
                torch.logaddexp(merged, lse_i, out=merged)
        out = torch.zeros_like(q)
        for rows, o, lse_i in parts:  # the output correction: out += o * exp(lse_i - lse)
            weight = torch.exp(lse_i - lse[..., rows]).unsqueeze(-1).to(q.dtype)
            heads(out[rows]).addcmul_(o, weight)
            del weight
        last = buffers[-1]
        del buffers, parts
        ctx.save_for_backward(q, last, out, lse)
        ctx.scale, ctx.group, ctx.kernel = scale, group, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        from megatron_tsp.core.layers import kernels

        q, kv_last, out, lse = ctx.saved_tensors
        group, heads = ctx.group, kernels._heads_view
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[0] // 2
        lse_late = lse[..., c:].contiguous()  # the second chunk's rows (later ranks' blocks)
        dout = dout.view(q.shape)
        dq = torch.zeros_like(q)
        buffers = [kv_last.new_empty((2,) + tuple(kv_last.shape)) for _ in range(2)]
        buffers[0][0].copy_(kv_last)
        for step in range(size):
            send, recv = buffers[step % 2], buffers[(step + 1) % 2]
            if step == 0:
                send, recv = send[0], recv[0]  # the K/V alone: no dK/dV yet
            elif step == size - 1:
                send, recv = send[1], recv[1]  # the dK/dV alone: it reaches its owner
            _ring_send_recv(send, recv, group, to_next=False)
            kv = buffers[step % 2][0]
            rows, keys, align = _ring_block((rank + 1 + step) % size, rank, c)
            dq_i, dk_i, dv_i = ctx.kernel.backward(
                heads(dout[rows]),
                heads(q[rows]),
                heads(kv[0][keys]),
                heads(kv[1][keys]),
                heads(out[rows]),
                lse_late if rows.start else lse,
                align,
                ctx.scale,
            )
            dq[rows].add_(dq_i.permute(2, 0, 1, 3))
            # this block's dK/dV so far arrived with its K/V in the other buffer
            dkv = buffers[(step + 1) % 2][1]
            if step == 0:
                dkv.zero_()
            dkv[0][keys].add_(dk_i.permute(2, 0, 1, 3))
            dkv[1][keys].add_(dv_i.permute(2, 0, 1, 3))
            del dq_i, dk_i, dv_i
        dkv = buffers[size % 2][1]
        return dq, dkv[0], dkv[1], None, None


try:
    from megatron.core.transformer.module import MegatronModule as _Base
except ImportError:  # pragma: no cover
    _Base = torch.nn.Module


class FlashCoreAttention(_Base):
    """``core_attention`` for Megatron's local spec: flash-equivalent memory, CP via all-gather
    or (``--cp-comm-type p2p``) TE's P2P ring."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        from megatron.core import parallel_state as mpu

        tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        tp_group = tp_group or mpu.get_tensor_model_parallel_group()
        if config.context_parallel_size > 1:
            cp_group = cp_group or mpu.get_context_parallel_group()
        else:
            cp_group = None
        if attention_dropout if attention_dropout is not None else config.attention_dropout:
            raise ValueError("FlashCoreAttention (measurement stand-in) needs attention_dropout=0")
        self.cp_group = cp_group
        self.ring = getattr(config, "fake_run_cp_comm_type", "all_gather") == "p2p"
        kv_channels = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.scale = softmax_scale or (1.0 / math.sqrt(kv_channels))

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        from megatron_tsp.core.layout import TSPLayout, whole_sequence_blocks

        sq, b = query.shape[0], query.shape[1]
        if self.cp_group is None:  # TP / TP+SP: the whole sequence, square causal
            blocks, group = whole_sequence_blocks(sq), None
        elif self.ring:  # TE's P2P ring over the CP group
            out = KVRingAttention.apply(query, key, value, self.scale, self.cp_group)
            return out.view(sq, b, -1)
        else:
            size = dist.get_world_size(self.cp_group)
            blocks = TSPLayout.of_group(self.cp_group, sq * size).causal_blocks
            group = self.cp_group
        out = BaselineCoreAttention.apply(query, key, value, self.scale, blocks, group)
        return out.view(sq, b, -1)


# --------------------------------------------------------------------------------------------
# process groups and model


def init_parallel(cfg: RunConfig) -> None:
    from megatron.core import parallel_state as mpu

    from megatron_tsp.core import parallel_state as tsp_ps

    if mpu.model_parallel_is_initialized():
        tsp_ps.destroy_model_parallel()
    kwargs = dict(create_gloo_process_groups=False)
    if cfg.model.is_moe:
        kwargs.update(
            expert_model_parallel_size=cfg.expert_parallel,
            expert_tensor_parallel_size=cfg.expert_tensor_parallel,
        )
    if cfg.scheme == "tsp":
        tsp_ps.initialize_model_parallel(
            tensor_sequence_parallel_size=cfg.tp, context_parallel_size=cfg.cp, **kwargs
        )
    else:
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tp, context_parallel_size=cfg.cp, **kwargs
        )


def transformer_config(cfg: RunConfig):
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = cfg.model
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    extra = {}
    if cfg.recompute == "full":
        extra = dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    config = TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden,
        num_attention_heads=m.heads,
        num_query_groups=m.query_groups,
        ffn_hidden_size=m.ffn_hidden,
        gated_linear_unit=m.gated,
        activation_func=torch.nn.functional.silu if m.gated else torch.nn.functional.gelu,
        normalization=m.normalization,
        tensor_model_parallel_size=cfg.tp,
        context_parallel_size=cfg.cp,
        sequence_parallel=cfg.sequence_parallel,
        # fsdp_cp: FSDP2 keeps the sharded parameters in their own dtype (fp32, the master
        # weights) and casts them to the model dtype for its all-gather
        params_dtype=torch.float32 if cfg.scheme == "fsdp_cp" else dtype,
        bf16=cfg.dtype == "bf16",
        pipeline_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        perform_initialization=not cfg.fake,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        cross_entropy_loss_fusion=False,
        add_bias_linear=m.bias,
        **({"layernorm_epsilon": m.norm_epsilon} if m.norm_epsilon else {}),
        **_moe_fields(cfg),
        **extra,
    )
    # read by the TSP MLP, expert ring and attention (not a TransformerConfig field)
    config.tsp_activation_sums_in_fp32 = cfg.tsp_activation_sums_fp32
    config.tsp_moe_ring = cfg.model.is_moe and cfg.moe_schedule == "ring"
    # read by FlashCoreAttention: TE's CP K/V exchange to stand in
    config.fake_run_cp_comm_type = cfg.cp_comm_type
    return config


def _moe_fields(cfg: RunConfig) -> dict:
    """The ``TransformerConfig`` fields of an MoE model (none for a dense one): Megatron's
    defaults otherwise (softmax top-k router, aux-loss load balancing, no token dropping)."""
    m = cfg.model
    if not m.is_moe:
        return {}
    fields = dict(
        num_moe_experts=m.num_experts,
        moe_router_topk=m.moe_topk,
        moe_ffn_hidden_size=m.expert_ffn,
        moe_token_dispatcher_type="allgather" if cfg.moe_schedule == "ring" else cfg.moe_dispatcher,
        expert_model_parallel_size=cfg.expert_parallel,
        expert_tensor_parallel_size=cfg.expert_tensor_parallel,
        moe_aux_loss_coeff=1e-2,
    )
    if m.moe_shared_ffn:
        fields["moe_shared_expert_intermediate_size"] = m.moe_shared_ffn
    if m.moe_dense_layers:
        fields["moe_layer_freq"] = m.moe_layer_freq
    return fields


def layer_spec(cfg: RunConfig, config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_tsp.core.layers.norm import SequenceParallelNorm

    if cfg.scheme == "tsp":
        from megatron_tsp.core.specs import (
            get_gpt_block_tsp_spec,
            get_gpt_layer_tsp_spec,
            moe_layer_pattern,
        )

        block = get_gpt_block_tsp_spec(config)
        opts = {}
        if cfg.tsp_attention_backward is not None:
            opts["attention_backward"] = cfg.tsp_attention_backward
        if cfg.tsp_mlp_recompute_activation is not None:
            opts["mlp_recompute_activation"] = cfg.tsp_mlp_recompute_activation
        if cfg.tsp_kv_grad_fp32 is not None:
            opts["kv_grad_reduce_in_fp32"] = cfg.tsp_kv_grad_fp32
        if opts:
            dense = get_gpt_layer_tsp_spec(normalization=cfg.model.normalization, **opts)
            moe = get_gpt_layer_tsp_spec(
                normalization=cfg.model.normalization,
                num_experts=cfg.model.num_experts,
                moe_ring=config.tsp_moe_ring,
                **opts,
            )
            block = TransformerBlockSubmodules(
                layer_specs=[moe if i else dense for i in moe_layer_pattern(config)],
                layer_norm=block.layer_norm,
            )
        return block
    if cfg.scheme == "hybrid":
        from megatron_tsp.core.specs import get_gpt_block_tsp_mlp_spec, get_gpt_layer_tsp_mlp_spec

        get_gpt_block_tsp_mlp_spec(config)  # the configuration checks
        opts = {}
        if cfg.tsp_mlp_recompute_activation is not None:
            opts["mlp_recompute_activation"] = cfg.tsp_mlp_recompute_activation
        layer = get_gpt_layer_tsp_mlp_spec(normalization=cfg.model.normalization, **opts)
        layer.submodules.self_attention.submodules.core_attention = FlashCoreAttention
        return TransformerBlockSubmodules(
            layer_specs=[layer] * cfg.model.num_layers, layer_norm=SequenceParallelNorm
        )
    if cfg.model.is_moe:  # Megatron's own dense / MoE layers (TP+SP, EP folded onto TP)
        from megatron_tsp.core.specs import get_gpt_block_local_sp_spec

        block = get_gpt_block_local_sp_spec(config)
        for spec in block.layer_specs:
            spec.submodules.self_attention.submodules.core_attention = FlashCoreAttention
        return block
    spec = get_gpt_layer_local_spec(normalization=cfg.model.normalization)
    # Megatron's WrappedTorchNorm rejects sequence_parallel without apex/TE; SequenceParallelNorm
    # is the same torch norm, its params tagged sequence_parallel (as TE/apex norms under SP).
    spec.submodules.input_layernorm = SequenceParallelNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelNorm
    spec.submodules.self_attention.submodules.core_attention = FlashCoreAttention
    return TransformerBlockSubmodules(
        layer_specs=[spec] * cfg.model.num_layers, layer_norm=SequenceParallelNorm
    )


def build_model(cfg: RunConfig, config):
    from megatron.core.models.gpt import GPTModel

    from megatron_tsp.core import output_head

    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(cfg, config),
        vocab_size=cfg.padded_vocab(),
        max_sequence_length=cfg.seq,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.model.tied_embeddings,
        position_embedding_type="rope" if cfg.model.rope else "learned_absolute",
        **({"rotary_base": cfg.model.rotary_base} if cfg.model.rotary_base else {}),
    )
    if cfg.scheme == "tsp":
        output_head.install(model, policy=cfg.tsp_vocab_ring)
    return model


# the fake-run patches (the MoE dispatchers' are ``uniform_routing``'s)
_CP_ROPE, _COALESCING, _RNG_FORK = patches.declare(
    [
        patches.row(
            patches.FAKE_RUN,
            "megatron.core.models.common.embeddings.rotary_pos_embedding:"
            "get_pos_emb_on_this_cp_rank",
            "builds its index on CUDA; the CPU version selects the same two chunks",
            ("pos_emb", "seq_dim", "cp_group"),
        ),
        patches.row(
            patches.FAKE_RUN,
            "megatron.core.distributed.param_and_grad_buffer:_coalescing_manager",
            "FakeTensorMode cannot dispatch torch's coalescing manager; the bucket collectives "
            "run one by one (same buffers, same bytes)",
            ("group",),
        ),
        patches.row(
            patches.FAKE_RUN,
            "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork",
            "fork compares RNG states with .item(), which a fake tensor cannot answer (dropout "
            "is 0; patched on the tracker instance)",
            ("self", "name"),
        ),
    ]
)


@contextlib.contextmanager
def no_rng_fork(enabled: bool):
    """Fake runs only: Megatron's RNG-tracker ``fork`` compares CPU RNG states with ``.item()``,
    which a fake tensor cannot answer. Dropout is 0 in these runs, so forking is a no-op."""
    if not enabled:
        yield
        return
    from megatron.core import tensor_parallel

    with patches.applied(
        _RNG_FORK.mode,
        _RNG_FORK.target,
        lambda *a, **k: contextlib.nullcontext(),
        owner=tensor_parallel.get_cuda_rng_tracker(),
    ):
        yield


def _cpu_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """Megatron's ``get_pos_emb_on_this_cp_rank`` without its pinned-memory ``.cuda()`` index."""
    from megatron_tsp.core.layout import TSPLayout

    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    chunks = TSPLayout(cp_size, pos_emb.shape[seq_dim], cp_rank).chunk_ids  # CP's zigzag is TSP's
    idx = torch.tensor(chunks, device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])


@contextlib.contextmanager
def cpu_cp_rope():
    with patches.applied(_CP_ROPE.mode, _CP_ROPE.target, _cpu_pos_emb_on_this_cp_rank):
        yield


@contextlib.contextmanager
def _comm_counter(enabled: bool):
    """``CommCounter`` when ``enabled``, else None. The counter patches both
    ``torch.distributed``'s and ``distributed_c10d``'s ``isend`` / ``irecv`` (the globals
    ``P2POp`` validates its op against), so ``P2POp(dist.isend, ...)`` stays valid inside it."""
    if not enabled:
        yield None
        return
    from megatron_tsp.tools.comm_counter import CommCounter

    with CommCounter() as counter:
        yield counter


class _Done:
    def wait(self) -> None:
        return None


@contextlib.contextmanager
def _uncoalesced_grad_sync():
    """Megatron's grad sync wraps its per-bucket collectives (in place on the grad buffer) in
    ``torch.distributed._coalescing_manager``, which FakeTensorMode cannot dispatch; run them one
    by one instead (same buffers, same bytes)."""

    @contextlib.contextmanager
    def plain(*args, **kwargs):
        yield _Done()

    with patches.applied(_COALESCING.mode, _COALESCING.target, plain):
        yield


# --------------------------------------------------------------------------------------------
# mixed-precision optimizer (what Megatron's Float16Optimizer / DistributedOptimizer allocate)


class MasterAdam:
    """fp32 master weights + Adam (m, v) over the DDP grad buffers.

    Per DDP bucket, the optimizer owns a flat fp32 master tensor of the bucket's numel (or, with
    the distributed optimizer, this DP rank's 1/DP shard of it) whose ``.grad`` is a view of the
    fp32 main-grad buffer (Megatron does the same: no extra gradient copy). Adam runs fused (no
    temporaries, like apex/TE FusedAdam). After the step the master values are copied into the
    bf16 parameters (and, sharded, all-gathered over DP into the param buffer, in place).
    """

    def __init__(self, ddp_model, dp_group, distributed: bool, lr: float = 1e-4):
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        dp_rank = dist.get_rank(dp_group)
        self.distributed = distributed
        self.entries = []  # (bucket, master, lo, hi, [(param, start, end)])
        masters = []
        buffers = list(ddp_model.buffers) + list(getattr(ddp_model, "expert_parallel_buffers", []))
        for buffer in buffers:
            for bucket in buffer.buckets:
                n = bucket.grad_data.numel()
                if distributed:
                    per = n // self.dp_size  # Megatron pads buckets to a multiple of DP
                    lo, hi = dp_rank * per, (dp_rank + 1) * per
                else:
                    lo, hi = 0, n
                ranges = []
                for param in bucket.params_list:
                    start, end, _ = buffer.param_index_map[param]
                    ranges.append((param, start - bucket.offset, end - bucket.offset))
                master = torch.empty(hi - lo, dtype=torch.float32, device=bucket.grad_data.device)
                with torch.no_grad():
                    self._copy(ranges, lo, hi, master, to_master=True)
                if bucket.grad_data.dtype == torch.float32:
                    master.grad = bucket.grad_data[lo:hi]
                self.entries.append((bucket, master, lo, hi, ranges))
                masters.append(master)
        self.optimizer = torch.optim.Adam(masters, lr=lr, fused=True)
        for p in masters:  # steady state: Adam's m and v exist before the measured step
            self.optimizer.state[p] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }

    @staticmethod
    def _copy(ranges, lo, hi, master, to_master: bool) -> None:
        for param, start, end in ranges:
            a, b = max(start, lo), min(end, hi)
            if a >= b:
                continue
            flat = param.data.view(-1)[a - start : b - start]
            if to_master:
                master[a - lo : b - lo].copy_(flat)
            else:
                flat.copy_(master[a - lo : b - lo])

    def tensors(self) -> List[torch.Tensor]:
        out = [m for _, m, *_ in self.entries]
        for st in self.optimizer.state.values():
            out += [t for t in st.values() if isinstance(t, torch.Tensor)]
        return out

    @torch.no_grad()
    def step(self) -> None:
        for bucket, master, lo, hi, _ in self.entries:
            if master.grad is None:  # bf16 grad buffer: an fp32 copy for the step
                master.grad = bucket.grad_data[lo:hi].float()
        self.optimizer.step()
        for bucket, master, lo, hi, ranges in self.entries:
            self._copy(ranges, lo, hi, master, to_master=False)
            if self.distributed and self.dp_size > 1 and bucket.param_data is not None:
                dist.all_gather_into_tensor(
                    bucket.param_data, bucket.param_data[lo:hi], group=self.dp_group
                )


# --------------------------------------------------------------------------------------------
# the measured step


class _EnginePhase:
    """Stand-in for MemTracker's ``ModTracker``: only answers "are we inside backward?"."""

    parents: set = set()

    @property
    def is_bw(self) -> bool:
        return torch._C._current_graph_task_id() != -1


def lean_mem_tracker():
    """torch's MemTracker without module hooks, keeping only the global peak.

    Stock ``MemTracker`` enters a ``ModTracker`` whose hooks (``register_multi_grad_hook`` on
    every module's inputs and outputs) keep tensors alive that the model has already dropped: on
    a real-tensor run they raise the CPU allocator's peak by ~25-70% for TSP, which saves almost
    nothing per layer. This tracker dispatches, categorises storages and updates the peak exactly
    like MemTracker (same ``__torch_dispatch__``, same categories: ``Temp`` = allocated inside the
    autograd engine), but learns the phase from the autograd engine instead of module hooks, and
    skips the per-module peaks (quadratic in depth for 32 layers). Activation recomputation in
    backward is therefore counted as ``Temp``.
    """
    from copy import deepcopy

    from torch._guards import active_fake_mode
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
    from torch.utils._python_dispatch import TorchDispatchMode

    class LeanMemTracker(MemTracker):
        peak_phase = ""
        _phase = "forward"

        def __init__(self):
            super().__init__()
            self._mod_tracker = _EnginePhase()

        def _update_peak_stats(self, peak_state) -> None:
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = deepcopy(dev_snap)
                    self.peak_phase = "backward" if self._mod_tracker.is_bw else self._phase

        def __enter__(self):
            if self._depth == 0:
                self._fake_mode_on_entry = active_fake_mode()
                self._register_global_optimizer_hook()
                self._track_resize()
                self._peak_mem_snap = self.get_tracker_snapshot()
                self._peak_mem = {
                    dev: snap[_TOTAL_KEY] for dev, snap in self._peak_mem_snap.items()
                }
            TorchDispatchMode.__enter__(self)
            self._depth += 1
            return self

        def __exit__(self, *args):
            self._depth -= 1
            if self._depth == 0:
                self._deregister_param_and_optimizer_hooks()
                self._restore_resize()
            TorchDispatchMode.__exit__(self, *args)

    return LeanMemTracker()


def _tag(tracker, tensor: torch.Tensor, category) -> None:
    """Put an existing storage under ``category`` in MemTracker (creating it if untracked)."""
    tracker._update_and_maybe_create_winfos(tensor, category)


def _profile_peak(trace_path: str, start_ts: float) -> int:
    with open(trace_path) as f:
        trace = json.load(f)
    peak = 0
    for ev in trace.get("traceEvents", []):
        if ev.get("name") == "[memory]" and ev.get("ts", 0) >= start_ts:
            total = ev.get("args", {}).get("Total Allocated")
            if total is not None:
                peak = max(peak, int(total))
    return peak


def _step_start_ts(trace_path: str) -> float:
    with open(trace_path) as f:
        trace = json.load(f)
    for ev in trace.get("traceEvents", []):
        if ev.get("name") == "tsp_measured_step":
            return float(ev["ts"])
    raise RuntimeError("profiler trace has no measured-step marker")


def _prepare(cfg: RunConfig):
    """Fresh process-wide state for one run: the fake world, the parallel groups, the seeds.
    Returns the ``TransformerConfig``."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tsp.core.comm import WORKSPACE
    from megatron_tsp.megatron_lm.cpu_support import enable_cpu_support
    from megatron_tsp.megatron_lm.fake_world import init_fake_world

    WORKSPACE.clear()  # persistent comm buffers are allocated (and counted) inside the step
    if cfg.model.is_moe:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        # megatron-core's aux-loss log: sized by the first run's layer count, holding its tensors
        get_moe_layer_wise_logging_tracker().clear()
    enable_cpu_support()
    init_fake_world(cfg.world_size)
    init_parallel(cfg)
    config = transformer_config(cfg)
    config.tsp_kv_grad_all_to_all = cfg.tsp_kv_grad_a2a  # read by TSPSelfAttention
    model_parallel_cuda_manual_seed(1234)  # the CPU-routed RNG tracker (dropout forks)
    torch.manual_seed(1234)
    return config


def _build_training_state(cfg: RunConfig, config):
    """The model of this rank, Megatron's DDP wrapper (fp32 ``main_grad`` buffers) and the
    mixed-precision Adam; for ``fsdp_cp`` the FSDP2-sharded model (``fsdp_cp.shard_model``) with
    no DDP wrapper (None) and Adam over the shards."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if cfg.scheme == "fsdp_cp":
        from megatron_tsp.tools.estimator import fsdp_run

        model = fsdp_run.shard_model(build_model(cfg, config), cfg)
        return model, None, fsdp_run.ShardAdam(model)
    model = build_model(cfg, config)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.distributed_optimizer,
        bucket_size=None,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = MasterAdam(
        ddp, mpu.get_data_parallel_group(with_context_parallel=True), cfg.distributed_optimizer
    )
    return model, ddp, optimizer


def _local_batch(cfg: RunConfig):
    """Random tokens and labels of this rank's sequence slice, and their positions (TP x CP:
    Megatron's get_batch_on_this_cp_rank zigzag, chunks r and 2CP-1-r)."""
    from megatron.core import parallel_state as mpu

    local_seq, b = cfg.seq // cfg.cp, cfg.micro_batch
    tokens = torch.randint(0, cfg.model.vocab, (b, local_seq))
    labels = torch.randint(0, cfg.model.vocab, (b, local_seq))
    if cfg.cp > 1:  # TP x CP and TSP x CP: Megatron's own CP split (TSP composes with it)
        from megatron_tsp.core.layout import TSPLayout

        cp_layout = TSPLayout(cfg.cp, cfg.seq, mpu.get_context_parallel_rank())
        pos = cp_layout.positions().unsqueeze(0).expand(b, -1)
    else:
        pos = torch.arange(local_seq).unsqueeze(0).expand(b, -1)
    return tokens, labels, pos


def _local_numel(module) -> int:
    """This rank's parameter elements (an FSDP2 parameter's: its local shard's)."""
    return sum(getattr(p, "_local_tensor", p).numel() for p in module.parameters())


def _categories(snapshot) -> Dict[str, int]:
    return {str(k.value if hasattr(k, "value") else k): int(v) for k, v in snapshot.items()}


def _track_static(model, ddp, optimizer):
    """A ``MemTracker`` that knows the parameters, gradient buffers and optimizer state allocated
    so far; returns it with their sizes by category."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    tracker = lean_mem_tracker()
    tracker.track_external(model, optimizer.optimizer)
    # the dense parameters' buffers and, for MoE models, the experts' (expert-data-parallel);
    # fsdp_cp has none (FSDP2: the sharded parameters, no gradient until its backward)
    buffers = [] if ddp is None else ddp.buffers
    for buffer in list(buffers) + list(getattr(ddp, "expert_parallel_buffers", [])):
        _tag(tracker, buffer.grad_data, _MemRefType.GRAD)
        if buffer.param_data is not None:
            _tag(tracker, buffer.param_data, _MemRefType.PARAM)
    for t in optimizer.tensors():
        _tag(tracker, t, _MemRefType.OPT)
    current = next(iter(tracker.get_tracker_snapshot("current").values()), {})
    return tracker, _categories(current)


def _training_step(model, ddp, optimizer, tracker, batch, comm) -> List[int]:
    """Forward, backward, gradient finalisation and the optimizer step; returns the counter's
    record counts at the end of forward and of backward (0 without a counter)."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    tokens, labels, pos = batch
    with torch.autograd.profiler.record_function("tsp_measured_step"):
        if ddp is None:  # fsdp_cp: FSDP2 reduce-scatters each unit's gradient in its backward
            optimizer.zero_grad()
        else:
            ddp.zero_grad_buffer()
        # DDP's forward only forwards to the module (and DDP's ``buffers`` attribute, a list,
        # shadows nn.Module.buffers()); its grad hooks stay.
        loss_per_token = model(tokens, pos, None, labels=labels)
        loss = loss_per_token.float().sum() / loss_per_token.numel()
        marks = [len(comm.records) if comm is not None else 0]
        loss.backward()
        marks.append(len(comm.records) if comm is not None else 0)
        del loss, loss_per_token
        tracker._phase = "grad_sync"
        if ddp is not None:
            finalize_model_grads([ddp])
        tracker._phase = "optimizer"
        optimizer.step()
    return marks


def _comm_by_phase(records, marks: List[int]) -> Dict[str, float]:
    parts = {
        "forward": records[: marks[0]],
        "backward": records[marks[0] : marks[1]],
        "grad_sync_and_step": records[marks[1] :],
    }
    out = {f"recv_bytes_{k}": float(sum(r.recv_bytes for r in v)) for k, v in parts.items()}
    out.update({f"calls_{k}": len(v) for k, v in parts.items()})
    return out


def _allocator_peak(profiler) -> int:
    """Real runs: the CPU allocator's peak during the measured step (profiler memory events)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        profiler.export_chrome_trace(path)
        return _profile_peak(path, _step_start_ts(path))


def run_step(cfg: RunConfig) -> RunResult:
    """Build one rank of ``cfg`` and run one full training step; see the module docstring."""
    cfg.validate()
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_tsp.core.comm import WORKSPACE

    t0 = time.time()
    config = _prepare(cfg)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if cfg.fake else contextlib.nullcontext()
    routing = contextlib.nullcontext()
    if cfg.model.is_moe:
        from megatron_tsp.megatron_lm.cpu_runner import alltoall_dispatcher_on_cpu
        from megatron_tsp.tools.estimator.uniform_routing import uniform_routing

        uniform = cfg.moe_routing == "uniform"
        routing = uniform_routing() if uniform else alltoall_dispatcher_on_cpu()
    profiler = None
    if not cfg.fake:
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        profiler.__enter__()
    try:
        with routing, fake_mode:
            model, ddp, optimizer = _build_training_state(cfg, config)
            batch = _local_batch(cfg)
            params_local = _local_numel(model if ddp is None else ddp)
            tracker, static = _track_static(model, ddp, optimizer)
            flop_counter = (
                flops_count.make_flop_counter() if cfg.count_flops else contextlib.nullcontext()
            )
            mem_tracker = tracker if cfg.fake or cfg.track_real else contextlib.nullcontext()
            with (
                no_rng_fork(cfg.fake),
                _uncoalesced_grad_sync(),
                cpu_cp_rope(),
                _comm_counter(cfg.count_comm) as comm,
                mem_tracker,
                flop_counter,
            ):
                marks = _training_step(model, ddp, optimizer, tracker, batch, comm)
            peak_snap = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    finally:
        if profiler is not None:
            profiler.__exit__(None, None, None)

    breakdown = _categories(peak_snap)
    peak = breakdown.pop("Total", sum(breakdown.values()))
    if not cfg.fake and not cfg.track_real:
        # Real runs are measured by the CPU allocator alone: MemTracker's module hooks stay out,
        # so the check of the fake-tensor number is independent of the tracker.
        breakdown, peak = {}, None
    result = RunResult(
        config=_config_dict(cfg),
        label=cfg.label,
        peak_bytes=peak,
        peak_breakdown=breakdown,
        static_bytes=static,
        params_local=int(params_local),
        peak_phase=tracker.peak_phase if cfg.fake else "",
    )
    if cfg.count_flops:
        result.flops = flops_count.summarize(flop_counter)
    if cfg.count_comm:
        result.comm = _comm_by_phase(comm.records, marks)
    if profiler is not None:
        result.real_peak_bytes = _allocator_peak(profiler)
        if not cfg.track_real:
            result.peak_bytes = result.real_peak_bytes
    result.wall_s = time.time() - t0
    WORKSPACE.clear()
    del ddp, model, optimizer, tracker
    gc.collect()
    return result


def _config_dict(cfg: RunConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["padded_vocab"] = cfg.padded_vocab()
    d["dp"] = cfg.dp
    d["sequence_parallel"] = cfg.sequence_parallel
    return d


# --------------------------------------------------------------------------------------------
# isolated runs


def _config_from_dict(d: dict) -> RunConfig:
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    kw = {k: v for k, v in d.items() if k in fields}
    kw["model"] = ModelShape.from_json(d["model"])
    return RunConfig(**kw)


def run_step_isolated(cfg: RunConfig, timeout: float = 1800, threads: int = 1) -> RunResult:
    """``run_step`` in a fresh Python process.

    Measurements in a long-lived process are not independent: module-level caches (RoPE tables,
    zigzag permutations, Megatron's global memory buffer) allocated by an earlier run are reused
    by a later one and disappear from its allocator count. Real-tensor checks run here, with
    ``threads`` intra-op threads: torch's CPU flash-attention kernel allocates per-thread scratch
    (~1.5 MB per thread at small shapes) that no dispatch-level tracker can see.
    """
    payload = json.dumps(dataclasses.asdict(cfg))
    code = (
        "import json, sys, dataclasses, warnings; warnings.filterwarnings('ignore'); "
        "from megatron_tsp.tools.estimator import fake_run as f; "
        "r = f.run_step(f._config_from_dict(json.loads(sys.stdin.read()))); "
        "print('@@RESULT@@' + json.dumps(dataclasses.asdict(r), default=str))"
    )
    return RunResult(
        **run_in_fresh_process(code, payload, timeout, {"OMP_NUM_THREADS": str(threads)})
    )


def run_in_fresh_process(
    code: str, payload: str, timeout: float, env: Optional[Dict[str, str]] = None
) -> dict:
    """Run ``code`` in a fresh interpreter with ``payload`` on stdin; ``code`` prints its result
    as one JSON line after ``@@RESULT@@``. This checkout comes first on ``PYTHONPATH``."""
    import subprocess
    import sys

    # the checkout: <root>/megatron_tsp/tools/estimator/fake_run.py
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = root + (
        os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=payload,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("@@RESULT@@"):
            return json.loads(line[len("@@RESULT@@") :])
    raise RuntimeError(f"isolated run failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
