"""TSP expert ring: MoE experts sharded 1/D per rank, weight shards on the MLP's P2P ring.

Layout: every rank of the TSP group (D ranks) holds the TP=D shard p of EVERY expert, exactly as
megatron-core shards experts with expert-tensor-parallel size D and expert-model-parallel size 1
(``SequentialMLP`` of ``MLP(is_expert=True)`` over Column/RowParallelLinear on the expert-TP
group, which is the TSP group): parameter names, shapes, ``sharded_state_dict`` and checkpoints
are those of a TP=D+SP run with ETP=D, EP=1. Tokens never move:

* the router runs on the rank's own S/D tokens (load-balancing statistics summed over the TSP
  group by megatron-core, the same token set as TP+SP);
* ``TSPLocalTokenDispatcher`` is Megatron's allgather dispatcher without its collectives: with
  every expert local, its all-gather / reduce-scatter are the identity, and its local permute /
  unpermute (Megatron's own code, so the same per-expert token order and probability layout) is
  all that is left;
* ``TSPRingExperts`` applies every expert to this rank's tokens routed to it on a ring:

Forward (one autograd ``Function`` for all experts of the layer, so every rank takes every ring
step in the same expert order, whatever its token counts, including zero tokens), p = this rank,
for t = 0..D-1 with j = (p - t) mod D:

    post send(W_j -> p+1), recv(W_{j-1} <- p-1)   # W_j: all E experts' (fc1, [b1], fc2) shard j
    for e in experts:  Y_e += act(X_e @ fc1_{e,j}^T + b1_{e,j}) @ fc2_{e,j}^T
    wait

i.e. D-1 hops of one packed buffer holding the E experts' shards (E x the bytes of one expert's
fc1 + fc2 shard, the same bytes as E separate ``tsp_mlp`` rings in E times fewer messages).
Backward: the same D-1 weight hops, plus D-1 hops of the packed weight-gradient accumulator one
step behind (fp32 for bf16/fp16 parameters, as ``mlp.tsp_mlp``), the last hop landing on the
owner, who then holds its shards' full gradient exactly like an ETP=D rank. No all-gather, no
all-to-all, no token traffic, no collectives.

Router probabilities: megatron-core's expert ``MLP`` multiplies the activation output by the
token's probability (``per_token_scale``) before fc2 and adds ``prob * b2`` for an fc2 bias, i.e.
``prob * (act(...) @ fc2^T + b2) = prob * expert(x)``. The ring returns ``expert(x)`` per token and
the probability multiplies it outside, so autograd differentiates the probabilities
(``moe_apply_probs_on_input``: the input is scaled first and the output is not, as megatron-core
does). megatron-core accepts expert biases only at expert-tensor-parallel size 1, so ring experts
have none at D > 1; the fc1 bias path of the ring function is the dense MLP's.

Extra memory over ``tsp_mlp`` per layer: the packed buffers hold all E experts' shards (three
weight buffers of E/D experts' weights, and in backward three accumulators of the same size in
fp32 for bf16), O(expert weights / D), independent of the sequence length.
"""

from __future__ import annotations

import copy
from typing import List, Sequence

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from megatron_tsp.core import rejections
from megatron_tsp.core.comm import FlatShard, labelled, weight_bias_views
from megatron_tsp.core.layers import weight_ring
from megatron_tsp.core.layers.grads import weight_grad_output
from megatron_tsp.core.layers.mlp import (
    MLPActivation,
    _fc1,
    activation_backward,
    make_activation,
)
from megatron_tsp.core.layers.module_hooks import run_forward_pre_hooks
from megatron_tsp.core.layers.precision import (
    activation_sum_dtype,
    matmul_acc,
    matmul_onto,
    ring_grad_dtype,
    sum_rows_onto,
)

# Payload names of the expert ring's transfers (``comm.Pending.payload``).
WEIGHTS = "moe_ring.weights"
WEIGHT_GRADS = "moe_ring.weight_grads"
LABEL = "tsp_moe_ring"


def _per_expert(views: Sequence[torch.Tensor], has_bias: bool) -> List[tuple]:
    """[(w1, b1 or None, w2)] per expert from the packed [w1, (b1), w2] * E views."""
    per = 3 if has_bias else 2
    return [weight_bias_views(views[i : i + per], has_bias) for i in range(0, len(views), per)]


