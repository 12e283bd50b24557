"""Zigzag sequence partition for causal load balance: tensors and batches.

The layout itself (rank r holds chunks r and 2D-1-r of 2D equal chunks; the permutation between
natural and gathered order) is ``megatron_tsp.core.layout.TSPLayout``. This module applies it to
tensors:

* ``split``: a rank's local ``[2C]`` slice of a full-sequence tensor;
* ``permute`` / ``unpermute``: the whole sequence reordered as ``[c0, c_{2D-1}, c1, c_{2D-2}, ...]``
  (the gathered order) and back, so that Megatron's *contiguous* sequence-parallel shards are
  exactly the zigzag chunks. ``get_batch_on_this_tsp_rank`` applies ``permute`` to a batch.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from megatron_tsp.core.batch_contract import check_documents
from megatron_tsp.core.layout import TSPLayout, check_sequence_length


def _group_layout(group_size: int, seq_length: int) -> TSPLayout:
    check_sequence_length(seq_length, group_size)  # the error names --seq-length
    return TSPLayout(group_size, seq_length)


def permute(x: torch.Tensor, group_size: int, dim: int) -> torch.Tensor:
    """Natural order -> gathered order along ``dim``."""
    layout = _group_layout(group_size, x.shape[dim])
    return x.index_select(dim, layout.permutation(x.device))


def unpermute(x: torch.Tensor, group_size: int, dim: int) -> torch.Tensor:
    """Gathered order (e.g. an all-gather over the group) -> natural order along ``dim``."""
    layout = _group_layout(group_size, x.shape[dim])
    return x.index_select(dim, layout.inverse(x.device))


def permute_into(x: torch.Tensor, group_size: int, dim: int, out: torch.Tensor) -> torch.Tensor:
    """``permute`` written into a preallocated ``out`` (a persistent communication buffer)."""
    layout = _group_layout(group_size, x.shape[dim])
    return torch.index_select(x, dim, layout.permutation(x.device), out=out)


def unpermute_into(x: torch.Tensor, group_size: int, dim: int, out: torch.Tensor) -> torch.Tensor:
    """``unpermute`` written into a preallocated ``out``."""
    layout = _group_layout(group_size, x.shape[dim])
    return torch.index_select(x, dim, layout.inverse(x.device), out=out)


def split(x: torch.Tensor, group_size: int, rank: int, dim: int) -> torch.Tensor:
    """This rank's local slice (chunks r and 2D-1-r, concatenated) of a full-sequence tensor."""
    check_sequence_length(x.shape[dim], group_size)
    layout = TSPLayout(group_size, x.shape[dim], rank)
    return torch.cat(
        [x.narrow(dim, start, end - start) for start, end in layout.spans_of(rank)], dim=dim
    )


BATCH_SEQ_DIM = 1


