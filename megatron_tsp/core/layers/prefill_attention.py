"""TSP prefill of one attention layer into megatron-core's static KV cache.

Called from ``TSPSelfAttention.forward`` when an inference context is passed (its only inference
hook). Rank p holds the zigzag chunks p and 2D-1-p of the prompt slice being prefilled
(``[S/D, b, h]``) and TP=D shard p of the QKV / output projections. For each head group r:

    owner r broadcasts (W_qkv_r, b_qkv_r, W_proj_r)          # shard r+1 already in flight
    q, k, v = X_p @ W_qkv_r^T                                 # k, v before RoPE
    K_r, V_r = all-gather(k, v) -> natural order [S, b, ng/D, hn]
    owner r writes K_r, V_r into its cache rows [o, o + S)    # exactly a TP=D rank's cache
    (chunked prefill, o > 0: owner r broadcasts cache rows [0, o) of K_r / V_r first)
    Y_p += causal_attention(RoPE(q), RoPE([cache; K_r]), [cache; V_r]) @ W_proj_r^T
    (RoPE of the gathered keys in place, block by block, after the owner cached them)

TSP x CP (the layer's ``cp_size`` C > 1): the prompt slice is cut over the sequence group (D*C
ranks, ``TSPLayout.of_groups``), so rank q holds chunks q and 2DC-1-q of 2DC. The weight
broadcasts stay inside the TSP group (the shards are replicated over CP); each head group's K/V
is all-gathered over all D*C ranks, so every rank attends over the whole prompt as without CP.
Only the TSP group of CP rank 0 (the one that decodes, see ``megatron_tsp.inference``) writes
the cache; the other CP ranks take part in the prefill and keep no cache. Chunked prefill: the
cached prefix is broadcast over the sequence group from the owner at CP rank 0.

Fewer K/V heads than ranks (ng < D, megatron-core's TP layout, see ``attention.py``): the loop
runs over the ng head groups, step j takes the D/ng shards j*D/ng .. of group j's QKV block and
output projection, gathers the group's one K/V head once, and every rank of the group (the TP=D
ranks sharing that K/V head) writes it into its cache, as Megatron's TP prefill leaves it.

After every layer each rank's ``key_value_memory_dict[layer]`` holds its own head groups for every
prompt position in Megatron's layout (``[max_seq, max_batch, ng/D, hn]``, keys stored before RoPE,
as the static path of ``Attention._adjust_key_value_for_inference`` does), so decode is Megatron's
own TP=D attention with no resharding. One head group's full-sequence K/V is alive at a time
(plus, for chunked prefill, that group's cached prefix).

Communication per layer per rank (all forward, no autograd): D broadcasts of one weight shard
(root r); per head group two all-gathers of ``[S/(2D), b, 2 ng/D, hn]`` (the first and second
zigzag chunks, received straight into natural-order rows); for chunked prefill D broadcasts of
``[o, b, 2 ng/D, hn]`` cached K/V from their owners. With ng < D: ng head groups, so ng pairs of
all-gathers of ``[S/(2D), b, 2, hn]`` and ng cached-prefix broadcasts (from each group's first
rank); the weight broadcasts are unchanged. Under TSP x CP the all-gathers (chunks of
``S/(2DC)`` rows) and the cached-prefix broadcasts run over the D*C ranks of the sequence group,
the weight broadcasts over the D ranks of the TSP group.

The inference-only code does not reuse the training autograd Function's internals (attention.py
is free to change them); it shares the head groups' pieces with it (``head_groups``: the layout
of a step, the packed own shard, the shard stream, the QKV projection), ``comm``, and Megatron's
own RoPE call (``rope.megatron_rotary``); chunk ids, positions and causal blocks come from
``layout.TSPLayout``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes

from megatron_tsp.core.comm import broadcast_from, labelled, weight_bias_views
from megatron_tsp.core.layers.head_groups import GroupStream, group_qkv_linear, pack_own_shard
from megatron_tsp.core.layers.rope import megatron_rotary
from megatron_tsp.core.layout import TSPLayout


def _lower_right_causal(q_len: int, kv_len: int):
    with _disable_current_modes():  # CausalBias is a tensor subclass: build it outside fake modes
        return causal_lower_right(q_len, kv_len)


def _static_cache(module, context, dtype, device):
    """This rank's (key, value) cache of the layer, allocated by Megatron's own allocator on first
    use, exactly as ``Attention._adjust_key_value_for_inference`` does for a TP=D rank."""
    memory = context.key_value_memory_dict
    if module.layer_number not in memory:
        key_dim = getattr(module, "key_hidden_size", module.hidden_size_per_attention_head)
        val_dim = getattr(module, "val_hidden_size", module.hidden_size_per_attention_head)
        memory[module.layer_number] = (
            module._allocate_memory(
                context.max_sequence_length, context.max_batch_size, key_dim, dtype
            ).to(device),
            module._allocate_memory(
                context.max_sequence_length, context.max_batch_size, val_dim, dtype
            ).to(device),
        )
    return memory[module.layer_number]


def check_context(module, context) -> None:
    """Refuse what the TSP prefill does not implement, naming the setting."""
    if not context.is_static_batching():
        raise ValueError(
            "TSP prefill supports megatron-core's StaticInferenceContext only; the dynamic "
            "context (paged KV blocks, packed requests) is not supported"
        )
    if context.is_decode_only():
        raise ValueError(
            "TSP attention runs the prefill only: decode with the tied TP=D model "
            "(megatron_tsp.inference.TSPInferenceEngine)"
        )
    if module.config.flash_decode:
        raise ValueError(
            "--flash-decode stores keys after RoPE; TSP prefill supports the "
            "default static cache (keys before RoPE) only"
        )


def prefill_attention(module, hidden_states: torch.Tensor, context, rotary_pos_emb=None) -> tuple:
    """TSP prefill of one layer; returns ``(output, linear_proj.bias)`` like ``SelfAttention``.

    ``hidden_states``: this rank's zigzag tokens ``[S/D, b, h]`` of the prompt slice at cache
    offset ``context.sequence_len_offset`` (natural positions ``[o, o + S)``), batch rows
    ``[context.batch_size_offset, + b)``. ``rotary_pos_emb``: Megatron's RoPE table (or a (q, k)
    pair) covering at least ``o + S`` positions, indexed by natural position.
    """
    check_context(module, context)
    group = module.tsp_group
    seq_group = getattr(module, "seq_group", group)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_size = dist.get_world_size(seq_group)
    head_layout = module.head_layout
    local_len, batch = hidden_states.shape[0], hidden_states.shape[1]
    if local_len % 2 != 0:
        raise ValueError(
            f"TSP prefill got {local_len} local tokens: the prompt slice must split "
            f"into 2 x {seq_size} zigzag chunks"
        )
    seq = local_len * seq_size
    offset, b0 = context.sequence_len_offset, context.batch_size_offset
    if offset + seq > context.max_sequence_length:
        raise ValueError(
            f"prefill of {seq} tokens at offset {offset} exceeds the inference "
            f"context's max_sequence_length={context.max_sequence_length}"
        )
    if module.config.no_rope_freq and module.config.no_rope_freq[module.layer_number - 1]:
        rotary_pos_emb = None
    q_table, k_table = (
        rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb, rotary_pos_emb)
    )
    layout = TSPLayout.of_groups(group, seq_group, seq, seq_size // size)
    serving = layout.split_rank(layout.rank)[1] == 0  # CP rank 0 keeps the cache
    freqs_q = freqs_k = None
    if q_table is not None:
        positions = offset + layout.positions(q_table.device)
        freqs_q = q_table.index_select(0, positions)
        freqs_k = k_table[: offset + seq]
    key_mem = val_mem = None
    if serving:
        key_mem, val_mem = _static_cache(module, context, hidden_states.dtype, hidden_states.device)
    has_bias = module.linear_qkv.bias is not None
    own = pack_own_shard(
        module.linear_qkv.weight, module.linear_qkv.bias, module.linear_proj.weight
    )
    groups, head_dim = head_layout.groups, head_layout.head_dim
    m = head_layout.shards_per_group  # shards per head group: D / ng when ng < D, else 1
    out = None
    with torch.no_grad(), labelled("tsp_prefill_attention"):
        stream = GroupStream(own, group, m, hold=1)  # posts shard 0
        for r in range(size // m):
            shards = stream.get(r)  # posts the next group's first shard before returning
            mixed = group_qkv_linear(hidden_states, shards, has_bias, head_layout)
            q, k, v = torch.split(mixed, head_layout.qkv_split, dim=3)
            q = q.reshape(local_len, batch, head_layout.heads, head_dim)
            q = megatron_rotary(q, freqs_q, head_layout.config)
            kv = _natural_kv(torch.cat([k, v], dim=2), offset, seq_group, layout)
            if offset > 0:  # every rank of the group caches the same rows: the first sends
                _fill_cached_prefix(kv, key_mem, val_mem, offset, b0, r * m, seq_group)
            if serving and rank // m == r:  # what a TP=D rank of this group's prefill caches
                key_mem[offset : offset + seq, b0 : b0 + batch] = kv[offset:, :, :groups]
                val_mem[offset : offset + seq, b0 : b0 + batch] = kv[offset:, :, groups:]
            k_all = _rope_in_place(
                kv[:, :, :groups], freqs_k, head_layout.config
            )  # cache is written
            ctx_r = chunk_attention(
                q, k_all, kv[:, :, groups:], layout.causal_blocks, offset, head_layout
            )
            del k_all, kv
            for ctx_part, shard in zip(ctx_r.chunk(m, dim=-1), shards):  # each shard's heads
                proj_w = weight_bias_views(shard.views(), has_bias)[2]
                contrib = torch.matmul(ctx_part, proj_w.t())
                out = contrib if out is None else out.add_(contrib)
    return out, module.linear_proj.bias


def _natural_kv(local_kv, offset: int, group, layout: TSPLayout) -> torch.Tensor:
    """``[offset + S, b, 2 ng/D, hn]`` buffer whose rows [offset, offset + S) receive every rank's
    local K/V in natural order: two all-gathers (first chunks, second chunks) straight into the
    natural-order row blocks, so no permuted copy of the full-sequence K/V is ever made. Rows
    [0, offset) are left for the cached prefix."""
    size, chunk_len, seq = layout.group_size, layout.chunk_len, layout.seq_length
    kv = torch.empty(
        (offset + seq,) + tuple(local_kv.shape[1:]), dtype=local_kv.dtype, device=local_kv.device
    )
    new = kv[offset:]
    if size == 1:
        new.copy_(local_kv)
        return kv
    spans = [layout.spans_of(r) for r in range(size)]  # per rank: (first, second) chunk
    firsts = [new[first[0] : first[1]] for first, _ in spans]
    seconds = [new[second[0] : second[1]] for _, second in spans]
    dist.all_gather(firsts, local_kv[:chunk_len].contiguous(), group=group)
    dist.all_gather(seconds, local_kv[chunk_len:].contiguous(), group=group)
    return kv


def _fill_cached_prefix(kv, key_mem, val_mem, offset, b0, owner, seq_group) -> None:
    """Rows [0, offset) of ``kv``: head group ``owner``'s cached K/V (before RoPE), broadcast over
    the sequence group by ``owner``, the TSP rank of CP rank 0 holding that group's cache (its
    sequence rank equals its TSP rank)."""
    prefix = kv[:offset]
    batch = kv.shape[1]
    if dist.get_rank(seq_group) == owner:
        groups = key_mem.shape[2]
        prefix[:, :, :groups] = key_mem[:offset, b0 : b0 + batch]
        prefix[:, :, groups:] = val_mem[:offset, b0 : b0 + batch]
    if dist.get_world_size(seq_group) > 1:
        broadcast_from(prefix, owner, seq_group, async_op=False)


ROPE_BLOCK = 16384  # rows of K rotated at a time: bounds RoPE's temporaries at long prompts


def _rope_in_place(k, freqs, config) -> torch.Tensor:
    """RoPE of ``k`` [L, b, g, hn] (positions 0..L-1) written back into ``k`` block by block (RoPE
    is per position, so blocks give the same numbers; no second full-length key buffer)."""
    if freqs is None:
        return k
    for start in range(0, k.shape[0], ROPE_BLOCK):
        end = min(start + ROPE_BLOCK, k.shape[0])
        k[start:end] = megatron_rotary(k[start:end], freqs[start:end], config)
    return k


def chunk_attention(q, k_nat, v_nat, blocks, offset, head_layout):
    """Each causal block's queries (``TSPLayout.causal_blocks``: local chunk c, natural positions
    offset + [cC, (c+1)C)) against keys [0, offset + (c+1)C), bottom-right causal. Returns
    ``[2C, b, np * hn]``. (A module attribute: the prefill memory tool swaps in a flash-equivalent
    kernel, as the training tool does.)"""
    outs = []
    for block in blocks:
        rows = block.query_len
        q_c = q.narrow(0, block.query_start, rows).permute(1, 2, 0, 3)
        kv_len = offset + block.key_len
        k_c = k_nat[:kv_len].permute(1, 2, 0, 3)
        v_c = v_nat[:kv_len].permute(1, 2, 0, 3)
        o = F.scaled_dot_product_attention(
            q_c,
            k_c,
            v_c,
            attn_mask=_lower_right_causal(rows, kv_len),
            scale=head_layout.softmax_scale,
            enable_gqa=head_layout.heads != head_layout.groups,
        )
        outs.append(o.permute(2, 0, 1, 3).reshape(rows, q.shape[1], -1))
    return torch.cat(outs, dim=0)
