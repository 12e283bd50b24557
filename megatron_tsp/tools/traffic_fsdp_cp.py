"""FSDP x CP's layer for ``bench --traffic``: what one rank issues, on shape-only CUDA tensors.

FSDP x CP (the planner's ``fsdp_cp`` / ``fsdp_cp_ring``) is ZeRO-3 over the whole sequence group
of N ranks with DP = 1 inside it: every rank holds 1/N of every parameter, runs the layer with
whole weights on its S/N tokens (Megatron's zigzag CP layout: chunks r and 2N-1-r) and attends
over the other ranks' K/V. The recording runs megatron-core's own layer at TP = 1, CP = N (the
memory tool's Megatron layer spec, ``fake_run.layer_spec`` with scheme ``tp_cp``, its norms and
linear layers; one GEMM per weight and direction, the weight gradient written once in the model
dtype: no fp32 partial gradients), Megatron's fused RoPE as on a Transformer Engine box, and
stands in for the two pieces a GPU run takes from libraries this machine does not have:

Weights (Megatron-FSDP ``optim_grads_params``; :class:`LayerShards`):

* unshard: the layer's parameters are all-gathered from the rank's 1/N shard into one flat
  buffer of the layer's weight bytes (one collective, forward and again before the backward; the
  collective is not a kernel and its bytes are not HBM bytes of the counting rule, as for every
  scheme, but each collective's buffer is recorded: ``OpRecord.comm_bytes``). No copy-in and no
  copy-out kernel: Megatron-FSDP's shard is a slice of the flat buffer NCCL sends from, and the
  unsharded parameters are views of the gathered buffer. (FSDP2 copies the shards into its
  all-gather input and the gathered buffer out into the parameters: two more kernels per gather,
  2 W bytes more; not recorded.)
* gradient reduce-scatter: after the layer's backward its weight gradients (the model dtype)
  are copied into one reduce-scatter input buffer, rank-chunked (one ``cat`` kernel: reads and
  writes the layer's weight bytes, FSDP2's ``_chunk_cat``; Megatron-FSDP's copy into its grad
  bucket moves the same bytes), then reduce-scattered in the model dtype (Megatron-LM's default)
  into the rank's gradient shard, which the optimizer reads (no kernel: one micro-batch; gradient
  accumulation over micro-batches adds one add of W/N per micro-batch, not recorded).

Attention (Transformer Engine's context parallelism):

* ``fsdp_cp`` (``--cp-comm-type all_gather``, :class:`KVAllGatherAttention`): K and V each
  all-gathered (two collectives) and put in sequence order (one ``index_select`` each: TE's
  reorder of the rank-major chunks), then one causal flash call per local chunk over the keys it
  sees (bottom-right aligned), its output copied into the layer's output; backward re-gathers and
  reorders K and V, zero-fills dK and dV (the whole sequence, the model dtype), runs one flash
  backward per chunk, copies dQ and adds dK / dV into the sequence buffers, reorders them back
  (``index_select``) and reduce-scatters each.
* ``fsdp_cp_ring`` (``p2p``, TE's default, :class:`KVRingAttention`): K and V packed into one
  buffer (one ``cat``) that N-1 P2P steps pass around the ring; step 0 is the causal diagonal
  block, step i the block of rank r-i: both local chunks against its first chunk (i <= r) or the
  second local chunk against both its chunks (i > r), no mask. Per step the fp32 log-sum-exp is
  merged (one ``logaddexp``, TE's fused ``softmax_lse_correction``); after the loop the output
  (zero-filled, the model dtype) takes every step's rescaled partial output (one fused kernel per
  step, TE's ``out_correction``: stood in by ``megatron_tsp_traffic::cp_out_correction``).
  Backward: the second half of the log-sum-exp made contiguous once, one flash backward per step,
  dQ copied (step 0) or added, dK and dV copied (step 0) or added into the buffer that travels
  the ring with the K/V (aten's flash backward returns dK and dV apart: two adds a step where TE
  writes them packed, one).
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from megatron_tsp.core.layers import kernels
from megatron_tsp.core.layout import TSPLayout

FSDP_SCHEMES = ("fsdp_cp", "fsdp_cp_ring")
_OUT_CORRECTION: List[object] = []


def out_correction_op():
    """``megatron_tsp_traffic::cp_out_correction(out, out_step, lse, lse_step)``: out +=
    out_step * exp(lse_step - lse) in place (TE's jit-fused ``flash_attn_fwd_out_correction``,
    one kernel), ``out`` / ``out_step`` [b, h, s, d], the log-sum-exps [b, h, s] fp32."""
    if _OUT_CORRECTION:
        return _OUT_CORRECTION[0]

    @torch.library.custom_op(
        "megatron_tsp_traffic::cp_out_correction",
        mutates_args=("out",),
        schema="(Tensor(a!) out, Tensor out_step, Tensor lse, Tensor lse_step) -> ()",
    )
    def cp_out_correction(out, out_step, lse, lse_step):
        scale = torch.exp(lse_step - lse).unsqueeze(-1)
        out.add_((out_step.float() * scale).to(out.dtype))

    @cp_out_correction.register_fake
    def _(out, out_step, lse, lse_step):
        return None

    _OUT_CORRECTION.append(torch.ops.megatron_tsp_traffic.cp_out_correction)
    return _OUT_CORRECTION[0]


def _kernel(q, k):
    """The layers' attention kernel for these tensors ([s, b, n, d]); one that returns no
    log-sum-exp (``sdpa_recompute``, where pinned) gives way to the device's default: TE's CP
    attention is a flash kernel that saves it."""
    gqa = q.shape[2] != k.shape[2]
    kernel = kernels.select_kernel(q.device, q.dtype, q.shape[-1], gqa)
    if getattr(kernel, "has_lse", True):
        return kernel
    return kernels.get_kernel(kernels.kernel_choice(q.device.type, q.dtype, q.shape[-1], gqa))


def _gather(t, group, size):
    out = torch.empty((size * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out


def _reorder(t, index, size):
    """Chunks of ``t`` [2N * C, ...] picked in ``index`` order (one gather kernel)."""
    chunks = TSPLayout(size, t.shape[0])
    return (
        t.view(chunks.num_chunks, chunks.chunk_len, *t.shape[1:])
        .index_select(0, index)
        .view(t.shape)
    )


def reorder_indices(size: int, rank: int, device):
    """(to sequence order, back to rank-major order) for the zigzag chunks of ``size`` ranks:
    rank j holds chunks j and 2N-1-j, gathered rank-major."""
    chunks = TSPLayout(size, 2 * size)  # one position per chunk: positions are chunk ids
    return chunks.inverse(device), chunks.permutation(device)


class KVAllGatherAttention(torch.autograd.Function):
    """TE's CP attention with ``cp_comm_type="all_gather"`` (q, k, v: [2C, b, n, d], the local
    zigzag chunks r and 2N-1-r). Forward: all-gathers K and V (two collectives over the CP
    group), one causal flash call per local chunk. Backward: re-gathers K and V, reduce-scatters
    dK and dV (two collectives)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, group, indices):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[0] // 2
        k_all = _reorder(_gather(k, group, size), indices[0], size)
        v_all = _reorder(_gather(v, group, size), indices[0], size)
        kernel = _kernel(q, k)
        out = torch.empty_like(q)
        lses = []
        for i, chunk in enumerate(TSPLayout(size, 2 * size).chunks_of(rank)):
            keys = (chunk + 1) * c
            q_i = q.narrow(0, i * c, c)
            o, lse = kernel.forward(
                *map(kernels._heads_view, (q_i, k_all[:keys], v_all[:keys])),
                kernels.BOTTOM_RIGHT,
                scale,
            )
            out.narrow(0, i * c, c).copy_(o.permute(2, 0, 1, 3))
            lses.append(lse)
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.scale, ctx.group, ctx.indices, ctx.kernel = scale, group, indices, kernel
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, *lses = ctx.saved_tensors
        group, indices = ctx.group, ctx.indices
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[0] // 2
        k_all = _reorder(_gather(k, group, size), indices[0], size)
        v_all = _reorder(_gather(v, group, size), indices[0], size)
        # memsets (``zeros``: the counting rule reads no argument of theirs)
        dk_all = torch.zeros(k_all.shape, dtype=k.dtype, device=k.device)
        dv_all = torch.zeros(v_all.shape, dtype=v.dtype, device=v.device)
        dq = torch.empty_like(q)
        heads = kernels._heads_view
        for i, chunk in enumerate(TSPLayout(size, 2 * size).chunks_of(rank)):
            keys = (chunk + 1) * c
            rows = slice(i * c, (i + 1) * c)
            dq_i, dk_i, dv_i = ctx.kernel.backward(
                heads(d_out[rows]),
                heads(q[rows]),
                heads(k_all[:keys]),
                heads(v_all[:keys]),
                heads(out[rows]),
                lses[i],
                kernels.BOTTOM_RIGHT,
                ctx.scale,
            )
            dq[rows].copy_(dq_i.permute(2, 0, 1, 3))
            dk_all[:keys].add_(dk_i.permute(2, 0, 1, 3))
            dv_all[:keys].add_(dv_i.permute(2, 0, 1, 3))
        grads = []
        for g in (dk_all, dv_all):
            local = torch.empty_like(k)
            dist.reduce_scatter_tensor(local, _reorder(g, indices[1], size), group=group)
            grads.append(local)
        return dq, grads[0], grads[1], None, None, None