class _ExpertRingFunction(torch.autograd.Function):
    """Forward: D-1 ring hops of the packed all-experts shard, each posted before the current
    shard's GEMMs. Backward: D-1 weight hops plus D-1 gradient-accumulator hops one step behind
    (``weight_ring``, shared with the TSP MLP). ``x`` is [N, h], this rank's tokens permuted by
    expert (``counts[e]`` rows for expert e, possibly 0); returns [N, h] without fc2 bias."""

    @staticmethod
    def forward(
        ctx, x, counts, group, activation, accumulate, recompute, sums_in_fp32, has_bias, *params
    ):
        acc_dtype = activation_sum_dtype(x.dtype, sums_in_fp32)
        xs = x.split(counts)
        hidden_size = params[-1].shape[0]
        saved_pre = []  # [t][e] fc1 outputs, flattened, when not recomputing them
        out = torch.zeros(x.shape[0], hidden_size, dtype=acc_dtype, device=x.device)
        outs = out.split(counts)
        with labelled(LABEL):
            for _, views in weight_ring.shards(params, group, WEIGHTS):
                for x_e, out_e, (w1, b1, w2) in zip(xs, outs, _per_expert(views, has_bias)):
                    pre = _fc1(x_e, w1, b1)
                    if not recompute:
                        saved_pre.append(pre)
                    matmul_acc(activation(pre), w2.t(), out_e)
        ctx.save_for_backward(x, *params, *saved_pre)
        ctx.num_params = len(params)
        ctx.counts, ctx.group, ctx.activation = counts, group, activation
        ctx.accumulate, ctx.has_bias = accumulate, has_bias
        ctx.sums_in_fp32 = sums_in_fp32
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, *rest = ctx.saved_tensors
        params, saved_pre = rest[: ctx.num_params], rest[ctx.num_params :]
        counts, group, activation, has_bias = ctx.counts, ctx.group, ctx.activation, ctx.has_bias
        num_experts = len(counts)
        acc_dtype = activation_sum_dtype(x.dtype, ctx.sums_in_fp32)
        grad_dtype = ring_grad_dtype(params, ctx.accumulate)
        grad_out = grad_out.contiguous()
        xs, dys = x.split(counts), grad_out.split(counts)
        grad_x = torch.zeros(x.shape, dtype=acc_dtype, device=x.device)
        grad_xs = grad_x.split(counts)

        last_step = dist.get_world_size(group) - 1
        last_dx = []  # the last shard's dX GEMMs: issued while the drain is in flight

        def input_grads(views, step):
            """Every expert's activation backward and dX contribution of this shard, added onto
            ``grad_x`` (the last shard's kept for ``last_shard_input_grads``); returns
            [(d_pre, hidden)] per expert for the weight gradients."""
            kept = []
            for e, (w1, b1, w2) in enumerate(_per_expert(views, has_bias)):
                pre = saved_pre[step * num_experts + e] if saved_pre else _fc1(xs[e], w1, b1)
                d_hidden = torch.matmul(dys[e], w2)
                hidden, d_pre = activation_backward(activation, pre, d_hidden, (pre.shape[0],))
                if step == last_step:
                    last_dx.append((d_pre, w1, grad_xs[e]))
                else:
                    matmul_acc(d_pre, w1, grad_xs[e])
                kept.append((d_pre, hidden))
            return kept

        def last_shard_input_grads() -> None:
            """The last shard's dX GEMMs, issued between the drain's post and its wait (its
            weights stay in their ring buffer: no hop follows the last step's)."""
            for d_pre, w1, grad_x_e in last_dx:
                matmul_acc(d_pre, w1, grad_x_e)

        def weight_grads(kept, out: FlatShard, accumulate: bool) -> None:
            """This rank's tokens' partial weight gradients of every expert's shard, written into
            ``out`` or added in place by the GEMMs (``accumulate``)."""
            for e, (g_w1, g_b1, g_w2) in enumerate(_per_expert(out.views(), has_bias)):
                d_pre, hidden = kept[e]
                matmul_onto(d_pre.t(), xs[e], g_w1, accumulate)
                if has_bias:
                    sum_rows_onto(d_pre, g_b1, accumulate)
                matmul_onto(dys[e].t(), hidden, g_w2, accumulate)

        with labelled(LABEL):  # the schedule and its queue order: ``weight_ring``
            own = weight_ring.backward(
                params,
                group,
                grad_dtype,
                input_grads,
                weight_grads,
                (WEIGHTS, WEIGHT_GRADS),
                cover_drain=last_shard_input_grads,
            )
        grads = [weight_grad_output(p, g, ctx.accumulate) for p, g in zip(params, own.views())]
        return (grad_x.to(x.dtype), None, None, None, None, None, None, None, *grads)


def tsp_expert_ring(
    x: torch.Tensor,
    counts: Sequence[int],
    params: Sequence[torch.Tensor],
    has_bias: bool,
    group,
    activation: MLPActivation,
    accumulate_into_main_grad: bool = False,
    recompute_activation: bool = False,
    activation_sums_in_fp32: bool = False,
) -> torch.Tensor:
    """``expert_e(x_e)`` (without fc2 bias) for every expert e on rows ``counts[e]`` of ``x``,
    each expert's D shards applied on one ring shared by all experts (module docstring).
    ``params``: per expert ``fc1.weight, [fc1.bias], fc2.weight`` (this rank's shards).
    ``activation``: as ``mlp.tsp_mlp``'s (an ``MLPActivation``: its backward is TSP's
    activation kernel where that has the formula, autograd otherwise).
    ``activation_sums_in_fp32``: as ``mlp.tsp_mlp``'s."""
    return _ExpertRingFunction.apply(
        x,
        tuple(int(c) for c in counts),
        group,
        activation,
        accumulate_into_main_grad,
        recompute_activation or not torch.is_grad_enabled(),
        activation_sums_in_fp32,
        has_bias,
        *params,
    )


