"""Packed documents of a micro-batch: where each document starts, and the attention calls it needs.

A packed micro-batch holds several documents end to end in each sequence; a token attends to the
keys of its own document only, causally (Megatron-LM's ``--reset-attention-mask``: a
block-diagonal causal ``attention_mask`` [b, 1, s, s], True = masked out; or a THD batch's
``cu_seqlens``). ``DocumentMask`` is that structure as host-side integers, per sample the
natural positions where documents start (the first is 0), built once per micro-batch from the
dense mask, from ``cu_seqlens`` or from the starts themselves.

``DocumentMask.segments(runs)`` is the per-rank plan TSP attention runs: a rank holds local
rows that are contiguous runs of natural positions (``TSPLayout.natural_runs``: today's global
zigzag gives two runs, chunks r and 2D-1-r; a per-document zigzag would give more). Each run is
cut at the document starts inside it; each piece is one bottom-right causal kernel call: its
query rows against the natural-order keys from its document's start to its own end
(``layout.CausalBlock`` with ``key_start`` = the document start). Every local query row is in
exactly one segment, so the segments' outputs need no merging, and the segments visit exactly
the in-document causal (query, key) pairs.

How it travels through ``GPTModel``: as the ``attention_mask`` argument, in the form of a
``DocumentMaskTensor`` (``DocumentMask.to_tensor``): a small CPU int64 tensor whose *values*
encode the starts, marked by its class. Megatron passes ``attention_mask`` unchanged down to
every ``SelfAttention.forward``, but full activation recomputation
(``tensor_parallel.checkpoint``) puts it through ``save_for_backward`` and ``detach`` (a
non-tensor is refused there, and ``detach`` drops Python attributes, keeping the subclass), so
the structure has to be the tensor's data. ``as_documents`` turns either form back into a
``DocumentMask`` (decoding is a ``tolist`` of a few CPU ints: no device sync).

Nothing here communicates or reads device memory after construction; the constructors that read
a tensor (``from_attention_mask``, ``from_cu_seqlens``) do one host sync.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Tuple

import torch

from megatron_tsp.core.layout import CausalBlock

# rows of an [s, s] mask compared at a time: bounds the temporary to ~16M elements
_MASK_BLOCK_ELEMENTS = 1 << 24


class PackedBatchError(ValueError):
    """A batch's documents (mask, position ids or ``cu_seqlens``) are malformed, inconsistent,
    or of a kind TSP does not support; the message names the key, the sample and the row."""


@dataclass(frozen=True)
class SampleSegments:
    """The kernel calls of samples ``[sample_start, sample_start + sample_count)`` of the
    micro-batch (consecutive samples with the same documents share one plan): ``blocks`` are
    ``CausalBlock``\\ s over natural-order keys, in local-row order, tiling the local rows."""

    sample_start: int
    sample_count: int
    blocks: Tuple[CausalBlock, ...]


@dataclass(frozen=True)
class DocumentMask:
    """Per sample of a micro-batch the natural positions where its documents start.

    ``starts[i]``: sample i's document starts, strictly increasing, first 0, all below
    ``seq_length``. One tuple for every sample of the batch is allowed (a broadcast
    ``[1, 1, s, s]`` mask): it then applies to every sample."""

    starts: Tuple[Tuple[int, ...], ...]
    seq_length: int

    def __post_init__(self) -> None:
        s = self.seq_length
        if not isinstance(s, int) or s <= 0:
            raise PackedBatchError(f"DocumentMask: seq_length must be a positive int, got {s!r}")
        if not self.starts:
            raise PackedBatchError("DocumentMask: no samples (starts is empty)")
        for i, row in enumerate(self.starts):
            if not row or row[0] != 0:
                raise PackedBatchError(
                    f"DocumentMask: sample {i}'s document starts {row} must begin with 0"
                )
            for a, b in zip(row, row[1:]):
                if not a < b:
                    raise PackedBatchError(
                        f"DocumentMask: sample {i}'s document starts {row} are not strictly "
                        f"increasing ({a} then {b})"
                    )
            if row[-1] >= s:
                raise PackedBatchError(
                    f"DocumentMask: sample {i} has a document start {row[-1]} outside a "
                    f"sequence of {s} tokens"
                )

    # ---- constructors ---------------------------------------------------------------------------
    @classmethod
    def from_document_starts(
        cls, starts_per_sample: Iterable[Iterable[int]], seq_length: int
    ) -> "DocumentMask":
        """From per-sample start positions (ints; the first must be 0)."""
        return cls(tuple(tuple(int(p) for p in row) for row in starts_per_sample), int(seq_length))

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens, seq_length: int) -> "DocumentMask":
        """From a THD batch's cumulative document lengths ``[0, l0, l0 + l1, ..., seq_length]``
        (one sample: THD packs the batch into one sequence). Refuses lengths that do not add
        up to ``seq_length`` or are not increasing, naming the entry."""
        values = cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else list(cu_seqlens)
        values = [int(v) for v in values]
        if len(values) < 2 or values[0] != 0:
            raise PackedBatchError(
                f"cu_seqlens {values} must start at 0 and hold at least one document"
            )
        for i, (a, b) in enumerate(zip(values, values[1:])):
            if b <= a:
                raise PackedBatchError(
                    f"cu_seqlens entry {i + 1} ({b}) is not above entry {i} ({a}): "
                    "empty or negative document"
                )
        if values[-1] != seq_length:
            raise PackedBatchError(
                f"cu_seqlens ends at {values[-1]} but the sequence holds {seq_length} tokens "
                "(padded THD, cu_seqlens_q_padded, is not supported under TSP)"
            )
        return cls((tuple(values[:-1]),), int(seq_length))

    @classmethod
    def from_attention_mask(cls, mask: torch.Tensor) -> "DocumentMask":
        """From a dense mask ``[b, 1, s, s]`` (or ``[b, s, s]``; True / non-zero = masked out,
        Megatron's convention) that must be block-diagonal causal: row p leaves exactly the
        keys ``[start(p), p]`` visible, with ``start(p)`` either p (a document starts) or
        ``start(p - 1)``. Anything else raises ``PackedBatchError`` naming the first bad row.
        Compared in row blocks (no second [s, s] tensor); one host sync."""
        if not torch.is_tensor(mask) or mask.dim() < 3 or mask.shape[-1] != mask.shape[-2]:
            shape = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
            raise PackedBatchError(
                f"attention_mask of shape {shape}: expected [b, 1, s, s] (rows are queries)"
            )
        s = mask.shape[-1]
        masks = mask.reshape(-1, s, s)
        if mask.dim() == 4 and mask.shape[1] != 1:
            raise PackedBatchError(
                f"attention_mask of shape {tuple(mask.shape)}: one mask per sample expected "
                "([b, 1, s, s]); per-head masks are not supported under TSP"
            )
        n = masks.shape[0]
        device = mask.device
        keys = torch.arange(s, device=device)
        rows_all = torch.arange(s, device=device)
        # start(p): the first visible key of row p (s when the row masks everything)
        doc_start = torch.empty((n, s), dtype=torch.long, device=device)
        bad_rows = torch.zeros((n, s), dtype=torch.bool, device=device)
        block = max(1, _MASK_BLOCK_ELEMENTS // max(1, s * n))
        for lo in range(0, s, block):
            hi = min(s, lo + block)
            visible = masks[:, lo:hi, :] == 0
            first = torch.where(visible, keys, s).amin(dim=-1)  # [n, rows]
            doc_start[:, lo:hi] = first
            rows = rows_all[lo:hi]
            expect = (keys >= first.unsqueeze(-1)) & (keys <= rows.view(1, -1, 1))
            bad_rows[:, lo:hi] = expect.ne(visible).any(dim=-1) | (first > rows)
        # a row's document either starts at the row or continues the previous row's
        prev = torch.cat([doc_start.new_zeros((n, 1)), doc_start[:, :-1]], dim=1)
        bad_rows |= (doc_start != rows_all) & (doc_start != prev)
        flat_bad = bad_rows.reshape(-1)
        index = torch.where(flat_bad, torch.arange(flat_bad.numel(), device=device), n * s).min()
        is_start = doc_start == rows_all
        first_bad = int(index)  # the host sync
        if first_bad < n * s:
            sample, row = divmod(first_bad, s)
            visible = (masks[sample, row] == 0).nonzero().flatten().tolist()
            shown = _spans(visible)
            raise PackedBatchError(
                f"attention_mask is not a block-diagonal causal (document) mask: in sample "
                f"{sample} the query at row {row} sees keys {shown}; a document mask lets it "
                f"see [start of its document, {row}] (Megatron's convention: True = masked out)"
            )
        starts = tuple(tuple(r.nonzero().flatten().tolist()) for r in is_start.cpu())
        return cls(starts, s)

    # ---- queries --------------------------------------------------------------------------------
    @property
    def is_single_document(self) -> bool:
        """Every sample is one document (the plain causal mask)."""
        return all(len(row) == 1 for row in self.starts)

    def starts_of(self, sample: int) -> Tuple[int, ...]:
        return self.starts[0] if len(self.starts) == 1 else self.starts[sample]

    def check_batch_size(self, batch_size: int, what: str = "micro-batch") -> None:
        if len(self.starts) not in (1, batch_size):
            raise PackedBatchError(
                f"DocumentMask holds {len(self.starts)} samples' documents but the {what} has "
                f"{batch_size} samples"
            )

    def document_lengths(self, sample: int) -> Tuple[int, ...]:
        row = self.starts_of(sample) + (self.seq_length,)
        return tuple(b - a for a, b in zip(row, row[1:]))

    def position_ids(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """[samples, s] position ids restarting at each document (``--reset-position-ids``)."""
        out = torch.empty((len(self.starts), self.seq_length), dtype=torch.long)
        for i, row in enumerate(self.starts):
            for a, b in zip(row, row[1:] + (self.seq_length,)):
                out[i, a:b] = torch.arange(b - a)
        return out.to(device) if device is not None else out

    def dense_mask(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """[samples, 1, s, s] bool mask, True = masked (for tests and references)."""
        s = self.seq_length
        pos = torch.arange(s)
        rows = []
        for row in self.starts:
            start = torch.tensor(row)[torch.bucketize(pos, torch.tensor(row), right=True) - 1]
            rows.append((pos.view(1, -1) < start.view(-1, 1)) | (pos.view(1, -1) > pos.view(-1, 1)))
        mask = torch.stack(rows).unsqueeze(1)
        return mask.to(device) if device is not None else mask

    def segments(self, runs: Sequence[Tuple[int, int, int]], batch_size: int):
        """The per-rank attention plan: a tuple of ``SampleSegments`` covering the
        ``batch_size`` samples. ``runs``: this rank's local rows as contiguous natural-position
        runs ``(local_row, natural_start, length)`` in local-row order
        (``TSPLayout.natural_runs``). Each run is cut at the document starts inside it; the
        piece ``[p0, p1)`` of the document starting at ``d`` is ``CausalBlock(local rows of p0,
        p1 - p0, key_len=p1 - d, key_start=d)``: bottom-right causal over natural keys."""
        self.check_batch_size(batch_size)
        return _segments(self, tuple(tuple(r) for r in runs), batch_size)

    def to_tensor(self) -> "DocumentMaskTensor":
        """This mask as a ``DocumentMaskTensor`` (CPU int64 ``[samples, 1 + most documents]``:
        row i is ``[seq_length, starts of sample i..., -1 padding]``), the form that passes
        through Megatron's ``attention_mask`` argument, recomputation included."""
        width = 1 + max(len(row) for row in self.starts)
        data = torch.full((len(self.starts), width), -1, dtype=torch.long)
        for i, row in enumerate(self.starts):
            data[i, 0] = self.seq_length
            data[i, 1 : 1 + len(row)] = torch.tensor(row, dtype=torch.long)
        return data.as_subclass(DocumentMaskTensor)

    def pairs(self) -> int:
        """In-document causal (query, key) pairs of the whole batch (every sample)."""
        return sum(
            n * (n + 1) // 2 for i in range(len(self.starts)) for n in self.document_lengths(i)
        )


class DocumentMaskTensor(torch.Tensor):
    """A ``DocumentMask`` encoded in a CPU int64 tensor (``DocumentMask.to_tensor``); the
    class marks it as documents (not a dense mask) and survives ``detach`` and
    ``save_for_backward``. Decode with ``as_documents``."""


def as_documents(mask) -> Optional[DocumentMask]:
    """The ``DocumentMask`` of an ``attention_mask`` argument: a ``DocumentMask``, or a
    ``DocumentMaskTensor``; None for anything else (None, a dense mask tensor)."""
    if isinstance(mask, DocumentMask):
        return mask
    if isinstance(mask, DocumentMaskTensor):
        rows = torch.Tensor.tolist(mask.as_subclass(torch.Tensor).cpu())
        return _decode(tuple(tuple(row) for row in rows))
    return None


@functools.lru_cache(maxsize=64)
def _decode(rows) -> DocumentMask:
    if not rows or len({row[0] for row in rows}) != 1:
        raise PackedBatchError(f"malformed DocumentMaskTensor (rows {list(rows)[:2]}...)")
    return DocumentMask(tuple(tuple(v for v in row[1:] if v >= 0) for row in rows), rows[0][0])


@functools.lru_cache(maxsize=256)
def _segments(documents: DocumentMask, runs, batch_size: int):
    plans = []
    for sample in range(batch_size):
        blocks = _sample_blocks(documents.starts_of(sample), runs, documents.seq_length)
        if plans and plans[-1][2] == blocks:
            start, count, _ = plans[-1]
            plans[-1] = (start, count + 1, blocks)
        else:
            plans.append((sample, 1, blocks))
    return tuple(SampleSegments(*plan) for plan in plans)


def _sample_blocks(starts: Tuple[int, ...], runs, seq_length: int) -> Tuple[CausalBlock, ...]:
    blocks = []
    for local, natural, length in runs:
        if natural < 0 or natural + length > seq_length:
            raise ValueError(f"run {natural}..{natural + length} outside {seq_length} positions")
        p0, end = natural, natural + length
        while p0 < end:
            doc = bisect.bisect_right(starts, p0) - 1
            doc_start = starts[doc]
            p1 = min(end, starts[doc + 1]) if doc + 1 < len(starts) else end
            blocks.append(
                CausalBlock(local + p0 - natural, p1 - p0, p1 - doc_start, key_start=doc_start)
            )
            p0 = p1
    return tuple(blocks)


def _spans(indices) -> str:
    """``[0, 3] [7, 9]``-style runs of sorted ints (a mask row's visible keys)."""
    if not indices:
        return "none"
    out, lo, prev = [], indices[0], indices[0]
    for i in indices[1:]:
        if i != prev + 1:
            out.append(f"[{lo}, {prev}]")
            lo = i
        prev = i
    out.append(f"[{lo}, {prev}]")
    return " ".join(out[:4]) + (" ..." if len(out) > 4 else "")
