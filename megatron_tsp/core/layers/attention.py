"""TSP self-attention: weight shards are broadcast, K/V are all-gathered one head group at a time.

Rank p holds its tokens X_p ([s/D, b, h], zigzag chunks p and 2D-1-p) and the TP=D shard p of
the fused QKV projection (query groups p*g/D ..) and of the output projection (input columns).
Forward, for each head-group shard r = 0..D-1, software-pipelined one group ahead:

    owner r broadcasts (W_qkv_r, b_qkv_r, W_proj_r)   # shard r+1 is already in flight meanwhile
    q, k, v = X_p @ W_qkv_r^T  (+ RoPE at the tokens' true positions)
    post all-gather(k, v) of group r                  # before group r-1's attention
    K_r, V_r = wait(all-gather of group r)            # full sequence, this head group only
    ctx_p[:, heads of r] = causal_attention(q, K_r, V_r);  W_proj[:, columns of r] = W_proj_r
    then, once: Y_p = ctx_p @ W_proj^T                 # one GEMM over all heads: no all-reduce

Fewer key/value heads than ranks (``num_query_groups`` ng < D) keep megatron-core's TP layout:
the fused QKV weight ``[q.. k v | q.. k v | ..]`` (one block of np/ng query heads and one K/V head
per group) is cut into D row shards, so group j's block is exactly shards j*m .. j*m+m-1
(m = D/ng; the K/V rows sit in the last of them, not replicated), and TP rank s uses query heads
(s mod m) * np/D .. of group s // m with that group's K/V (Megatron all-gathers the QKV output
along its last dimension for this). TSP then runs the schedule above over the ng head groups
instead of D shards: step j broadcasts its m shards, projects the local tokens through the whole
group block, all-gathers the group's one K/V head once (not once per sharing shard) and projects
the np/ng heads' output through the m output-projection shards. The dK/dV of the group is the sum
over all its query heads, which is what Megatron's reduce-scatter (the all-gather's adjoint)
gives the K/V rows' owner at TP=D, and each shard's weight gradient is reduced onto its owner.

Causal masking is per local chunk: chunk c's queries see natural positions [0, (c+1)C). The
gathered K/V are read as they arrive, without a reorder pass (``TSPLayout.gathered_blocks``: the
late chunks in owner order, then the early chunks, then a local copy of this rank's late chunk):
each chunk is one bottom-right causal kernel call over a contiguous run of keys (a top-left
backend splits such a call into a prefix and its diagonal, merged by log-sum-exp in fp32; never
an S x S mask). The kernel without a log-sum-exp (``sdpa_recompute``) reads a natural-order copy.

Packed documents (``attention_mask`` a ``documents.DocumentMaskTensor`` / ``DocumentMask``, or
megatron-core's THD ``packed_seq_params``, b = 1): each chunk is cut at the document starts
(``DocumentMask.segments``) and each (chunk, document) segment is one bottom-right causal call
against the natural-order keys of its document up to its own end, on a natural-order copy of the
group's gathered K/V (one ``index_select`` per head group); every query row is in one segment,
so nothing is merged. The backward sums the segments' dK/dV in natural order (accumulation
dtype) and copies the sum onto the gathered layout, then reduce-scatters as below: the
communication is the same as for one document. One document per sample takes the causal path
above unchanged; THD rotates each token at its position within its document (Megatron's THD
RoPE); inference prefill and attention dropout with documents are refused by name.

Backward re-broadcasts the shards, re-gathers
each head group's K/V (group r+1's posted before group r's attention backward), reduce-scatters
dK/dV back to the token owners (waited one group later) and reduces each shard's weight gradient
onto its owner.
``attention_backward="saved"`` (default) keeps each head group's local qkv, output and
log-sum-exp (local-token sized, like TP+SP's saved activations) so the attention forward is not
recomputed; ``"recompute"`` (Megatron's ``--recompute-activations`` / selective ``core_attn``)
keeps only X_p and recomputes everything per head group (least memory; also used when attention
dropout is on, which needs the ``sdpa_recompute`` backend).

TSP x CP (``context_parallel_size`` C > 1). The weight shards still travel inside the TSP group
(D ranks); the K/V all-gather and the dK/dV reduce-scatter run over the sequence group instead,
megatron-core's tensor-and-context-parallel group of D*C ranks whose zigzag (2DC chunks) is
``TSPLayout(D*C, S, q, context_parallel_size=C)``. Every TSP group runs head group r at step r
(the shards are replicated over CP), so one all-gather over D*C ranks gives head group r's K/V
for all S tokens, and its adjoint sums each key's dK/dV over all D*C ranks' queries. Replicated
parameters' gradients are summed over TSP (Megatron's SP all-reduce) and CP (the data-parallel
reduction Megatron runs over DP x CP), as for TP+SP with CP.

The output projection is one GEMM over every head (the contraction over head groups happens
inside it, so no partial sums exist): its input, the D groups' attention outputs side by side,
and its weight, the D shards' columns copied as they arrive, are [s/D, b, h] and [h, h] bf16
buffers of the forward, where D fp32-accumulating GEMMs per chunk read and wrote an fp32 [s/D, b,
h] accumulator. The backward mirrors it: grad_x is one dgrad GEMM after the last head group, over
every group's QKV gradient side by side and every shard's QKV weight (copied as the shards pass),
so the contraction over head groups is again inside one GEMM, rounded once (in
``precision.activation_sum_dtype``; fp32 with ``HeadLayout.activation_sums_fp32``), where D
in-place GEMMs read and wrote grad_x once per group; the other partial sums (dK/dV over chunks,
weight gradients over ranks) are accumulated in ``accumulation_dtype`` (fp32 for bf16/fp16) and
cast once. The dK/dV sum over the D ranks travels in the compute dtype like TP+SP's activation
gradients (``kv_grad_reduce_in_fp32``: in the accumulation dtype).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_tsp.core import rejections
from megatron_tsp.core.batch_guard import check_attention_input
from megatron_tsp.core.comm import (
    WORKSPACE,
    FlatShard,
    Pending,
    current_labels,
    done,
    labelled,
    labelled_as,
    post_all_gather,
    post_all_to_all_sum,
    post_reduce_scatter,
    reduce_to,
    weight_bias_views,
)
from megatron_tsp.core.documents import DocumentMask, PackedBatchError, as_documents
from megatron_tsp.core.layers import kernels, kv_prefetch, row_sum_kernel
from megatron_tsp.core.layers.grads import weight_grad_output
from megatron_tsp.core.layers.head_groups import (
    GroupStream,
    HeadLayout,
    group_qkv_linear,
    pack_own_shard,
)
from megatron_tsp.core.layers.module_hooks import run_forward_pre_hooks
from megatron_tsp.core.layers.precision import (
    accumulation_dtype,
    activation_sum_dtype,
    matmul_acc,
    matmul_into,
)
from megatron_tsp.core.layers.prefill_attention import prefill_attention
from megatron_tsp.core.layers.rope import RopeTables, local_tables, rotate
from megatron_tsp.core.layout import TSPLayout
from megatron_tsp.core.parallel_state import resolve_group, resolve_sequence_group
from megatron_tsp.core.validation import check_model_shape


def _column_split(t: torch.Tensor, parts: int) -> list:
    """``t``'s last dimension cut into ``parts`` equal views (one per weight shard of a step)."""
    return list(t.chunk(parts, dim=-1)) if parts > 1 else [t]


