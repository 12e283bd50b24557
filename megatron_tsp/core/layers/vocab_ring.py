"""TSP's output layer and cross-entropy: the vocabulary shards circulate, tokens stay.

Under TP+SP (and under TSP before this module) the output layer all-gathers the final hidden
states [S, b, h] over the group, each rank computes the logits of every token for its 1/D of the
vocabulary, and the cross-entropy all-reduces the max, the sum of exponentials and the target
logit over the group; backward re-gathers the hidden states (wgrad) and reduce-scatters their
gradient: 3·f·B·S·h activation bytes per micro-batch (f = (D-1)/D), plus the forward gather.

Here rank p keeps its own tokens X_p ([s, b, h], s = S/D) and the output weight's vocabulary
shards W_j ([V/D, h], rank j's rows of the padded vocabulary) ride the weight ring
(``weight_ring``), as the MLP's do. Forward, for t = 0..D-1 with j = (p - t) mod D:

    post send(W_j -> p+1), recv(W_{j-1} <- p-1)             # the next shard, before the GEMM
    L_p[:, j] = float(X_p @ W_j^T)                            # logits of p's tokens, shard j
    wait
then, with the whole vocabulary's logits of its own tokens in hand (fp32, natural vocabulary
order), the cross-entropy is local: loss = log Σ exp(L - max) - (L[target] - max), no
all-reduce. The softmax (exp(L - max) / Σ, in place) is kept for backward, as Megatron's
cross-entropy keeps its shard's: [s·b, V] fp32 here, [S·b, V/D] there, the same bytes.

Backward runs the ring again (``weight_ring.backward``): per shard, dL_j = softmax[:, j] · g minus
g at the target (fp32, cast to the compute dtype per shard: TP+SP's logits gradient reaches its
GEMMs in the compute dtype too), dX_p += dL_j @ W_j, and the fp32 weight-gradient accumulator of
shard j rides one hop behind the weights and lands on its owner summed over every rank's tokens.

Wire per micro-batch and rank: forward f·V·h weight bytes, backward f·V·h weights + f·V·h·4
(fp32) gradient bytes (``formulas.head_comm``). Independent of S: at 7B / 128k / D = 8 it moves
0.94 GB where the activation path moves 2.82 GB. The caller gathers the per-token losses ([s, b]
fp32, a few kB) so Megatron's loss function sees [b, S] as under TP+SP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_tsp.core.comm import FlatShard, labelled
from megatron_tsp.core.layers import weight_ring
from megatron_tsp.core.layers.grads import weight_grad_output
from megatron_tsp.core.layers.precision import (
    activation_sum_dtype,
    matmul_acc,
    matmul_onto,
    ring_grad_dtype,
)

# Payload names of the ring's transfers (``comm.Pending.payload``, read by the trace tests).
WEIGHTS = "vocab.weights"
WEIGHT_GRADS = "vocab.weight_grads"


class _VocabRingCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of this rank's tokens over the whole (padded) vocabulary.

    Forward communication: D-1 hops of the [V/D, h] weight shard on the P2P ring.
    Backward communication: D-1 weight hops again and D-1 hops of the fp32 weight-gradient
    accumulator, one step behind (``weight_ring.backward``). No collective."""

    @staticmethod
    def forward(ctx, hidden, weight, target, group, accumulate_into_main_grad, sums_in_fp32):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        shard_rows = weight.shape[0]
        tokens = hidden.reshape(-1, hidden.shape[-1])
        # [tokens, D, V/D]: shard j's logits in block j, so the rows read in vocabulary order;
        # fp32 as Megatron's cross-entropy computes (fp64 models keep fp64)
        logits = torch.empty(
            tokens.shape[0],
            size,
            shard_rows,
            dtype=torch.promote_types(hidden.dtype, torch.float32),
            device=hidden.device,
        )
        with labelled("vocab_ring"):
            for t, (w,) in weight_ring.shards([weight], group, WEIGHTS):
                # the GEMM's result in the compute dtype, as Megatron's output layer returns it
                logits[:, (rank - t) % size].copy_(torch.mm(tokens, w.t()))
        logits = logits.view(tokens.shape[0], size * shard_rows)
        target_1d = target.reshape(-1)
        peak = logits.max(dim=-1).values
        logits.sub_(peak.unsqueeze(-1))
        predicted = logits.gather(1, target_1d.unsqueeze(-1)).squeeze(-1)
        softmax = logits.exp_()  # in place: the only full-vocabulary buffer
        sum_exp = softmax.sum(dim=-1)
        loss = torch.log(sum_exp) - predicted
        softmax.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(hidden, weight, target_1d, softmax)
        ctx.group = group
        ctx.accumulate_into_main_grad = accumulate_into_main_grad
        ctx.sums_in_fp32 = sums_in_fp32
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, target_1d, softmax = ctx.saved_tensors
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        shard_rows = weight.shape[0]
        tokens = hidden.reshape(-1, hidden.shape[-1])
        g = grad_loss.reshape(-1, 1).to(softmax.dtype)
        # d loss / d logits = (softmax - one-hot(target)) * g, in place on the saved softmax
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        softmax[rows, target_1d] -= 1.0
        softmax.mul_(g)
        d_logits = softmax.view(-1, size, shard_rows)
        sum_dtype = activation_sum_dtype(hidden.dtype, ctx.sums_in_fp32)
        grad_x = None

        def input_grads(views, step):
            """Shard (rank - step) mod D's logits gradient in the compute dtype and its dX
            contribution, added onto ``grad_x``; the gradient is kept for the wgrad."""
            nonlocal grad_x
            (w,) = views
            d_shard = d_logits[:, (rank - step) % size].to(hidden.dtype)
            grad_x = matmul_acc(d_shard, w, grad_x, dtype=sum_dtype)
            return d_shard

        def weight_grads(d_shard, out: FlatShard, accumulate: bool) -> None:
            (g_w,) = out.views()
            matmul_onto(d_shard.t(), tokens, g_w, accumulate)

        with labelled("vocab_ring"):
            own = weight_ring.backward(
                [weight],
                group,
                ring_grad_dtype([weight], ctx.accumulate_into_main_grad),
                input_grads,
                weight_grads,
                (WEIGHTS, WEIGHT_GRADS),
            )
        (g_w,) = own.views()
        return (
            grad_x.to(hidden.dtype).view(hidden.shape),
            weight_grad_output(weight, g_w, ctx.accumulate_into_main_grad),
            None,
            None,
            None,
            None,
        )


def vocab_ring_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    group,
    *,
    accumulate_into_main_grad: bool = False,
    sums_in_fp32: bool = False,
) -> torch.Tensor:
    """Per-token losses [s, b] (fp32) of this rank's tokens: ``hidden`` [s, b, h] (the final
    norm's output), ``weight`` this rank's [V/D, h] rows of the output layer's (padded)
    vocabulary, ``target`` [s, b] token ids (module docstring). ``accumulate_into_main_grad``:
    Megatron's ``gradient_accumulation_fusion`` (the weight gradient lands in ``main_grad``);
    ``sums_in_fp32``: dX summed over the D shards in fp32 (``--tsp-activation-sums-in-fp32``)."""
    if hidden.shape[:-1] != target.shape:
        raise ValueError(
            f"vocab ring: hidden {tuple(hidden.shape)} and target {tuple(target.shape)} must "
            "cover the same [s, b] tokens"
        )
    if weight.shape[-1] != hidden.shape[-1]:
        raise ValueError(
            f"vocab ring: output weight {tuple(weight.shape)} does not take hidden size "
            f"{hidden.shape[-1]}"
        )
    return _VocabRingCrossEntropy.apply(
        hidden, weight, target, group, accumulate_into_main_grad, sums_in_fp32
    )
