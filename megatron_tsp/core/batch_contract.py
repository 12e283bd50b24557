"""What TSP attention assumes of a micro-batch, checked before it reaches the model.

TSP attention takes causality from the zigzag layout's positions and never reads a dense
``attention_mask``: documents reach it only as a ``documents.DocumentMask`` (encoded as a small
tensor in the ``attention_mask`` slot, or THD ``packed_seq_params``). A dense document mask that
bypassed the conversion would be computed as one causal document over the whole sequence: wrong
loss and gradients, no error. Two checks guard that:

* ``check_documents`` (``zigzag.get_batch_on_this_tsp_rank``): a block-diagonal causal mask
  becomes its documents; position ids must be the natural positions or restart at those
  documents; anything else (another mask, ids that match neither, multi-sample ``cu_seqlens``)
  raises ``PackedBatchError`` naming the sample and row.
* ``check_single_causal_document`` (the Megatron-LM hook, for the keys its flags do not define):
  each sequence is one causal document, else ``PackedBatchError`` names the key, the first
  offending sequence and row, and the flag that makes TSP read the documents.

Both read the full (pre-zigzag) batch or a CP rank's slice, at one comparison per element plus
one host sync; an ``[s, s]`` mask is compared in row blocks, so no second ``[s, s]`` tensor is
built.

Mask convention (Megatron's): ``True`` (or non-zero) means *masked out*; the plain causal mask
masks key ``j`` for the query at position ``p`` exactly when ``j > p``.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from megatron_tsp.core.documents import DocumentMask, PackedBatchError
from megatron_tsp.core.layout import TSPLayout

__all__ = [
    "PackedBatchError",
    "check_documents",
    "check_single_causal_document",
    "natural_positions",
]

# rows of an [s, s] mask compared at a time: bounds the temporary to ~16M elements
_MASK_BLOCK_ELEMENTS = 1 << 24


def natural_positions(
    seq_length: int,
    context_parallel_size: int = 1,
    cp_rank: int = 0,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """The positions a single-document batch holds: ``arange(seq_length)``, or under context
    parallelism (``seq_length`` is then the CP rank's slice) Megatron's CP split of the whole
    sequence: CP chunks ``cp_rank`` and ``2C-1-cp_rank`` of ``2C``."""
    if context_parallel_size == 1:
        return torch.arange(seq_length, device=device)
    layout = TSPLayout(context_parallel_size, seq_length * context_parallel_size, cp_rank)
    return layout.positions(device)


def check_documents(batch: Mapping[str, Optional[torch.Tensor]]) -> Optional[DocumentMask]:
    """The documents of a full (pre-zigzag, not CP-sliced) batch, validated: a ``DocumentMask``
    (possibly one document per sample), or None when the batch says nothing about them.

    * ``attention_mask`` [b, 1, s, s] (or [1, 1, s, s] for every sample): must be
      block-diagonal causal (the plain causal mask is one document);
      ``DocumentMask.from_attention_mask`` names the first bad row otherwise;
    * ``cu_seqlens`` (THD, one packed sample): documents ``DocumentMask.from_cu_seqlens``; a
      mask given beside it must agree;
    * ``position_ids`` [b, s]: each sample's must be the natural positions ``0..s-1`` or, with
      a document mask, restart at 0 at each of its document starts (``--reset-position-ids``
      with ``--reset-attention-mask``); with one document per sample, ids that count up from
      0 and restart at 0 anywhere (``--reset-position-ids`` alone: one causal document whose
      learned positions restart, as TP+SP computes it) are accepted too. Anything else is
      refused naming the sample, the index and the expected id (the learned embedding reads
      these ids, RoPE does not).

    One host sync for the mask and one for the position ids."""
    cu_seqlens = batch.get("cu_seqlens")
    position_ids = batch.get("position_ids")
    mask = batch.get("attention_mask")
    tokens = batch.get("tokens")
    seq = None
    for value in (position_ids, tokens):
        if torch.is_tensor(value) and value.dim() >= 2:
            seq = value.shape[-1]
            break
    if seq is None and torch.is_tensor(mask) and mask.dim() >= 2:
        seq = mask.shape[-1]
    documents = None
    if cu_seqlens is not None:
        if seq is None:
            raise PackedBatchError("TSP got cu_seqlens without tokens or position_ids")
        batch_size = next(
            (v.shape[0] for v in (tokens, position_ids) if torch.is_tensor(v) and v.dim() >= 2),
            1,
        )
        if batch_size != 1:
            raise PackedBatchError(
                f"TSP got cu_seqlens ({_count(cu_seqlens)} boundaries) with {batch_size} "
                "samples: a packed (THD) batch is one sample ([1, total tokens])"
            )
        documents = DocumentMask.from_cu_seqlens(cu_seqlens, seq)
    if torch.is_tensor(mask) and mask.dim() >= 2:
        if seq is not None and tuple(mask.shape[-2:]) != (seq, seq):
            raise PackedBatchError(
                f"TSP got an attention_mask of shape {tuple(mask.shape)} for sequences of {seq} "
                "tokens: expected [b, 1, s, s] (rows are the queries)"
            )
        from_mask = DocumentMask.from_attention_mask(mask)
        if documents is not None and from_mask != documents:
            raise PackedBatchError(
                f"TSP got cu_seqlens documents {documents.starts} and an attention_mask with "
                f"documents {from_mask.starts}"
            )
        documents = from_mask
    if torch.is_tensor(position_ids) and position_ids.dim() >= 2:
        ids = position_ids.reshape(-1, seq)
        if documents is not None:
            documents.check_batch_size(ids.shape[0], "position_ids batch")
        natural = torch.arange(seq, device=ids.device)
        bad = ids != natural
        if documents is not None and not documents.is_single_document:
            restart = documents.position_ids(ids.device).expand(ids.shape[0], seq)
            bad &= (ids != restart).any(dim=-1, keepdim=True)  # a sample may be either
        else:
            # one causal document: ids that count up from 0 and restart at 0 are Megatron's
            # --reset-position-ids alone (one causal document, restarted learned positions,
            # computed alike by TP+SP and TSP: the embedding reads the permuted ids)
            restarts = torch.cat([ids[:, :1] == 0, (ids[:, 1:] == 0) | (ids.diff(dim=-1) == 1)], 1)
            bad &= ~restarts.all(dim=-1, keepdim=True)
        first = int(_first_true(bad))
        if first >= 0:
            row, col = divmod(first, seq)
            starts = documents.starts_of(row) if documents is not None else (0,)
            raise PackedBatchError(
                f"TSP got position_ids that match neither the natural positions nor the "
                f"documents: sample {row} holds {int(ids[row, col])} at index {col} (documents "
                f"start at {_short(starts)}; expected {col} or the index within its document). "
                "Under a document mask (--reset-attention-mask) restarted ids "
                "(--reset-position-ids) must restart at its documents; without one they must "
                "count up from 0, restarting at 0"
            )
    return documents


def _short(values, limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def check_single_causal_document(
    batch: Mapping[str, Optional[torch.Tensor]],
    context_parallel_size: int = 1,
    cp_rank: int = 0,
) -> None:
    """Raise ``PackedBatchError`` unless every sequence of ``batch`` is one causal document:
    no ``cu_seqlens``; ``position_ids`` (if given) equal to the natural positions; an
    ``attention_mask`` (if given) equal to the plain causal mask at those positions."""
    cu_seqlens = batch.get("cu_seqlens")
    if cu_seqlens is not None:
        raise PackedBatchError(
            "TSP got a packed (THD) batch with cu_seqlens "
            f"({_count(cu_seqlens)} boundaries): packed sequences are not supported under TSP "
            "yet; drop --sft / --dataloader-inter-document-masking"
        )
    position_ids = batch.get("position_ids")
    mask = batch.get("attention_mask")
    tokens = batch.get("tokens")
    seq = None
    for value, dim in ((position_ids, -1), (tokens, -1), (mask, -2)):
        if torch.is_tensor(value) and value.dim() >= 2:
            seq = value.shape[dim]
            break
    if seq is None:
        return
    ref = position_ids if torch.is_tensor(position_ids) else mask
    device = ref.device if torch.is_tensor(ref) else None
    positions = natural_positions(seq, context_parallel_size, cp_rank, device)
    findings = []  # (name, first bad flat index or -1) evaluated with one host sync
    if torch.is_tensor(position_ids) and position_ids.dim() >= 2:
        bad = position_ids.reshape(-1, seq) != positions
        findings.append(("position_ids", _first_true(bad)))
    if torch.is_tensor(mask) and mask.dim() >= 2:
        if mask.shape[-2] != seq:
            raise PackedBatchError(
                f"TSP got an attention_mask of shape {tuple(mask.shape)} for sequences of {seq} "
                "tokens: expected [b, 1, s, s] (rows are the queries)"
            )
        findings.append(("attention_mask", _first_bad_mask_row(mask, positions)))
    if not findings:
        return
    firsts = torch.stack([f for _, f in findings]).tolist()
    for (name, _), first in zip(findings, firsts):
        if first < 0:
            continue
        row, col = divmod(first, seq)
        if name == "position_ids":
            raise PackedBatchError(
                f"TSP got position_ids that are not the sequence's positions: sequence {row} "
                f"holds {int(position_ids.reshape(-1, seq)[row, col])} at index {col}, expected "
                f"{int(positions[col])} (position ids that restart per document come from "
                "--reset-position-ids: pass it so that TSP reads the documents); without the "
                "flag TSP would compute one causal document over the whole sequence"
            )
        raise PackedBatchError(
            "TSP got an attention_mask that is not the plain causal mask: in mask "
            f"{row} the query at position {int(positions[col])} differs from causal "
            "(a document mask comes from --reset-attention-mask: pass it so that TSP reads the "
            "documents); without the flag TSP would compute one causal document over the whole "
            "sequence"
        )


def _count(cu_seqlens) -> int:
    return int(cu_seqlens.numel()) if torch.is_tensor(cu_seqlens) else len(cu_seqlens)


def _first_true(flags: torch.Tensor) -> torch.Tensor:
    """Flat index of the first True of ``flags`` as a 0-d tensor (-1 if none), no host sync."""
    flat = flags.reshape(-1)
    index = torch.arange(flat.numel(), device=flat.device)
    big = torch.full_like(index, flat.numel())
    first = torch.where(flat, index, big).min() if flat.numel() else big.new_tensor(0)
    return torch.where(first >= flat.numel(), first.new_tensor(-1), first)


def _first_bad_mask_row(mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Flat index ``mask_index * s + row`` of the first mask row that is not causal at
    ``positions`` (rows are queries at ``positions``, columns keys ``0..mask.shape[-1]-1``),
    -1 if every row is causal. Row blocks keep the temporaries small."""
    rows, cols = mask.shape[-2], mask.shape[-1]
    masks = mask.reshape(-1, rows, cols)
    keys = torch.arange(cols, device=mask.device)
    block = max(1, _MASK_BLOCK_ELEMENTS // max(1, cols * masks.shape[0]))
    bad_rows = torch.zeros(masks.shape[0], rows, dtype=torch.bool, device=mask.device)
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        causal = keys.unsqueeze(0) > positions[start:stop].unsqueeze(1)
        bad_rows[:, start:stop] = (masks[:, start:stop, :] != 0).ne(causal).any(dim=-1)
    return _first_true(bad_rows)