def rotate_qkv(mixed, head_layout: HeadLayout, rope_q, rope_k, kv_out: torch.Tensor):
    """One head group's local qkv [s, b, ng/D, (np/ng + 2) * hn] into q [s, b, np/D, hn] (a new
    contiguous tensor) and the packed K/V send buffer ``kv_out`` [s, b, 2 * ng/D, hn] (K in the
    first ng/D heads, V in the rest), RoPE applied on the way (``rope.rotate`` writes straight into
    q and into K's slot of ``kv_out``: no rotated copies, no pack ``cat``). ``rope_*``: this
    rank's ``RopeTables`` or None. Returns q."""
    s, b, groups = mixed.shape[:3]
    per_group, hn = head_layout.heads // head_layout.groups, head_layout.head_dim
    heads5 = mixed.view(s, b, groups, per_group + 2, hn)
    q_in, k_in, v_in = heads5[:, :, :, :per_group], heads5[:, :, :, per_group], heads5[:, :, :, -1]
    if rope_q is None:
        q = q_in.reshape(s, b, head_layout.heads, hn)
    else:
        # [s, b * ng/D, np/ng, hn]: a 4-D [s, b, h, d] view of the strided q (fused kernels
        # take 4-D tensors), rotated into a contiguous [s, b, np/D, hn]
        q = rotate(q_in.reshape(s, b * groups, per_group, hn), rope_q).view(
            s, b, head_layout.heads, hn
        )
    if rope_k is None:
        torch.cat([k_in, v_in], dim=2, out=kv_out)
    else:
        rotate(k_in, rope_k, out=kv_out.narrow(2, 0, groups))
        kv_out.narrow(2, groups, groups).copy_(v_in)
    return q


def qkv_grad(dq, dk, dv, head_layout: HeadLayout, rope_q, rope_k, out=None) -> torch.Tensor:
    """Adjoint of ``rotate_qkv`` (its RoPE inverted analytically, ``rope.rotate(inverse=True)``):
    dq [s, b, np/D, hn], dk and dv [s, b, ng/D, hn] into the local qkv gradient
    [s, b, ng/D, (np/ng + 2) * hn] (``out``, possibly a strided slot of a wider tensor, or a new
    tensor), each written straight into its slot."""
    s, b = dq.shape[:2]
    groups, hn = dk.shape[2], head_layout.head_dim
    per_group = head_layout.heads // head_layout.groups
    d_mixed = out
    if d_mixed is None:
        shape = (s, b, groups, (per_group + 2) * hn)
        d_mixed = torch.empty(shape, dtype=dq.dtype, device=dq.device)
    heads5 = d_mixed.view(s, b, groups, per_group + 2, hn)
    # q's slot: [s, b, ng/D, np/ng, hn] (a strided slot of a wider row when ``out`` is given:
    # b and the groups cannot be merged into one dimension there)
    dq_in = dq.reshape(s, b, groups, per_group, hn)
    dq_out = heads5[:, :, :, :per_group]
    if rope_q is None:
        dq_out.copy_(dq_in)
    else:
        rotate(dq_in, rope_q, out=dq_out, inverse=True)
    if rope_k is None:
        heads5[:, :, :, per_group].copy_(dk)
    else:
        rotate(dk, rope_k, out=heads5[:, :, :, per_group], inverse=True)
    heads5[:, :, :, -1].copy_(dv)
    return d_mixed