def _ring_exchange(t, group, size, rank):
    """One ring step: send ``t`` to rank r+1, receive rank r-1's (P2P, not kernels)."""
    recv = torch.empty_like(t)
    to, frm = (
        dist.get_global_rank(group, (rank + 1) % size),
        dist.get_global_rank(group, (rank - 1) % size),
    )
    for w in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, t, to, group), dist.P2POp(dist.irecv, recv, frm, group)]
    ):
        w.wait()
    return recv


def _ring_step_parts(step: int, rank: int, c: int):
    """(query rows, key rows of the block, alignment) of ring step ``step`` on rank ``rank``."""
    if step == 0:
        return slice(0, 2 * c), slice(0, 2 * c), kernels.TOP_LEFT
    if step <= rank:  # the block of an earlier rank: its first chunk, seen by both local chunks
        return slice(0, 2 * c), slice(0, c), kernels.NO_MASK
    return slice(c, 2 * c), slice(0, 2 * c), kernels.NO_MASK  # a later rank: the second chunk


class KVRingAttention(torch.autograd.Function):
    """TE's CP attention with ``cp_comm_type="p2p"`` (the ring; q, k, v as for
    :class:`KVAllGatherAttention`). Forward: the packed K/V passed N-1 steps around the ring
    (one P2P send and receive a step). Backward: the K/V around the ring again and the dK/dV
    buffer with it (two P2P exchanges a step, the dK/dV one home after the last)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, group, indices):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[0] // 2
        kv = torch.cat((k.unsqueeze(0), v.unsqueeze(0)), dim=0)
        kernel = _kernel(q, k)
        heads = kernels._heads_view
        block, parts, lse = kv, [], None
        for step in range(size):
            if step:
                block = _ring_exchange(block, group, size, rank)
            rows, keys, align = _ring_step_parts(step, rank, c)
            o, lse_i = kernel.forward(
                heads(q[rows]), heads(block[0][keys]), heads(block[1][keys]), align, scale
            )
            parts.append((rows, o, lse_i))
            if step == 0:
                lse = lse_i.clone()
            else:  # the fp32 log-sum-exp merge of this step
                part = lse[..., rows]
                torch.logaddexp(part, lse_i, out=part)
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        correct = out_correction_op()
        for rows, o, lse_i in parts:
            correct(heads(out[rows]), o, lse[..., rows], lse_i)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.scale, ctx.group, ctx.kernel = scale, group, kernel
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, kv, out, lse = ctx.saved_tensors
        group, heads = ctx.group, kernels._heads_view
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[0] // 2
        lse_late = lse[..., c:].contiguous()  # the second chunk's rows, for the steps i > r
        dq = torch.empty_like(q)
        block, dkv = kv, torch.empty_like(kv)
        for step in range(size):
            if step:
                block = _ring_exchange(block, group, size, rank)
                dkv = _ring_exchange(dkv, group, size, rank)
            rows, keys, align = _ring_step_parts(step, rank, c)
            dq_i, dk_i, dv_i = ctx.kernel.backward(
                heads(d_out[rows]),
                heads(q[rows]),
                heads(block[0][keys]),
                heads(block[1][keys]),
                heads(out[rows]),
                lse_late if rows.start else lse,
                align,
                ctx.scale,
            )
            grads = (dq_i, dk_i, dv_i)
            dests = (dq[rows], dkv[0][keys], dkv[1][keys])
            for dest, g in zip(dests, grads):
                g = g.permute(2, 0, 1, 3)
                if step == 0:
                    dest.copy_(g)
                else:
                    dest.add_(g)
        dkv = _ring_exchange(dkv, group, size, rank)  # home: every rank's share added
        return dq, dkv[0], dkv[1], None, None, None


def core_attention_class(ring: bool):
    """The ``core_attention`` of the fsdp_cp layer: TE's CP attention stood in (all-gather or
    ring), on Megatron's [s, b, n, d] tensors."""
    from megatron_tsp.tools.estimator.fake_run import FlashCoreAttention

    function = KVRingAttention if ring else KVAllGatherAttention

    class TECPAttention(FlashCoreAttention):
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
            if self.cp_group is None:
                raise ValueError("the fsdp_cp recording needs a CP group of N >= 2 ranks")
            size, rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
            if not hasattr(self, "_indices"):  # TE caches the reorder tables on the device
                self._indices = reorder_indices(size, rank, query.device)
            sq, b = query.shape[0], query.shape[1]
            out = function.apply(query, key, value, self.scale, self.cp_group, self._indices)
            return out.view(sq, b, -1)

    return TECPAttention