def get_batch_on_this_tsp_rank(
    batch: Dict[str, Optional[torch.Tensor]],
    group_size: Optional[int] = None,
    permute_attention_mask: bool = True,
    context_parallel_size: int = 1,
    cp_rank: int = 0,
    check_single_document: bool = True,
) -> Dict[str, Optional[torch.Tensor]]:
    """Zigzag-permute a Megatron ``get_batch`` dict along the sequence.

    In: the full-sequence batch every TP/TSP rank receives from Megatron's data broadcast:
    ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` as ``[b, s]`` and ``attention_mask`` as
    ``[b, 1, s, s]`` (any key may be missing or None).

    Out: the same keys, reordered along ``s`` to ``[c0, c_{2D-1}, c1, c_{2D-2}, ...]``. Fed to a
    ``GPTModel`` running with sequence parallelism, Megatron's embedding scatters contiguous
    sequence shards, so TSP rank r works on chunks r and 2D-1-r. ``position_ids`` keep the tokens'
    true positions (see below). The per-token losses the model returns (``[b, s]``) are in the
    same permuted order; ``loss_mask`` is permuted identically, so
    ``sum(loss * mask) / sum(mask)`` equals the unpermuted objective.
    ``zigzag.unpermute(losses, D, dim=1)`` restores natural order.

    ``permute_attention_mask=False`` passes ``attention_mask`` through untouched (TSP attention
    never reads it: causality comes from the zigzag positions; the Megatron-LM hook uses this so
    that no S x S tensor is permuted). The returned tensors are marked for
    ``megatron_tsp.core.batch_guard`` (TSP attention refuses unmarked micro-batches under the
    launcher).

    Positions have one definition, the layout: TSP attention applies RoPE at
    ``TSPLayout.positions()``, as Megatron's RoPE indexes its table by sequence index (and by the
    CP layout under context parallelism), never by ``position_ids``; the embedding's learned
    absolute positions read ``position_ids``, as under TP+SP. Megatron's GPT datasets give
    ``position_ids = arange(s)`` unless ``--reset-position-ids``, which restarts them at each
    document: RoPE still rotates at sequence index there (as Megatron's bshd path does; scores
    within a document depend only on distances), only the learned embedding sees the restarts;
    ``tests/test_layout.py`` asserts that permuted ``arange`` ids equal
    ``TSPLayout.permutation()``.

    Packed documents (``batch_contract.check_documents``): a block-diagonal causal
    ``attention_mask`` (or a THD batch's ``cu_seqlens``) with several documents in a sample is
    returned as ``attention_mask`` = ``DocumentMask.to_tensor()`` (natural positions, never
    permuted; ``GPTModel`` hands it to every TSP attention layer, which runs one causal call
    per (chunk, document) segment); ``position_ids`` may restart at the document starts (the
    embedding reads them, permuted like the tokens). A mask that is neither, or position ids
    that match neither the natural positions nor the documents, raise ``PackedBatchError``
    naming the sample and row (one host sync per key and micro-batch). A single document per
    sample keeps today's output exactly. ``check_single_document=False`` is for a caller that
    checked the batch itself (the Megatron-LM hook checks its CP rank's slice before the
    zigzag): the mask then passes through as before.
    """
    from megatron_tsp.core.batch_guard import mark_zigzagged

    documents = check_documents(batch) if check_single_document else None
    if documents is not None and documents.is_single_document:
        documents = None  # the plain causal mask: today's path

    if group_size is None:
        from megatron_tsp.core import parallel_state

        group_size = parallel_state.get_tensor_sequence_parallel_world_size()
    if documents is not None:  # replaced by the documents: no S x S permute
        batch = {k: v for k, v in batch.items() if k != "attention_mask"}
    if context_parallel_size > 1:
        out = _cp_batch(batch, group_size, context_parallel_size, cp_rank, permute_attention_mask)
        return _with_documents(out, documents)
    out: Dict[str, Optional[torch.Tensor]] = {}
    for key, value in batch.items():
        if value is None or group_size == 1:
            out[key] = value
        elif key == "attention_mask":
            out[key] = (
                permute(permute(value, group_size, dim=-1), group_size, dim=-2)
                if permute_attention_mask
                else value
            )
        elif torch.is_tensor(value) and value.dim() >= 2:
            check_sequence_length(value.shape[BATCH_SEQ_DIM], group_size)
            out[key] = permute(value, group_size, dim=BATCH_SEQ_DIM)
        else:
            out[key] = value
    for key in ("tokens", "position_ids", "labels"):
        mark_zigzagged(out.get(key), group_size)
    return _with_documents(out, documents)


def _with_documents(out, documents):
    """``out`` with the packed documents (if any) as its ``attention_mask``."""
    if documents is not None:
        out["attention_mask"] = documents.to_tensor()
    return out


def _cp_batch(batch, group_size: int, cp_size: int, cp_rank: int, permute_attention_mask: bool):
    """CP rank ``cp_rank``'s slice of a full batch under TSP x CP (see
    ``get_batch_on_this_tsp_rank``)."""
    from megatron_tsp.core.batch_guard import mark_zigzagged

    out: Dict[str, Optional[torch.Tensor]] = {}
    for key, value in batch.items():
        if not torch.is_tensor(value) or value.dim() < 2:
            out[key] = value
            continue
        seq = value.shape[-1] if key == "attention_mask" else value.shape[BATCH_SEQ_DIM]
        check_sequence_length(seq, group_size * cp_size)
        layout = TSPLayout(group_size * cp_size, seq, context_parallel_size=cp_size)
        rows = layout.cp_batch_positions(cp_rank, value.device)
        if key == "attention_mask":
            out[key] = (
                value.index_select(-1, layout.permutation(value.device)).index_select(-2, rows)
                if permute_attention_mask
                else value
            )
        else:
            out[key] = value.index_select(BATCH_SEQ_DIM, rows)
    for key in ("tokens", "position_ids", "labels"):
        mark_zigzagged(out.get(key), group_size)
    return out