def _rng_state(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


@contextlib.contextmanager
def _replay_rng(state, device: torch.device):
    """Run with the generator at ``state`` and leave the caller's generator untouched."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=True):
        if device.type == "cuda":
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
        yield


def kv_send_buffer(
    x: torch.Tensor, head_layout: HeadLayout, fresh: bool, slot: int
) -> torch.Tensor:
    """A packed local K/V buffer [s/D, b, 2 * ng/D, hn] for ``rotate_qkv`` to fill and
    ``_post_kv_gather`` to send: a new tensor when it is kept for the backward (``fresh``), else
    ``WORKSPACE`` slot ``slot`` (one per group in flight)."""
    shape = x.shape[:2] + (2 * head_layout.groups, head_layout.head_dim)
    if fresh:
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    return WORKSPACE.get("kv_send", slot, shape, x.dtype, x.device)


def _post_kv_gather(packed, group, layout: TSPLayout, slot: int) -> Pending:
    """Post the all-gather of a head group's packed K/V [s/D, b, 2 * ng/D, hn] (``rotate_qkv``'s
    ``kv_out``: this rank's early chunk, then its late chunk); ``wait()`` returns (K, V)
    [S + C, b, ng/D, hn], views of ``WORKSPACE`` slot ``slot`` in the gathered layout of
    ``TSPLayout.gathered_blocks``: ``[late chunks in owner order | early chunks | own late
    chunk]``.

    Two all-gathers, one per zigzag half, each straight into its half: rank q's late chunk
    (chunk 2D-1-q) lands in row block q of the first half, its early chunk (chunk q) in row block
    q of the second, which is natural order; this rank's late chunk is also copied after them
    (1/(2D) of the buffer), so that its causal diagonal follows the keys it sees. No reorder
    pass, and each chunk's attention is one kernel call. One buffer per slot: group r+2's
    gather into group r's slot is posted after group r's attention is queued."""
    groups = packed.shape[2] // 2
    if layout.group_size == 1:
        return done((packed.narrow(2, 0, groups), packed.narrow(2, groups, groups)))
    chunk = packed.shape[0] // 2
    halves = (packed.narrow(0, chunk, chunk), packed.narrow(0, 0, chunk))  # late, then early

    def views(kv):
        return kv.narrow(2, 0, groups), kv.narrow(2, groups, groups)

    return post_all_gather(
        halves, group, slot=slot, purpose="kv_gathered", finish=views, tail=halves[0]
    )


def _natural_kv(k_all, v_all, layout: TSPLayout):
    """Natural-order copies of the gathered K and V, for the kernel without a log-sum-exp
    (``sdpa_recompute``: its blocks cannot be merged, so they run on natural-order keys)."""
    if layout.group_size == 1:
        return k_all, v_all
    index = layout.gathered_index(k_all.device)
    return k_all.index_select(0, index), v_all.index_select(0, index)


class _KVGradScatter:
    """Adjoint of ``_post_kv_gather`` for one head group: the attention blocks' dK and dV
    (``(first row, layout.KeyRows)`` sources in the gathered layout: one tensor, or a top-left
    kernel's prefix and diagonal parts) are summed straight into a ``WORKSPACE`` send buffer
    [S, b, 2 * ng/D, hn] in that layout (``TSPLayout.key_pieces``, summed by
    ``row_sum_kernel.sum_pieces``: one launch for dK and one for dV on CUDA, no full-sequence
    accumulator, no reorder pass) at construction; ``post()`` posts one reduce-scatter per
    half (the late half's row block q is rank q's late chunk, the early half's its early
    chunk), ``wait()`` (posting first if needed) returns this rank's [s/D, b, 2 * ng/D, hn]
    sum over the group in ``dtype``, early chunk first. Building and posting are apart so the
    layer can queue the next head group's work before the reduce-scatter (see
    ``_AttentionBackward``).

    ``wire_dtype``: the send buffer's dtype. The sum over the chunks is always computed in fp32
    (or wider) and rounded once into the buffer. By default the buffer has the compute dtype, as
    TP+SP's activation-gradient reduce-scatters over the same D ranks: in bf16 the reduce-scatter
    moves 2 bytes per element (the largest backward transfer; 4 would raise TSP's bytes per step
    at 7B/128k/D=8 from 0.72x to 0.95x TP+SP's) and the D partials are summed by the collective
    in bf16. ``HeadLayout.kv_grad_fp32`` sends the accumulation dtype instead: the D ranks' sum
    stays unrounded until the owner casts it once (docs/precision.md has both settings'
    gradient errors against TP+SP's).

    ``sum_dtype`` (``HeadLayout.kv_grad_all_to_all``): an all-to-all instead of the
    reduce-scatter (``comm.post_all_to_all_sum``): the same bytes, the group's partials added in
    ``sum_dtype`` at the owner, so one rounding however many ranks the sequence group has; the
    receive buffer is the size of the send buffer."""

    def __init__(
        self,
        dks,
        dvs,
        wire_dtype,
        dtype,
        group,
        layout: TSPLayout,
        slot: int,
        sum_dtype: Optional[torch.dtype] = None,
        natural: Optional[torch.Tensor] = None,
    ):
        self.dtype, self.group, self.slot, self.pending = dtype, group, slot, None
        self.sum_dtype = sum_dtype
        if natural is not None:  # packed documents: dK/dV already summed, natural key order
            first = natural
            _, b, two_groups, dim = natural.shape
            groups = two_groups // 2
        else:
            rows = dks[0][1]  # (first row, layout.KeyRows)
            first = rows if isinstance(rows, torch.Tensor) else rows[0]
            _, b, groups, dim = first.shape
        shape, device = (layout.seq_length, b, 2 * groups, dim), first.device
        if layout.group_size == 1:
            self.send = torch.empty(shape, dtype=wire_dtype, device=device)
        else:
            self.send = WORKSPACE.get("kv_grad_send", slot, shape, wire_dtype, device)
        if natural is not None:
            # natural position p -> gathered row gathered_index[p]: one rounding to the wire
            index = layout.gathered_index(device)
            self.send.index_copy_(0, index, natural.to(wire_dtype))
        else:
            k_half, v_half = self.send.narrow(2, 0, groups), self.send.narrow(2, groups, groups)
            for dest, sources in ((k_half, dks), (v_half, dvs)):  # one launch each on CUDA
                row_sum_kernel.sum_pieces(dest, layout.key_pieces(dest.shape[0], sources))
        if layout.group_size == 1:
            self.pending = done(self.send)

    def post(self) -> None:
        if self.pending is not None:
            return
        half = self.send.shape[0] // 2
        # early half first: the owner's rows are [early chunk, late chunk]
        halves = (self.send.narrow(0, half, half), self.send.narrow(0, 0, half))
        if self.sum_dtype is not None:
            self.pending = post_all_to_all_sum(
                halves, self.group, self.sum_dtype, slot=self.slot, purpose="kv_grad"
            )
        else:
            self.pending = post_reduce_scatter(
                halves, self.group, slot=self.slot, purpose="kv_grad"
            )

    def wait(self) -> torch.Tensor:
        self.post()
        return self.pending.wait().to(self.dtype)


def _save_layout(n_blocks: int) -> int:
    """Tensors saved per head group in saved mode: its rotated q, its packed K/V send buffer
    (the backward re-sends it as is), then per causal block its output rows and log-sum-exp."""
    return 2 + 2 * n_blocks


class _TSPAttentionFunction(torch.autograd.Function):
    """TSP causal self-attention (output projection included, its bias excluded).

    Communication. Forward, per head group r (a step: one shard, or ``shards_per_group`` shards
    when ng < D, each broadcast from its owner): broadcast of shard r's weights from its owner
    (shard r+1 posted before shard r is used), one all-gather of group r's packed K/V, posted
    right after group r's QKV GEMM and waited after group r-1's attention (software pipeline:
    QKV(r+1) and its gather are issued before attention(r)); the output projection is one GEMM
    after the last group, with no communication (its shards came with the broadcasts). Backward: the
    broadcasts again, the K/V re-gather of group r+1 posted before group r's attention backward,
    one reduce-scatter of group r's packed dK/dV posted once group r+1's first attention-backward
    block is queued (the last group's right after its own attention backward) and waited one
    group later, and one reduce of group r's weight gradient (fp32 for bf16/fp16 models) onto its
    owner, posted before the next reduce-scatter and waited when the next one is posted.

    Saved tensors (``save_for_backward``, so saved-tensor hooks and activation offloading see
    them): the input, the local weight shards, the RoPE tables (shared by every layer of the step,
    ``rope.local_tables``) and, in "saved" mode, per head group its rotated q and packed local K/V
    (together the size of the local qkv) and per chunk the attention output rows and fp32
    log-sum-exp (the output is saved once). "recompute" mode saves only the first group.
    RoPE is never differentiated by autograd: the backward applies its inverse rotation
    (``rope.rotate(inverse=True)``).
    """

    @staticmethod
    def forward(
        ctx,
        x,
        qkv_w,
        qkv_b,
        proj_w,
        rope_q,
        rope_k,
        head_layout,
        layout,
        group,
        accumulate_into_main_grad,
        kernel,
        seq_group,
        documents=None,
    ):
        size = layout.weight_group_size
        has_bias = qkv_b is not None
        blocks = layout.gathered_blocks
        save_outputs = (
            head_layout.backward == "saved" and kernel.has_lse and head_layout.dropout_p == 0
        )
        rng = _rng_state(x.device) if head_layout.dropout_p > 0 else None
        own = pack_own_shard(qkv_w, qkv_b, proj_w)
        # the output projection's operands, filled group by group (see the module docstring)
        cols = proj_w.shape[1]
        context = torch.empty(x.shape[:2] + (size * cols,), dtype=x.dtype, device=x.device)
        proj_full = torch.empty(
            (proj_w.shape[0], size * cols), dtype=proj_w.dtype, device=proj_w.device
        )
        saved = []

        m = head_layout.shards_per_group
        steps = size // m

        def prepare(r):
            shards = stream.get(r)
            mixed = group_qkv_linear(x, shards, has_bias, head_layout)
            kv = kv_send_buffer(x, head_layout, fresh=save_outputs, slot=r % 2)
            q = rotate_qkv(mixed, head_layout, rope_q, rope_k, kv)
            pws = [weight_bias_views(shard.views(), has_bias)[2] for shard in shards]
            return q, kv, pws, _post_kv_gather(kv, seq_group, layout, slot=r % 2)

        with labelled("tsp_attention"):
            stream = GroupStream(own, group, m, hold=2)
            current = prepare(0)
            for r in range(steps):
                upcoming = prepare(r + 1) if r + 1 < steps else None
                q, kv, pws, gather = current
                for i, pw in enumerate(pws):  # shard r*m+i's columns of the projection
                    proj_full.narrow(1, (r * m + i) * cols, cols).copy_(pw)
                k_all, v_all = gather.wait()
                if documents is not None:
                    outs, lses = _document_forward(
                        kernel, q, k_all, v_all, layout, documents, head_layout
                    )
                elif kernel.has_lse:
                    outs, lses = kernels.zigzag_forward(
                        kernel, q, k_all, v_all, blocks, head_layout.softmax_scale
                    )
                else:
                    rows = kernels.zigzag_attend(
                        kernel,
                        q,
                        *_natural_kv(k_all, v_all, layout),
                        layout.causal_blocks,
                        head_layout.softmax_scale,
                        head_layout.dropout_p,
                    )
                    outs, lses = _block_rows(rows, blocks), []
                del k_all, v_all
                heads_r = context.narrow(2, r * m * cols, m * cols)  # the step's heads
                for block, rows in zip(blocks, outs):
                    heads_r.narrow(0, block.query_start, block.query_len).copy_(rows)
                if save_outputs:
                    saved += [q, kv, *outs, *lses]
                current = upcoming
        ctx.rope = _save_rope(ctx, rope_q, rope_k)
        ctx.save_for_backward(x, qkv_w, qkv_b, proj_w, *ctx.rope_saved, *saved)
        ctx.head_layout, ctx.group, ctx.rng, ctx.kernel = head_layout, group, rng, kernel
        ctx.accumulate_into_main_grad = accumulate_into_main_grad
        ctx.layout, ctx.seq_group, ctx.documents = layout, seq_group, documents
        # group 0's backward K/V re-gather is posted by the MLP backward that runs before this
        # one (``kv_prefetch``); saved mode only (recompute mode needs shard 0's QKV GEMM first)
        ctx.kv_handoff = _first_regather(ctx, group) if save_outputs else None
        kv_prefetch.arm(ctx.kv_handoff)
        # [s/D, b, h] in the model dtype (the GEMM accumulates in fp32 internally)
        return torch.matmul(context, proj_full.t())

    @staticmethod
    def backward(ctx, grad_out):
        x, qkv_w, qkv_b, proj_w = ctx.saved_tensors[:4]
        grad_x, own_grad = _AttentionBackward(ctx, grad_out.contiguous()).run()
        g_w, g_b, g_pw = weight_bias_views(own_grad.views(), qkv_b is not None)
        accumulate = ctx.accumulate_into_main_grad
        return (
            grad_x,
            weight_grad_output(qkv_w, g_w, accumulate),
            weight_grad_output(qkv_b, g_b, accumulate),
            weight_grad_output(proj_w, g_pw, accumulate),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def _document_forward(kernel, q, k_all, v_all, layout: TSPLayout, documents, head_layout):
    """Packed documents' attention of one head group (``documents``: the micro-batch's
    ``SampleSegments`` plans): the gathered K/V copied once into natural order, then one
    bottom-right causal call per (chunk, document) segment. Returns per-chunk ``(outs, lses)``
    as ``zigzag_forward`` does (empty ``lses`` for a kernel without a log-sum-exp)."""
    k_nat, v_nat = _natural_kv(k_all, v_all, layout)
    blocks = layout.gathered_blocks
    if kernel.has_lse:
        return kernels.document_forward(
            kernel, q, k_nat, v_nat, documents, head_layout.softmax_scale, blocks
        )
    rows = kernels.document_attend(
        kernel, q, k_nat, v_nat, documents, head_layout.softmax_scale, head_layout.dropout_p
    )
    return _block_rows(rows, blocks), []


def _first_regather(ctx, group) -> kv_prefetch.Handoff:
    """Group 0's backward K/V re-gather as a ``kv_prefetch.Handoff``: the saved packed K/V of
    group 0 all-gathered into its ``WORKSPACE`` slot, exactly as ``prepare_group(0)`` posts it
    (read from the saved tensors when posted; the context is held weakly)."""
    context = weakref.ref(ctx)
    # posted from the MLP backward, it is still this attention's traffic: its label context
    labels = current_labels() + ("tsp_attention",)

    def post() -> Optional[Pending]:
        saved = context()
        if saved is None:  # its graph is gone: no backward will read the gather
            return None
        _, _, flat = _saved_rope(saved, saved.saved_tensors[4:])
        with labelled_as(labels):
            return _post_kv_gather(flat[1], saved.seq_group, saved.layout, slot=0)

    return kv_prefetch.Handoff(post, group)


def _save_rope(ctx, rope_q: Optional[RopeTables], rope_k: Optional[RopeTables]):
    """The RoPE tables' tensors go through ``save_for_backward`` (``ctx.rope_saved``); returns
    what rebuilds the tables from the saved tensors (``_saved_rope``): per table, the table
    without its tensors and their count (None for no RoPE)."""
    ctx.rope_saved, kept = [], []
    for tables in (rope_q, rope_k):
        if tables is None:
            kept.append(None)
            continue
        ctx.rope_saved += list(tables.tensors)
        kept.append((tables.with_tensors(()), len(tables.tensors)))
    return kept


def _saved_rope(ctx, saved):
    """``(rope_q, rope_k, rest)``: the tables rebuilt from ``saved`` (the tensors after the
    weights), and the saved tensors that follow them."""
    rebuilt, pos = [], 0
    for kept in ctx.rope:
        if kept is None:
            rebuilt.append(None)
            continue
        tables, n = kept
        rebuilt.append(tables.with_tensors(saved[pos : pos + n]))
        pos += n
    return rebuilt[0], rebuilt[1], list(saved[pos:])


def _block_rows(rows: torch.Tensor, blocks) -> list:
    """Per causal block, its rows of a [local tokens, ...] tensor (views)."""
    return [rows.narrow(0, block.query_start, block.query_len) for block in blocks]


@dataclass
class _HeadGroup:
    """One head group's tensors while they move through the backward pipeline."""

    r: int  # head group index = weight shard index = the shard owner's rank
    q: torch.Tensor  # local rotated queries [s/D, b, np/D, hn]
    gather: Pending  # the all-gather of this group's K/V
    outs: Optional[list] = None  # per causal block: its attention output rows
    lses: Optional[list] = None  # per causal block: its log-sum-exp (kernels that have one)
    dq: Optional[torch.Tensor] = None  # set by the attention backward, with partial and scatter
    partial: Optional[list] = None  # this rank's part of the weight gradient of step r's shards
    scatter: Optional[_KVGradScatter] = None  # this group's dK/dV, its reduce-scatter


class _AttentionBackward:
    """Backward of ``_TSPAttentionFunction``, software-pipelined over the D head groups. Each
    step r of ``run`` does, in this order:

    1. (saved mode) ``output_projection_wgrad`` of group r from its saved output (needs no
       weights, so it runs while shard r's broadcast may still be in flight);
    2. ``context_grad``: wait shard r; d_ctx = dY @ W_proj_r;
    3. ``prepare_group(r + 1)``: its local q/k/v (saved qkv, or the QKV GEMM in recompute mode)
       and the post of its K/V re-gather;
    4. ``attention_backward`` of group r: wait its K/V; attention backward (recompute mode: the
       kernel's forward first) with dK/dV summed over the chunks in fp32 into its send buffer;
       group r-1's dK/dV reduce-scatter is posted once group r's first block is queued (the last
       group's own reduce-scatter right after its attention backward);
    5. ``finish_group(r - 1)``: wait its reduce-scatter, one dgrad onto grad_x and one
       wgrad into its fp32 partial, post its reduce onto the owner.

    Queue order. Megatron-LM's scripts set ``CUDA_DEVICE_MAX_CONNECTIONS=1``: every stream feeds
    one FIFO hardware queue in launch order, and collectives of one communicator run one after
    another, so a transfer launched while another is still running waits for it and holds every
    kernel launched after it. The dK/dV reduce-scatter is the large transfer here (its bytes are
    a K/V gather's, summed); it is posted only after the transfers of the next head group
    (shard r+1's broadcast, group r+1's K/V gather) and the previous group's small weight-
    gradient reduce, and with an attention backward block already queued in front of it, so the
    flash backward that follows it covers it before the next post. Pinned by
    ``tests/test_overlap.py::test_attention_queue_order``.

    Weight shards come from a ``GroupStream`` (shard r+1's broadcast posted when shard r is
    waited); at most two consecutive head groups' shards are read at once in saved mode (r in
    step 2, r-1 in step 5), three in recompute mode (also r+1 in step 3), which sets its ``hold``.
    A head group is one shard, or ``shards_per_group`` when ng < D; its weight gradient is one
    partial per shard, each reduced onto that shard's owner.
    """

    def __init__(self, ctx, grad_out):
        x, qkv_w, qkv_b, proj_w, *rest = ctx.saved_tensors
        self.rope_q, self.rope_k, flat = _saved_rope(ctx, rest)
        self.x, self.flat = x, flat
        self.grad_out, self.rng = grad_out, ctx.rng
        self.head_layout, self.layout = ctx.head_layout, ctx.layout
        self.group, self.seq_group, self.kernel = ctx.group, ctx.seq_group, ctx.kernel
        self.documents = ctx.documents  # SampleSegments plans of packed documents, or None
        self.blocks = self.layout.gathered_blocks
        self.hidden = x.shape[-1]
        self.has_bias, self.dtype = qkv_b is not None, x.dtype
        self.acc_dtype = accumulation_dtype(self.dtype)
        self.wire_dtype = self.acc_dtype if self.head_layout.kv_grad_fp32 else self.dtype
        self.saved_mode = bool(flat)  # the forward saved per head group: qkv, outputs, lse
        self.reducer = _OwnerReduce(self.group)
        self.tokens_x = x.reshape(-1, self.hidden)
        self.own = pack_own_shard(qkv_w, qkv_b, proj_w)
        # grad_x is one dgrad GEMM after the last group: every group's QKV gradient side by
        # side (``d_qkv``, [tokens, QKV rows of all D shards]) times the QKV weight of every
        # shard (``qkv_weight``, its rows copied from the shards as they pass), in shard order
        self.grad_x_dtype = activation_sum_dtype(self.dtype, self.head_layout.activation_sums_fp32)
        self.qkv_rows = qkv_w.shape[0]  # QKV rows of one shard
        all_rows = self.layout.weight_group_size * self.qkv_rows
        self.d_qkv = x.new_empty((self.tokens_x.shape[0], all_rows))
        self.qkv_weight = qkv_w.new_empty((all_rows, self.hidden))
        self.dy_rows = [
            rows.reshape(-1, self.hidden) for rows in _block_rows(grad_out, self.blocks)
        ]
        self.m = self.head_layout.shards_per_group
        self.kv_handoff = ctx.kv_handoff  # group 0's re-gather, if the MLP backward posted it
        self.shards = {}  # the weight shards being read: r -> [FlatShard] (at most r-1 .. r+1)
        self.stream = None

    def run(self):
        """The pipeline; returns (grad_x in the input dtype, this rank's summed weight-gradient
        shard)."""
        rng_ctx = (
            _replay_rng(self.rng, self.x.device)
            if self.rng is not None
            else contextlib.nullcontext()
        )  # attention dropout: the recomputed forward draws the forward's masks
        with labelled("tsp_attention"), rng_ctx:
            hold = 2 if self.saved_mode else 3
            self.stream = GroupStream(self.own, self.group, self.m, hold=hold)  # posts shard 0
            current, finishing = self.prepare_group(0), None
            size = self.layout.weight_group_size // self.m
            for r in range(size):
                # every element is written before it is read (``output_projection_wgrad``,
                # ``finish_group``): no zeroing pass
                partial = [
                    FlatShard(self.own.shapes, self.acc_dtype, self.x.device) for _ in range(self.m)
                ]
                g_pw = [weight_bias_views(p.views(), self.has_bias)[2] for p in partial]
                if self.saved_mode:
                    self.output_projection_wgrad(current, g_pw)
                d_ctx = self.context_grad(r)
                upcoming = self.prepare_group(r + 1) if r + 1 < size else None
                # group r-1's reduce-scatter goes out behind group r's first attention block
                post_previous = finishing.scatter.post if finishing is not None else None
                self.attention_backward(current, d_ctx, partial, g_pw, post_previous)
                if upcoming is None:  # the last group: nothing left to queue in front of it
                    current.scatter.post()
                if finishing is not None:
                    self.finish_group(finishing)
                finishing, current = current, upcoming
            self.finish_group(finishing)
            grad_x = matmul_acc(self.d_qkv, self.qkv_weight, dtype=self.grad_x_dtype)
            return grad_x.to(self.dtype).view(self.x.shape), self.reducer.finish()

    def prepare_group(self, r: int) -> _HeadGroup:
        """Group r's rotated q and packed K/V (saved by the forward, or recomputed with shard r's
        QKV weight: waits shard r's broadcast in recompute mode) and the post of its K/V
        all-gather (group 0's: the one the MLP backward posted, ``kv_prefetch``, if it did)."""
        outs = lses = None
        if self.saved_mode:
            per_group, n_blocks = _save_layout(len(self.blocks)), len(self.blocks)
            base = r * per_group
            q, kv = self.flat[base], self.flat[base + 1]
            outs = self.flat[base + 2 : base + 2 + n_blocks]
            lses = self.flat[base + 2 + n_blocks : base + per_group]
        else:
            mixed = group_qkv_linear(self.x, self.stream.get(r), self.has_bias, self.head_layout)
            kv = kv_send_buffer(self.x, self.head_layout, fresh=False, slot=r % 2)
            q = rotate_qkv(mixed, self.head_layout, self.rope_q, self.rope_k, kv)
        gather = self.kv_handoff.take() if r == 0 and self.kv_handoff is not None else None
        if gather is None:
            gather = _post_kv_gather(kv, self.seq_group, self.layout, slot=r % 2)
        return _HeadGroup(r, q, gather, outs=outs, lses=lses)

    def output_projection_wgrad(self, group: _HeadGroup, g_pw: list) -> None:
        """g_pw[i] = dY^T @ attention output of ``group`` (shard i's heads), block by block: the
        first block writes the partial (its buffer is not zeroed), the others add onto it. No
        communication."""
        for k, (dy_rows, rows) in enumerate(zip(self.dy_rows, group.outs)):
            for part, g in zip(_column_split(rows, self.m), g_pw):
                a, b = dy_rows.t(), part.reshape(-1, part.shape[-1])
                if k:
                    matmul_acc(a, b, acc=g)
                else:
                    matmul_into(a, b, g)

    def context_grad(self, r: int) -> torch.Tensor:
        """d_ctx = dY @ W_proj_r: waits group r's shards (``ShardStream.get`` posts the next
        shard first). Group r-1 stays readable for ``finish_group``; group r-2 is let go."""
        self.shards[r] = self.stream.get(r)
        self.shards.pop(r - 2, None)
        pws = [weight_bias_views(s.views(), self.has_bias)[2] for s in self.shards[r]]
        if len(pws) == 1:
            return torch.matmul(self.grad_out, pws[0])
        return torch.cat([torch.matmul(self.grad_out, pw) for pw in pws], dim=-1)

    def attention_backward(
        self, group: _HeadGroup, d_ctx, partial: list, g_pw, post_previous=None
    ) -> None:
        """Waits ``group``'s K/V all-gather, runs the attention backward (in recompute mode also
        the output-projection wgrad, from the recomputed output) and puts its dK/dV in its send
        buffer (not yet posted); ``post_previous`` (the previous group's reduce-scatter post) is
        called once the first attention block is queued. ``group`` then holds dq, its
        weight-gradient ``partial`` and its dK/dV scatter. Everything else made here (the
        full-sequence K/V views, the recomputed outputs) is dropped on return, before
        ``finish_group(r - 1)``."""
        k_all, v_all = group.gather.wait()
        q = group.q
        post = post_previous if post_previous is not None else (lambda: None)
        natural = None
        if self.kernel.has_lse and self.documents is not None:
            dq, natural = self._document_backward(group, q, k_all, v_all, d_ctx, g_pw, post)
            dks = dvs = None
        elif self.kernel.has_lse:
            dq, dks, dvs = self._kernel_backward(group, q, k_all, v_all, d_ctx, g_pw, post)
        else:
            dq, dks, dvs = self._autograd_backward(group, q, k_all, v_all, d_ctx, g_pw, post)
        scatter = _KVGradScatter(
            dks,
            dvs,
            self.wire_dtype,
            self.dtype,
            self.seq_group,
            self.layout,
            slot=group.r % 2,
            sum_dtype=self.acc_dtype if self.head_layout.kv_grad_all_to_all else None,
            natural=natural,
        )
        group.dq, group.partial, group.scatter = dq, partial, scatter
        group.outs = group.lses = None  # the outputs are no longer needed

    def _kernel_backward(self, group: _HeadGroup, q, k_all, v_all, d_ctx, g_pw, post):
        """(dq, dK sources, dV sources) from a kernel with a log-sum-exp: its backward on the
        saved (or, in recompute mode, just recomputed) outputs, block by block of the
        gathered K/V (``kernels.zigzag_backward_sources``)."""
        if not self.saved_mode:
            group.outs, group.lses = kernels.zigzag_forward(
                self.kernel, q, k_all, v_all, self.blocks, self.head_layout.softmax_scale
            )
            self.output_projection_wgrad(group, g_pw)
        return kernels.zigzag_backward_sources(
            self.kernel,
            d_ctx,
            q,
            k_all,
            v_all,
            self.blocks,
            self.head_layout.softmax_scale,
            group.outs,
            group.lses,
            after_first_block=post,
        )

    def _document_backward(self, group: _HeadGroup, q, k_all, v_all, d_ctx, g_pw, post):
        """Packed documents, a kernel with a log-sum-exp: ``(dq, dK/dV in natural order)``.
        The gathered K/V are copied once into natural order (as in the forward); in recompute
        mode the segments' forward runs first (and the output-projection wgrad from it); then
        one backward call per segment, dK/dV summed over the segments in the accumulation dtype
        (``kernels.document_backward``), which ``_KVGradScatter`` maps onto the gathered
        layout."""
        k_nat, v_nat = _natural_kv(k_all, v_all, self.layout)
        scale = self.head_layout.softmax_scale
        if not self.saved_mode:
            group.outs, group.lses = kernels.document_forward(
                self.kernel, q, k_nat, v_nat, self.documents, scale, self.blocks
            )
            self.output_projection_wgrad(group, g_pw)
        return kernels.document_backward(
            self.kernel,
            d_ctx,
            q,
            k_nat,
            v_nat,
            self.documents,
            scale,
            group.outs,
            group.lses,
            self.blocks,
            after_first_block=post,
        )

    def _autograd_backward(self, group: _HeadGroup, q, k_all, v_all, d_ctx, g_pw, post):
        """(dq, dK sources, dV sources) from a kernel without a log-sum-exp (``sdpa_recompute``,
        never in saved mode): its forward recomputed under autograd on natural-order copies of
        the gathered K/V (the RNG replays the forward's dropout; autograd takes the gradients
        back through the copy, to the gathered layout), then the output-projection wgrad from
        that output. ``post`` is called between the recomputed forward and its backward."""
        with torch.enable_grad():
            inputs = [
                q.requires_grad_(True),
                k_all.detach().requires_grad_(True),
                v_all.detach().requires_grad_(True),
            ]
            if self.documents is not None:
                rows = kernels.document_attend(
                    self.kernel,
                    q,
                    *_natural_kv(inputs[1], inputs[2], self.layout),
                    self.documents,
                    self.head_layout.softmax_scale,
                    self.head_layout.dropout_p,
                )
            else:
                rows = kernels.zigzag_attend(
                    self.kernel,
                    q,
                    *_natural_kv(inputs[1], inputs[2], self.layout),
                    self.layout.causal_blocks,
                    self.head_layout.softmax_scale,
                    self.head_layout.dropout_p,
                )
            post()
            dq, dk, dv = torch.autograd.grad(rows, inputs, d_ctx)
        group.outs = _block_rows(rows.detach(), self.blocks)
        self.output_projection_wgrad(group, g_pw)
        return dq, [(0, dk)], [(0, dv)]

    def finish_group(self, group: _HeadGroup) -> None:
        """Waits ``group``'s dK/dV reduce-scatter, writes its QKV gradient into its columns of
        ``d_qkv`` and its shards' QKV weights into their rows of ``qkv_weight`` (for the one dgrad
        GEMM after the last group), runs the wgrad of its QKV projection (into its partial) and
        posts the reduce of that partial onto the shard's owner (``_OwnerReduce`` waits the
        previous reduce first)."""
        d_kv = group.scatter.wait()  # the sum over ranks, in the input dtype
        groups = d_kv.shape[2] // 2
        dk, dv = d_kv.narrow(2, 0, groups), d_kv.narrow(2, groups, groups)
        rows = self.qkv_rows
        d_all = self.d_qkv.narrow(1, group.r * self.m * rows, self.m * rows)
        s, b = group.dq.shape[:2]
        slot = d_all.view(s, b, groups, -1)
        qkv_grad(group.dq, dk, dv, self.head_layout, self.rope_q, self.rope_k, out=slot)
        for i, (shard, partial) in enumerate(zip(self.shards[group.r], group.partial)):
            w, _, _ = weight_bias_views(shard.views(), self.has_bias)
            self.qkv_weight.narrow(0, (group.r * self.m + i) * rows, rows).copy_(w)
            d_rows = _column_split(d_all, self.m)[i]  # the QKV rows of shard i of the group
            g_w, g_b, _ = weight_bias_views(partial.views(), self.has_bias)
            matmul_into(d_rows.t(), self.tokens_x, g_w)  # the partial's only QKV term
            if self.has_bias:
                torch.sum(d_rows, dim=0, dtype=self.acc_dtype, out=g_b)
            self.reducer.submit(group.r * self.m + i, partial)


class _OwnerReduce:
    """Reduce each shard's partial weight gradient (accumulation dtype) onto its owner, one
    reduce in flight; the owner's buffer ends up holding the group's sum."""

    def __init__(self, group):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.pending, self.own = None, None

    def submit(self, owner: int, partial: FlatShard) -> None:
        if self.pending is not None:
            self.pending.wait()
        self.pending = reduce_to(partial.buffer, owner, self.group) if self.size > 1 else None
        if owner == self.rank:
            self.own = partial

    def finish(self) -> FlatShard:
        if self.pending is not None:
            self.pending.wait()
        return self.own


def tsp_self_attention(
    x,
    qkv_weight,
    qkv_bias,
    proj_weight,
    head_layout: HeadLayout,
    group,
    rope_q: Optional[RopeTables] = None,
    rope_k: Optional[RopeTables] = None,
    accumulate_into_main_grad: bool = False,
    kernel: Optional[kernels.AttentionKernel] = None,
    layout: Optional[TSPLayout] = None,
    seq_group=None,
    documents: Optional[DocumentMask] = None,
):
    """Causal self-attention of this rank's zigzag tokens under TSP (output projection included,
    its bias excluded). ``documents``: the micro-batch's packed documents (``DocumentMask``
    over the whole sequence, natural positions); None or a single document per sample is
    plain causal attention, today's path unchanged. ``rope_*``: this rank's RoPE tables for q
    and k (``rope.local_tables``), or None. ``kernel``: the attention backend
    (``kernels.select_kernel`` for ``x`` when None). ``group``: the TSP (weight) group.
    ``seq_group``: the sequence group (TSP x CP: the D*C tensor-and-context-parallel group;
    ``group`` when None). ``layout``: this rank's zigzag layout over ``seq_group`` (built from
    the groups and the local token count when None)."""
    if kernel is None:
        kernel = kernels.select_kernel(
            x.device,
            x.dtype,
            head_layout.head_dim,
            head_layout.heads != head_layout.groups,
            head_layout.dropout_p,
        )
    if seq_group is None:
        seq_group = group
    if layout is None:
        seq_size, d = dist.get_world_size(seq_group), dist.get_world_size(group)
        layout = TSPLayout.of_groups(group, seq_group, x.shape[0] * seq_size, seq_size // d)
    elif layout.local_len != x.shape[0]:
        raise ValueError(
            f"TSP attention got {x.shape[0]} local tokens but its layout holds "
            f"{layout.local_len} per rank ({layout})"
        )
    plans = document_plans(documents, layout, x.shape[1])
    if plans is not None and head_layout.dropout_p > 0:
        raise ValueError(
            "TSP attention with packed documents does not support attention dropout "
            f"(--attention-dropout={head_layout.dropout_p}); set it to 0"
        )
    return _TSPAttentionFunction.apply(
        x,
        qkv_weight,
        qkv_bias,
        proj_weight,
        rope_q,
        rope_k,
        head_layout,
        layout,
        group,
        accumulate_into_main_grad,
        kernel,
        seq_group,
        plans,
    )


def document_plans(documents: Optional[DocumentMask], layout: TSPLayout, batch_size: int):
    """This rank's ``SampleSegments`` plans for ``documents`` (None: plain causal attention,
    also for a single document per sample, which takes the causal path bit for bit)."""
    if documents is None or documents.is_single_document:
        return None
    if documents.seq_length != layout.seq_length:
        raise PackedBatchError(
            f"TSP attention got documents over {documents.seq_length} positions for a sequence "
            f"of {layout.seq_length} tokens ({layout})"
        )
    return documents.segments(layout.natural_runs, batch_size)


def attention_backward_from_config(config, requested: Optional[str] = None) -> str:
    """TSP's attention mode from Megatron's recompute options: ``--recompute-activations`` /
    ``--recompute-granularity selective`` with ``core_attn`` among ``--recompute-modules`` means
    "recompute" (the attention forward is recomputed in backward, only the layer input is kept);
    otherwise "saved". An explicit ``requested`` mode wins."""
    if requested is not None:
        if requested not in ("saved", "recompute"):
            raise ValueError(
                f"attention_backward must be 'saved' or 'recompute', got {requested!r}"
            )
        return requested
    modules = getattr(config, "recompute_modules", None) or ["core_attn"]
    if getattr(config, "recompute_granularity", None) == "selective" and "core_attn" in modules:
        return "recompute"
    return "saved"


def check_offloading(config) -> None:
    """``--cpu-offloading`` wraps each layer in saved-tensor hooks, which see everything TSP
    saves (``save_for_backward``): honoured. Fine-grained activation offloading hooks named
    submodules (core_attn, attn_proj, ...) that TSP's fused attention/MLP do not call: refused."""
    if getattr(config, "fine_grained_activation_offloading", False):
        raise ValueError(
            "--fine-grained-activation-offloading (offload_modules="
            f"{getattr(config, 'offload_modules', None)}) is not supported by TSP layers; use "
            "--cpu-offloading or --recompute-activations"
        )


class TSPSelfAttention(SelfAttention):
    """Drop-in for Megatron's ``SelfAttention`` under TSP.

    ``SelfAttention.__init__`` builds the TP=D parameter holders (``linear_qkv`` column-parallel
    with Megatron's per-query-group layout, ``linear_proj`` row-parallel with a replicated,
    ``sequence_parallel``-tagged bias), so parameters and checkpoints are those of TP=D + SP.
    ``forward`` replaces the TP computation with the TSP schedule and returns
    ``(output, proj_bias)`` like ``SelfAttention``.
    """

    # it reads the zigzag batch (batch_guard refuses a natural-order one)
    needs_zigzag_batch = True

    def __init__(
        self,
        config,
        submodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_comm_type=None,
        pg_collection=None,
        attention_backward: Optional[str] = None,
        kv_grad_reduce_in_fp32: Optional[bool] = None,
        kv_grad_all_to_all: Optional[bool] = None,
        **kwargs,
    ):
        attention_backward = attention_backward_from_config(config, attention_backward)
        check_offloading(config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"TSP attention supports causal masking only, got {attn_mask_type}")
        group = resolve_group(pg_collection)
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        size = dist.get_world_size(group)
        check_model_shape(
            size,
            config.num_attention_heads,
            config.num_query_groups,
            hidden_size=config.hidden_size,
            kv_channels=config.kv_channels,
        )
        rejections.check_config(config, size, layer="attention")
        # TSP x CP: K/V travel over the D*C sequence group. Megatron's local core attention
        # (built by SelfAttention, never called by TSP) refuses CP, so the parent is built with
        # a CP-free copy of the config; the layer keeps the real one.
        self_config = config
        cp_size = getattr(config, "context_parallel_size", 1) or 1
        if cp_size > 1:
            config = dataclasses.replace(config, context_parallel_size=1)
        super().__init__(
            config,
            submodules,
            layer_number,
            attn_mask_type=attn_mask_type,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
            **kwargs,
        )
        if self.q_layernorm is not None or self.k_layernorm is not None:
            # A spec that adds q/k norms without config.qk_layernorm (e.g. a custom spec).
            raise rejections.TSPRejection(
                rejections.row_for("qk_layernorm").message(True, size)
                + f" (the spec gives {type(self).__name__} a q_layernorm / k_layernorm)"
            )
        self.config = config = self_config
        self.tsp_group = group
        self.cp_size = cp_size
        self.seq_group = resolve_sequence_group(group, pg_collection) if cp_size > 1 else group
        if dist.get_world_size(self.seq_group) != size * cp_size:
            raise ValueError(
                f"TSP attention with context_parallel_size={cp_size} needs a sequence group of "
                f"{size} x {cp_size} ranks, got {dist.get_world_size(self.seq_group)}"
            )
        scale = config.softmax_scale
        if scale is None:
            scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        self.head_layout = HeadLayout(
            heads=self.num_attention_heads_per_partition,
            groups=self.num_query_groups_per_partition,
            head_dim=self.hidden_size_per_attention_head,
            softmax_scale=scale,
            dropout_p=config.attention_dropout,
            config=config,
            backward=attention_backward,
            kv_grad_fp32=bool(
                getattr(config, "tsp_kv_grad_reduce_in_fp32", False)
                if kv_grad_reduce_in_fp32 is None
                else kv_grad_reduce_in_fp32
            ),
            kv_grad_all_to_all=bool(
                getattr(config, "tsp_kv_grad_all_to_all", False)
                if kv_grad_all_to_all is None
                else kv_grad_all_to_all
            ),
            activation_sums_fp32=bool(getattr(config, "tsp_activation_sums_in_fp32", False)),
            # ng < D: megatron-core gives each rank one K/V head (num_query_groups_per_partition
            # = 1) and the np/ng query heads of its group; a TSP step covers the D/ng shards of
            # that group block (see the module docstring)
            shards_per_group=max(1, size // config.num_query_groups),
        )
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self._select_kernel(self.linear_qkv.weight.device, config.params_dtype)

    def _select_kernel(self, device, dtype) -> None:
        """Choose the attention backend for this device/dtype (at construction, and again only if
        the module later runs on another device or dtype)."""
        head_layout = self.head_layout
        self.attention_kernel = kernels.select_kernel(
            device,
            dtype,
            head_layout.head_dim,
            head_layout.heads != head_layout.groups,
            head_layout.dropout_p,
        )
        self._kernel_key = (torch.device(device).type, dtype)

    @property
    def attention_kernel_name(self) -> str:
        """The attention backend this layer runs (for the log and the dry run)."""
        return self.attention_kernel.name

    @property
    def attention_kernel_description(self) -> str:
        """The backend and why it was chosen, e.g. "aten_flash (default)"."""
        return self.attention_kernel.describe()

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
        **kwargs,
    ):
        check_attention_input()  # refuses micro-batches that bypassed the zigzag batch hook
        if key_value_states is not None:
            raise ValueError("TSP attention is self-attention only")
        documents = _documents_of(attention_mask, packed_seq_params, hidden_states)
        if inference_context is not None or inference_params is not None:
            if documents is not None and not documents.is_single_document:
                raise ValueError(
                    "TSP inference prefill does not support packed documents (a document "
                    "attention_mask or packed_seq_params): prefill one document per sequence"
                )
            # Inference hook: TSP prefill into megatron-core's KV cache (decode runs Megatron's
            # own TP=D attention on the same parameters, see megatron_tsp/inference).
            return prefill_attention(
                self, hidden_states, inference_context or inference_params, rotary_pos_emb
            )
        if attention_bias is not None:
            raise ValueError("TSP attention does not support an attention bias")
        if self.config.no_rope_freq and self.config.no_rope_freq[self.layer_number - 1]:
            rotary_pos_emb = None
        if isinstance(rotary_pos_emb, tuple):
            q_emb, k_emb = rotary_pos_emb
        else:
            q_emb = k_emb = rotary_pos_emb
        if packed_seq_params is not None and documents is not None:
            # THD: Megatron rotates each token at its position within its document (the table
            # holds max_seqlen rows); TSP's tables index natural positions, so they read a
            # table whose row p is the angle of p's position in its document
            shared = k_emb is q_emb
            q_emb = _document_rope_table(q_emb, documents)
            k_emb = q_emb if shared else _document_rope_table(k_emb, documents)
        local_len = hidden_states.shape[0]
        if local_len % 2 != 0:
            size = dist.get_world_size(self.tsp_group)
            raise ValueError(
                f"TSP attention got {local_len} local tokens: the sequence length "
                f"({local_len * size}) must be divisible by 2 x tensor-sequence-parallel size "
                f"= {2 * size} (zigzag chunks); pass batches through get_batch_on_this_tsp_rank"
            )
        layout = TSPLayout.of_groups(
            self.tsp_group,
            self.seq_group,
            local_len * dist.get_world_size(self.seq_group),
            self.cp_size,
        )
        # RoPE tables at this rank's positions: built by the first layer of the step, cached on
        # the embedding tensor (rope.local_tables)
        dtype = hidden_states.dtype
        rope_q = local_tables(q_emb, layout, dtype, self.config)
        rope_k = rope_q if k_emb is q_emb else local_tables(k_emb, layout, dtype, self.config)
        head_layout = self.head_layout
        if not self.training and head_layout.dropout_p > 0:
            head_layout = dataclasses.replace(head_layout, dropout_p=0.0)
        if (hidden_states.device.type, hidden_states.dtype) != self._kernel_key:
            self._select_kernel(hidden_states.device, hidden_states.dtype)
        # linear_qkv / linear_proj are not called: fire their pre-hooks (DDP param-gather waits).
        run_forward_pre_hooks(self.linear_qkv)
        run_forward_pre_hooks(self.linear_proj)
        out = tsp_self_attention(
            hidden_states,
            self.linear_qkv.weight,
            self.linear_qkv.bias,
            self.linear_proj.weight,
            head_layout,
            self.tsp_group,
            rope_q,
            rope_k,
            self.gradient_accumulation_fusion,
            self.attention_kernel,
            layout,
            self.seq_group,
            documents,
        )
        return out, self.linear_proj.bias


def _document_rope_table(emb: Optional[torch.Tensor], documents: DocumentMask):
    """``emb`` ([max_seqlen, 1, 1, rot] angles) re-indexed to natural positions of a THD
    sample: row p holds the angle of p - (start of p's document), as Megatron's THD RoPE
    applies it. Built once per table, documents and version (cached on ``emb``): the layers
    of a step share it."""
    if emb is None:
        return None
    key = (documents, emb._version, emb.device)
    cache = getattr(emb, "_tsp_document_rope", None)
    if cache is None or cache[0] != key:
        positions = documents.position_ids(emb.device)[0]
        longest = int(positions.max()) + 1
        if emb.shape[0] < longest:
            raise ValueError(
                f"TSP attention: the rotary table covers {emb.shape[0]} positions but a THD "
                f"document holds {longest} tokens (packed_seq_params.max_seqlen_q too small)"
            )
        cache = (key, emb.index_select(0, positions))
        emb._tsp_document_rope = cache
    return cache[1]


def _documents_of(attention_mask, packed_seq_params, hidden_states) -> Optional[DocumentMask]:
    """The micro-batch's documents: a ``DocumentMask`` or ``DocumentMaskTensor`` passed as
    ``attention_mask`` (what ``get_batch_on_this_tsp_rank`` returns for a document mask), or
    megatron-core's THD
    ``PackedSeqParams`` (b = 1, the same ``cu_seqlens`` for queries and keys), converted with
    ``DocumentMask.from_cu_seqlens``. A dense ``attention_mask`` tensor is not read: causality
    comes from the zigzag layout (``batch_contract`` checked it is the causal mask)."""
    documents = as_documents(attention_mask)
    if packed_seq_params is None:
        return documents
    fmt = getattr(packed_seq_params, "qkv_format", None)
    cu_q = getattr(packed_seq_params, "cu_seqlens_q", None)
    cu_kv = getattr(packed_seq_params, "cu_seqlens_kv", None)
    if fmt != "thd":
        raise ValueError(
            f"TSP attention supports packed_seq_params with qkv_format='thd' only, got {fmt!r}"
        )
    if cu_q is None or (cu_kv is not None and not torch.equal(cu_q, cu_kv)):
        raise ValueError(
            "TSP attention needs packed_seq_params with cu_seqlens_q equal to cu_seqlens_kv "
            "(self-attention over the same documents)"
        )
    for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        padded = getattr(packed_seq_params, name, None)
        if padded is not None and not torch.equal(padded, cu_q):
            raise ValueError(f"TSP attention does not support padded THD documents ({name})")
    if hidden_states.shape[1] != 1:
        raise ValueError(
            f"TSP attention with packed_seq_params (THD) needs micro-batch size 1, got "
            f"{hidden_states.shape[1]}"
        )
    packed = DocumentMask.from_cu_seqlens(cu_q, int(cu_q[-1]))
    if documents is not None and documents != packed:
        raise PackedBatchError(
            f"TSP attention got an attention_mask with documents {documents.starts} and "
            f"packed_seq_params with others {packed.starts}"
        )
    return packed