class LayerShards:
    """Megatron-FSDP's ZeRO-3 of one layer over ``group`` (N ranks): the rank's flat 1/N shard
    of the layer's parameters, the all-gather that unshards them (one collective, no kernel),
    and after the backward the gradients' copy into the reduce-scatter input (one kernel) and the
    reduce-scatter (one collective). The parameters themselves are the layer's (in a GPU run,
    views of the gathered buffer)."""

    def __init__(self, params, group):
        self.params, self.group = list(params), group
        self.size = dist.get_world_size(group)
        bad = [tuple(p.shape) for p in self.params if p.numel() % self.size]
        if bad:
            raise ValueError(
                f"fsdp_cp recording: parameters of shapes {bad} do not split into "
                f"{self.size} equal shards (--world-size {self.size})"
            )
        self.numel = sum(p.numel() for p in self.params)
        p0 = self.params[0]
        self.shard = torch.empty(self.numel // self.size, dtype=p0.dtype, device=p0.device)

    def unshard(self):
        full = torch.empty(self.numel, dtype=self.shard.dtype, device=self.shard.device)
        dist.all_gather_into_tensor(full, self.shard, group=self.group)
        return full

    def reduce_scatter(self, grads):
        n = self.size
        rs_in = torch.empty(n, self.numel // n, dtype=self.shard.dtype, device=self.shard.device)
        torch.cat([g.reshape(n, -1) for g in grads], dim=1, out=rs_in)
        out = torch.empty_like(self.shard)
        dist.reduce_scatter_tensor(out, rs_in.view(-1), group=self.group)
        return out

    def run(self, block, x, rope, grad):
        """The layer's forward and backward under ZeRO-3: unshard before each, the gradient
        reduce-scatter once every parameter's gradient is in."""

        def before_backward(_grad):
            self.unshard()

        # after the last parameter's gradient is accumulated (a post-accumulate hook holds no
        # reference to the incoming gradient: one that did would make autograd copy it)
        done = []

        def after_accumulate(param):
            done.append(param)
            if len(done) == len(self.params):
                self.reduce_scatter([p.grad for p in self.params])

        self.unshard()
        out = block(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
        out.register_hook(before_backward)
        handles = [p.register_post_accumulate_grad_hook(after_accumulate) for p in self.params]
        out.backward(grad)
        for h in handles:
            h.remove()
        if len(done) != len(self.params):
            raise RuntimeError("fsdp_cp recording: a parameter received no gradient")