class TSPRingExperts(SequentialMLP):
    """megatron-core's ``SequentialMLP`` whose experts run on the TSP expert ring.

    ``SequentialMLP.__init__`` builds the experts (``MLP(is_expert=True)`` on the expert-TP group),
    so parameters, names and ``sharded_state_dict`` are megatron-core's for ETP=D, EP=1; only
    ``forward`` differs. Every expert is local (EP=1) and its weights are sharded over the TSP
    group, which must be the expert-TP group."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, **kwargs):
        # newer cores pass more keywords (0.19: name): forward those SequentialMLP accepts
        super().__init__(
            num_local_experts,
            config,
            submodules,
            pg_collection=pg_collection,
            **kwargs,
        )
        ep, etp, tp = pg_collection.ep, pg_collection.expt_tp, pg_collection.tp
        d = dist.get_world_size(tp)
        if dist.get_world_size(ep) != 1 or dist.get_process_group_ranks(
            etp
        ) != dist.get_process_group_ranks(tp):
            raise rejections.TSPRejection(
                f"the TSP expert ring (--tsp-moe-ring) needs every expert on every TSP rank: "
                f"expert-model-parallel size 1 (got {dist.get_world_size(ep)}) and the "
                f"expert-tensor-parallel group equal to the TSP group of {d} ranks "
                f"(--expert-tensor-parallel-size {d}, got {dist.get_world_size(etp)})"
            )
        self.tsp_group = etp
        self.tsp_activation = make_activation(self.config)
        self.gradient_accumulation_fusion = self.config.gradient_accumulation_fusion
        self.has_fc1_bias = self.local_experts[0].linear_fc1.bias is not None
        self.recompute_activation = False
        self.activation_sums_in_fp32 = bool(
            getattr(self.config, "tsp_activation_sums_in_fp32", False)
        )

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        scale = permuted_probs
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input needs moe_router_topk=1 (megatron-core)")
            x = (permuted_probs.unsqueeze(-1) * x).to(x.dtype)
            scale = None
        params = []
        for expert in self.local_experts:
            fc1, fc2 = expert.linear_fc1, expert.linear_fc2
            # fc1 / fc2 are not called: fire their pre-hooks (DDP param-gather waits).
            run_forward_pre_hooks(fc1)
            run_forward_pre_hooks(fc2)
            params += [fc1.weight] + ([fc1.bias] if self.has_fc1_bias else []) + [fc2.weight]
        counts = tokens_per_expert.tolist()
        out = tsp_expert_ring(
            x,
            counts,
            params,
            self.has_fc1_bias,
            self.tsp_group,
            self.tsp_activation,
            self.gradient_accumulation_fusion,
            self.recompute_activation,
            self.activation_sums_in_fp32,
        )
        biases = [expert.linear_fc2.bias for expert in self.local_experts]
        if biases[0] is not None:  # fc2's bias is whole on every rank (RowParallelLinear)
            out = torch.cat([o + b for o, b in zip(out.split(counts), biases)])
        if scale is not None:
            out = (out * scale.unsqueeze(-1)).to(out.dtype)
        return out, None


class TSPLocalTokenDispatcher(MoEAllGatherTokenDispatcher):
    """Megatron's allgather dispatcher with every expert on this rank: no all-gather before the
    experts, no reduce-scatter after them (the tokens stay on their rank), only its local
    permute / unpermute by the routing map."""

    def token_dispatch(self, hidden_states, probs):
        return hidden_states, probs

    def token_combine(self, hidden_states):
        return hidden_states


class TSPRingMoELayer(MoELayer):
    """megatron-core's ``MoELayer`` (router, shared experts, local permutation) with the local
    dispatcher and ``TSPRingExperts``. The dispatcher type flag does not matter here (no tokens
    move); megatron-core builds its allgather dispatcher, which this class replaces."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, **kwargs):
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        if config.moe_token_dispatcher_type != "allgather":
            # the alltoall dispatcher's constructor needs CUDA streams and is never used here
            config = copy.copy(config)
            config.moe_token_dispatcher_type = "allgather"
        super().__init__(
            config,
            submodules,
            layer_number,
            pg_collection,
            **kwargs,  # megatron-core 0.19: is_mtp_layer, name
        )
        self.token_dispatcher = TSPLocalTokenDispatcher(
            self.num_local_experts,
            self.local_expert_indices,
            config=self.config,
            pg_collection=pg_collection,
        )
