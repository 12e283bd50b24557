"""TSP self-attention: weight shards are broadcast, K/V are all-gathered one head group at a time.

Rank p holds its tokens X_p ([s/D, b, h], zigzag chunks p and 2D-1-p) and the TP=D shard p of
the fused QKV projection (query groups p*g/D ..) and of the output projection (input columns).
Forward, for each head-group shard r = 0..D-1:

    owner r broadcasts (W_qkv_r, b_qkv_r, W_proj_r)   # shard r+1 is already in flight meanwhile
    q, k, v = X_p @ W_qkv_r^T  (+ RoPE at the tokens' true positions)
    K_r, V_r = all-gather(k, v) over the group       # full sequence, this head group only
    Y_p += causal_attention(q, K_r, V_r) @ W_proj_r^T   # accumulated locally: no all-reduce

Causal masking is per local chunk: chunk c's queries see keys [0, (c+1)C) with a bottom-right
aligned causal mask (no S x S mask; with flash kernels, see ``flash.py``, two blocks merged by
log-sum-exp). Backward re-broadcasts the shards, re-gathers each head group's K/V,
reduce-scatters dK/dV back to the token owners and reduces each shard's weight gradient onto its
owner. ``attention_backward="saved"`` (default) keeps each head group's local qkv, output and
log-sum-exp (local-token sized, like TP+SP's saved activations) so the attention forward is not
recomputed; ``"recompute"`` keeps only X_p and recomputes everything per head group (least memory;
also used when attention dropout is on or no flash kernel fits the device/dtype).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes

from megatron_tsp import rejections, zigzag
from megatron_tsp.batch_guard import check_attention_input
from megatron_tsp.layers.module_hooks import run_forward_pre_hooks
from megatron_tsp.comm import (FlatShard, all_gather_seq, broadcast_from, reduce_scatter_seq,
                               reduce_to, wait_all, weight_bias_views)
from megatron_tsp.comm_counter import comm_scope
from megatron_tsp.layers import flash
from megatron_tsp.layers.grads import weight_grad_output
from megatron_tsp.parallel_state import resolve_group
from megatron_tsp.validation import check_model_shape

try:  # megatron-core >= 0.14
    from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config
except ImportError:  # pragma: no cover - older cores have no YaRN mscale
    _yarn_get_concentration_factor_from_config = None


@dataclass(frozen=True)
class HeadLayout:
    """Per-shard head geometry (identical to a TP=D rank's) and attention constants."""

    heads: int  # query heads per shard (np / D)
    groups: int  # key/value groups per shard (ng / D)
    head_dim: int
    softmax_scale: float
    dropout_p: float
    config: object  # the TransformerConfig, for RoPE
    backward: str = "saved"  # "saved": keep (q,k,v, out, lse); "recompute": keep only the input

    @property
    def qkv_split(self) -> list:
        return [self.heads // self.groups * self.head_dim, self.head_dim, self.head_dim]


def _rope(t: torch.Tensor, freqs: Optional[torch.Tensor], config) -> torch.Tensor:
    if freqs is None:
        return t
    mscale = 1.0
    if _yarn_get_concentration_factor_from_config is not None:
        mscale = _yarn_get_concentration_factor_from_config(config)
    return apply_rotary_pos_emb(t, freqs, config=config, mscale=mscale, cp_group=_NoCP)


class _NoCPGroup:
    """RoPE never reads the CP group for [s, b, ...] tensors; this avoids a global lookup."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


_NoCP = _NoCPGroup()


def qkv_linear(x, qkv_w, qkv_b, layout: HeadLayout) -> torch.Tensor:
    """Local tokens through one QKV shard: [s, b, ng/D, (np/ng + 2) * hn] (Megatron's layout)."""
    mixed = torch.matmul(x, qkv_w.t())
    if qkv_b is not None:
        mixed = mixed + qkv_b
    return mixed.view(*mixed.shape[:2], layout.groups, -1)


def split_rope(mixed, layout: HeadLayout, freqs_q, freqs_k):
    """q [s, b, np/D, hn], k and v [s, b, ng/D, hn], RoPE applied at the given positions."""
    q, k, v = torch.split(mixed, layout.qkv_split, dim=3)
    q = q.reshape(q.shape[0], q.shape[1], layout.heads, layout.head_dim)
    return _rope(q, freqs_q, layout.config), _rope(k, freqs_k, layout.config), v


def project_qkv(x, qkv_w, qkv_b, layout: HeadLayout, freqs_q, freqs_k):
    return split_rope(qkv_linear(x, qkv_w, qkv_b, layout), layout, freqs_q, freqs_k)


def _lower_right_causal(q_len: int, kv_len: int):
    """Bottom-right aligned causal bias (flash-attention semantics for q_len < kv_len).

    Built outside any active dispatch mode: ``CausalBias`` is a tensor subclass, and creating it
    under ``FakeTensorMode`` or a tracing mode fails; it holds no data, so nothing is lost.
    """
    with _disable_current_modes():
        return causal_lower_right(q_len, kv_len)


def zigzag_causal_attention(q, k_nat, v_nat, chunks: Sequence[int], layout: HeadLayout,
                            dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of the local zigzag chunks' queries against natural-order K/V.

    q: [2C, b, np, hn] (chunk ``chunks[0]`` then ``chunks[1]``); k_nat, v_nat: [S, b, ng, hn].
    Chunk c attends to keys [0, (c+1)C) with a bottom-right aligned causal mask. Returns
    [2C, b, np * hn].
    """
    c_len = q.shape[0] // len(chunks)
    outs = []
    for i, c in enumerate(chunks):
        q_c = q[i * c_len:(i + 1) * c_len].permute(1, 2, 0, 3)
        kv_len = (c + 1) * c_len
        k_c = k_nat[:kv_len].permute(1, 2, 0, 3)
        v_c = v_nat[:kv_len].permute(1, 2, 0, 3)
        o = F.scaled_dot_product_attention(
            q_c, k_c, v_c, attn_mask=_lower_right_causal(c_len, kv_len), dropout_p=dropout_p,
            scale=layout.softmax_scale, enable_gqa=layout.heads != layout.groups,
        )
        outs.append(o.permute(2, 0, 1, 3).reshape(c_len, q.shape[1], -1))
    return torch.cat(outs, dim=0)


def gather_kv(k, v, group, size):
    """One all-gather for a head group's K and V: natural-order views [S, b, ng/D, hn] of a
    single [S, b, 2 * ng/D, hn] buffer."""
    groups = k.shape[2]
    kv = zigzag.unpermute(all_gather_seq(torch.cat([k, v], dim=2), group), size, dim=0)
    return kv[:, :, :groups], kv[:, :, groups:]


def scatter_kv_grads(dk_nat, dv_nat, group, size):
    """Adjoint of ``gather_kv``: one reduce-scatter returns each token owner the sum of its
    dK / dV over the group."""
    groups = dk_nat.shape[2]
    d_kv = reduce_scatter_seq(zigzag.permute(torch.cat([dk_nat, dv_nat], dim=2), size, dim=0),
                              group)
    return d_kv[:, :, :groups], d_kv[:, :, groups:]


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


class _ShardStream:
    """Broadcasts the D weight shards in order, one shard ahead of the consumer."""

    def __init__(self, own: FlatShard, group):
        self.own, self.group = own, group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.spare = [FlatShard.like(own), FlatShard.like(own)] if self.size > 1 else []
        self.pending = {}

    def _issue(self, r: int) -> None:
        if r >= self.size or self.size == 1:
            return
        buf = self.own if r == self.rank else self.spare[r % 2]
        self.pending[r] = (buf, broadcast_from(buf.buffer, r, self.group, async_op=True))

    def __iter__(self):
        if self.size == 1:
            yield 0, self.own
            return
        self._issue(0)
        for r in range(self.size):
            self._issue(r + 1)  # prefetch the next shard before computing with this one
            buf, req = self.pending.pop(r)
            req.wait()
            yield r, buf


class _TSPAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, qkv_w, qkv_b, proj_w, freqs_q, freqs_k, layout, group, fuse):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        has_bias = qkv_b is not None
        chunks = zigzag.chunk_ids(size, rank)
        dropout_p = layout.dropout_p
        use_saved = layout.backward == "saved" and flash.supported(x, layout.head_dim, dropout_p)
        rng = _rng_state(x.device) if dropout_p > 0 else None
        own = _pack_own(qkv_w, qkv_b, proj_w)
        out, shards = None, []
        with comm_scope("tsp_attention"):
            for _, shard in _ShardStream(own, group):
                w, b, pw = weight_bias_views(shard.views(), has_bias)
                mixed = qkv_linear(x, w, b, layout)
                q, k, v = split_rope(mixed, layout, freqs_q, freqs_k)
                k_nat, v_nat = gather_kv(k, v, group, size)
                if use_saved:
                    ctx_r, stats = flash.forward(q, k_nat, v_nat, chunks, layout.softmax_scale)
                    shards.append((mixed, ctx_r, stats))  # all local-token sized
                else:
                    ctx_r = zigzag_causal_attention(q, k_nat, v_nat, chunks, layout, dropout_p)
                del k_nat, v_nat
                contrib = torch.matmul(ctx_r, pw.t())
                out = contrib if out is None else out.add_(contrib)
        ctx.save_for_backward(x, qkv_w, qkv_b, proj_w, freqs_q, freqs_k)
        ctx.layout, ctx.group, ctx.fuse, ctx.rng = layout, group, fuse, rng
        ctx.shards = shards if use_saved else None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grads = _backward(ctx, grad_out.contiguous())
        ctx.shards = None
        x, qkv_w, qkv_b, proj_w = ctx.saved_tensors[:4]
        grad_x, own_grad = grads
        views = own_grad.views()
        g_w, g_b, g_pw = weight_bias_views(views, qkv_b is not None)
        fuse = ctx.fuse
        return (
            grad_x,
            weight_grad_output(qkv_w, g_w, fuse),
            weight_grad_output(qkv_b, g_b, fuse),
            weight_grad_output(proj_w, g_pw, fuse),
            None, None, None, None, None,
        )


def _pack_own(qkv_w, qkv_b, proj_w) -> FlatShard:
    """This rank's shard as one flat buffer [qkv weight, (qkv bias), proj weight]."""
    return FlatShard.pack([qkv_w] + ([qkv_b] if qkv_b is not None else []) + [proj_w])


def _backward_state(ctx):
    """What both backward variants start from: saved inputs, group geometry, the own-shard
    buffer that the weight stream broadcasts, the owner-reduce and the dX accumulator."""
    x, qkv_w, qkv_b, proj_w, freqs_q, freqs_k = ctx.saved_tensors
    group = ctx.group
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    own = _pack_own(qkv_w, qkv_b, proj_w)
    return (x, freqs_q, freqs_k, ctx.layout, group, size, zigzag.chunk_ids(size, rank),
            qkv_b is not None, own, _OwnerReduce(own, group), torch.zeros_like(x))


def _backward(ctx, grad_out):
    """Per head group: re-broadcast the shard, re-gather K/V, attention backward, reduce-scatter
    dK/dV to the token owners, one dgrad/wgrad over the shard's qkv, weight grads to the owner.

    ``saved`` mode reuses the forward's local qkv, output and log-sum-exp (flash backward, no
    attention recompute); ``recompute`` mode recomputes the QKV projection and the attention
    forward (public SDPA, RNG replayed for attention dropout)."""
    (x, freqs_q, freqs_k, layout, group, size, chunks, has_bias, own, reducer,
     grad_x) = _backward_state(ctx)
    saved = ctx.shards
    tokens_x = x.reshape(-1, x.shape[-1])
    tokens_dy = grad_out.reshape(-1, grad_out.shape[-1])
    rng_ctx = _replay_rng(ctx.rng, x.device) if ctx.rng is not None else contextlib.nullcontext()
    with comm_scope("tsp_attention"), rng_ctx:
        for r, shard in _ShardStream(own, group):
            w, b, pw = weight_bias_views(shard.views(), has_bias)
            if saved is not None:
                mixed, ctx_r, stats = saved[r]
            else:
                mixed = qkv_linear(x, w, b, layout)
            with torch.enable_grad():
                m_leaf = mixed.detach().requires_grad_(True)
                q, k, v = split_rope(m_leaf, layout, freqs_q, freqs_k)
            k_nat, v_nat = gather_kv(k.detach(), v.detach(), group, size)
            d_ctx = torch.matmul(grad_out, pw)
            if saved is not None:
                dq, dk_nat, dv_nat = flash.backward(d_ctx, q.detach(), k_nat, v_nat, chunks,
                                                    layout.softmax_scale, stats)
            else:
                with torch.enable_grad():
                    inputs = [q.detach().requires_grad_(True), k_nat.requires_grad_(True),
                              v_nat.requires_grad_(True)]
                    ctx_out = zigzag_causal_attention(*inputs, chunks, layout, layout.dropout_p)
                    dq, dk_nat, dv_nat = torch.autograd.grad(ctx_out, inputs, d_ctx)
                ctx_r = ctx_out.detach()
            del k_nat, v_nat
            dk, dv = scatter_kv_grads(dk_nat, dv_nat, group, size)
            (d_mixed,) = torch.autograd.grad([q, k, v], [m_leaf], [dq, dk, dv])
            d_rows = d_mixed.reshape(-1, w.shape[0])
            grad_x.add_(torch.matmul(d_rows, w).view_as(x))
            partial = FlatShard.like(own)
            g_w, g_b, g_pw = weight_bias_views(partial.views(), has_bias)
            torch.matmul(d_rows.t(), tokens_x, out=g_w)
            if has_bias:
                torch.sum(d_rows, dim=0, out=g_b)
            torch.matmul(tokens_dy.t(), ctx_r.reshape(-1, ctx_r.shape[-1]), out=g_pw)
            reducer.submit(r, partial)
        return grad_x, reducer.finish()


class _OwnerReduce:
    """Reduce each shard's partial weight gradient onto its owner, one reduce in flight; the
    owner's buffer ends up holding the group's sum."""

    def __init__(self, own: FlatShard, group):
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


def tsp_self_attention(x, qkv_weight, qkv_bias, proj_weight, layout: HeadLayout, group,
                       freqs_q=None, freqs_k=None, fuse_into_main_grad: bool = False):
    """Causal self-attention of this rank's zigzag tokens under TSP (output projection included,
    its bias excluded). ``freqs_*``: RoPE angles already indexed at the local tokens' positions."""
    return _TSPAttentionFunction.apply(x, qkv_weight, qkv_bias, proj_weight, freqs_q, freqs_k,
                                       layout, group, fuse_into_main_grad)


class TSPSelfAttention(SelfAttention):
    """Drop-in for Megatron's ``SelfAttention`` under TSP.

    ``SelfAttention.__init__`` builds the TP=D parameter holders (``linear_qkv`` column-parallel
    with Megatron's per-query-group layout, ``linear_proj`` row-parallel with a replicated,
    ``sequence_parallel``-tagged bias), so parameters and checkpoints are those of TP=D + SP.
    ``forward`` replaces the TP computation with the TSP schedule and returns
    ``(output, proj_bias)`` like ``SelfAttention``.
    """

    def __init__(self, config, submodules, layer_number: int,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal, cp_comm_type=None,
                 pg_collection=None, attention_backward: str = "saved", **kwargs):
        if attention_backward not in ("saved", "recompute"):
            raise ValueError(f"attention_backward must be 'saved' or 'recompute', "
                             f"got {attention_backward!r}")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"TSP attention supports causal masking only, got {attn_mask_type}")
        group = resolve_group(pg_collection)
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        size = dist.get_world_size(group)
        check_model_shape(size, config.num_attention_heads, config.num_query_groups,
                          hidden_size=config.hidden_size)
        rejections.check_config(config, size, layer="attention")
        super().__init__(config, submodules, layer_number, attn_mask_type=attn_mask_type,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection, **kwargs)
        if self.q_layernorm is not None or self.k_layernorm is not None:
            # A spec that adds q/k norms without config.qk_layernorm (e.g. a custom spec).
            raise rejections.TSPRejection(
                rejections.row_for("qk_layernorm").message(True, size)
                + f" (the spec gives {type(self).__name__} a q_layernorm / k_layernorm)")
        self.tsp_group = group
        scale = config.softmax_scale
        if scale is None:
            scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        self.tsp_layout = HeadLayout(
            heads=self.num_attention_heads_per_partition,
            groups=self.num_query_groups_per_partition,
            head_dim=self.hidden_size_per_attention_head,
            softmax_scale=scale,
            dropout_p=config.attention_dropout,
            config=config,
            backward=attention_backward,
        )
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion

    def _local_freqs(self, emb: Optional[torch.Tensor], local_len: int):
        if emb is None:
            return None
        size, rank = dist.get_world_size(self.tsp_group), dist.get_rank(self.tsp_group)
        seq = local_len * size
        if emb.shape[0] < seq:
            raise ValueError(f"rotary table covers {emb.shape[0]} positions, need {seq}")
        positions = zigzag.local_positions(seq, size, rank, device=emb.device)
        return emb.index_select(0, positions)

    def forward(self, hidden_states, attention_mask=None, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None,
                **kwargs):
        check_attention_input()  # refuses micro-batches that bypassed the zigzag batch hook
        if key_value_states is not None:
            raise ValueError("TSP attention is self-attention only")
        if inference_context is not None or inference_params is not None:
            # Inference hook: TSP prefill into megatron-core's KV cache (decode runs Megatron's
            # own TP=D attention on the same parameters, see megatron_tsp/inference).
            from megatron_tsp.inference.attention import prefill_attention

            return prefill_attention(self, hidden_states, inference_context or inference_params,
                                     rotary_pos_emb)
        if packed_seq_params is not None:
            raise ValueError("TSP attention does not support packed (THD) sequences")
        if attention_bias is not None:
            raise ValueError("TSP attention does not support an attention bias")
        if self.config.no_rope_freq and self.config.no_rope_freq[self.layer_number - 1]:
            rotary_pos_emb = None
        if isinstance(rotary_pos_emb, tuple):
            q_emb, k_emb = rotary_pos_emb
        else:
            q_emb = k_emb = rotary_pos_emb
        local_len = hidden_states.shape[0]
        if local_len % 2 != 0:
            size = dist.get_world_size(self.tsp_group)
            raise ValueError(
                f"TSP attention got {local_len} local tokens: the sequence length "
                f"({local_len * size}) must be divisible by 2 x tensor-sequence-parallel size "
                f"= {2 * size} (zigzag chunks); pass batches through get_batch_on_this_tsp_rank"
            )
        freqs_q = self._local_freqs(q_emb, local_len)
        freqs_k = freqs_q if k_emb is q_emb else self._local_freqs(k_emb, local_len)
        layout = self.tsp_layout
        if not self.training and layout.dropout_p > 0:
            layout = dataclasses.replace(layout, dropout_p=0.0)
        # linear_qkv / linear_proj are not called: fire their pre-hooks (DDP param-gather waits).
        run_forward_pre_hooks(self.linear_qkv)
        run_forward_pre_hooks(self.linear_proj)
        out = tsp_self_attention(
            hidden_states, self.linear_qkv.weight, self.linear_qkv.bias,
            self.linear_proj.weight, layout, self.tsp_group, freqs_q, freqs_k,
            self.gradient_accumulation_fusion,
        )
        return out, self.linear_proj.bias
