"""Megatron-LM's packed documents (``--reset-attention-mask``), found in a GPT batch.

Megatron-LM's GPT dataset packs documents end to end, each ended by the tokenizer's EOD token, and
``_get_ltor_masks_and_position_ids`` (``megatron/core/datasets/gpt_dataset.py``, the same in
core_v0.16.1 and core_v0.19.0) derives the documents from the sample's tokens. For an EOD at index
``i`` the next document starts at ``i + 1``: the EOD belongs to the document it ends, and an EOD at
the last index starts nothing. Then

* ``--reset-attention-mask``: the rows after ``i`` lose the keys up to ``i`` in the dense
  ``[s, s]`` mask, which exists only when ``create_attention_mask_in_dataloader`` (the TSP
  launcher turns it off: at 128k it is 17 GB per sample);
* ``--reset-position-ids``: ``position_ids`` restart at 0 at ``i + 1``;
* ``--eod-mask-loss``: the EODs' ``loss_mask`` is 0 (in the batch already; nothing to do here).

``documents_of_batch`` gives TSP attention the same documents as a ``core.documents.DocumentMask``
(host-side start positions, natural order), without ever building an ``[s, s]`` tensor:

* from the dense mask, when the dataloader built one (``DocumentMask.from_attention_mask``
  validates that it is block-diagonal causal);
* else, under ``--reset-position-ids``, where ``position_ids`` restart at 0: Megatron's own reset,
  exact even where the batch's tokens no longer hold the EOD (the dataset replaces pad tokens by 0
  after finding the EODs, which changes an EOD only when the tokenizer's pad id equals its EOD id
  and ``--allow-ambiguous-pad-tokens`` keeps it so);
* else after each EOD token (``tokens == tokenizer.eod``), exactly Megatron's rule.

``--reset-position-ids`` without ``--reset-attention-mask`` is not a document mask: every sequence
stays one causal document (Megatron attends across the EODs too), only the learned absolute
position embedding reads the restarted ``position_ids`` (permuted with the tokens); RoPE never
reads them (Megatron's bshd path applies it at the sequence index, as TSP does at the layout's
positions). ``documents_of_batch`` returns None then.

Everything runs on the batch's device; ``from_start_flags`` moves the starts (a few integers per
document) to the host in one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Union

import torch

from megatron_tsp.core.documents import DocumentMask, PackedBatchError

RESET_MASK_FLAG = "--reset-attention-mask"
RESET_POSITIONS_FLAG = "--reset-position-ids"


def starts_after_eod(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``[b, s]`` bool, True where a document starts: index 0 and the index after each EOD
    (an EOD at the last index starts nothing). Megatron's rule on ``tokens``."""
    if tokens.dim() != 2:
        raise PackedBatchError(f"tokens of shape {tuple(tokens.shape)}: expected [b, s]")
    flags = torch.empty(tokens.shape, dtype=torch.bool, device=tokens.device)
    flags[:, :1] = True
    torch.eq(tokens[:, :-1], eod, out=flags[:, 1:])
    return flags


def starts_of_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` bool, True where ``position_ids`` restart at 0 (``--reset-position-ids``).
    Raises ``PackedBatchError`` unless every position is 0 or its predecessor's plus one (what
    Megatron's reset gives: ``arange`` restarted at each document), naming the first bad one."""
    if position_ids.dim() != 2:
        raise PackedBatchError(
            f"position_ids of shape {tuple(position_ids.shape)}: expected [b, s]"
        )
    flags = position_ids == 0
    index = torch.arange(position_ids.shape[1], device=position_ids.device)
    start = torch.where(flags, index, 0).cummax(dim=1).values
    # at a restart (position 0) the expected value is 0 too; before the first restart the
    # cummax is 0 and a non-zero first position fails here
    bad = (position_ids != index - start).reshape(-1)
    first = torch.where(bad, torch.arange(bad.numel(), device=bad.device), bad.numel()).min()
    first = int(first)
    if first < bad.numel():
        sample, col = divmod(first, position_ids.shape[1])
        row = position_ids[sample]
        raise PackedBatchError(
            f"{RESET_POSITIONS_FLAG}: position_ids of sample {sample} hold {int(row[col])} at "
            f"index {col} where a document's positions continue to "
            f"{int(index[col] - start[sample, col])} (or restart at 0): they do not restart "
            "per document the way Megatron's dataset builds them, so TSP cannot read the "
            "document starts from them"
        )
    return flags


def from_start_flags(flags: torch.Tensor) -> DocumentMask:
    """A ``DocumentMask`` from ``[b, s]`` start flags (one device-to-host transfer)."""
    b, s = flags.shape
    rows = [[] for _ in range(b)]
    for sample, col in flags.nonzero().tolist():
        rows[sample].append(col)
    return DocumentMask.from_document_starts(rows, s)


@dataclass(frozen=True)
class DocumentRule:
    """How this run's batches define documents: Megatron-LM's two flags, and the EOD id (an int,
    or a callable asked on first use: Megatron builds its tokenizer after the arguments)."""

    reset_attention_mask: bool = False
    reset_position_ids: bool = False
    eod: Union[int, Callable[[], int], None] = None

    def eod_id(self) -> int:
        eod = self.eod() if callable(self.eod) else self.eod
        if eod is None:
            raise PackedBatchError(
                f"{RESET_MASK_FLAG} without {RESET_POSITIONS_FLAG} or a dataloader mask: "
                "TSP finds the documents after the EOD tokens, but no EOD id is known"
            )
        return int(eod)

    def source(self, batch: Mapping[str, Optional[torch.Tensor]]) -> Optional[str]:
        """Where ``documents_of_batch`` reads this batch's documents (None: one document per
        sequence), for the launcher's log."""
        if not self.reset_attention_mask:
            return None
        if torch.is_tensor(batch.get("attention_mask")):
            return "the dataloader's attention mask"
        if self.reset_position_ids:
            return f"the position-id restarts ({RESET_POSITIONS_FLAG})"
        return "the tokens after each EOD"


def megatron_eod() -> int:
    """The EOD id of Megatron-LM's global tokenizer (the one its GPT dataset reads)."""
    from megatron.training import get_tokenizer

    return int(get_tokenizer().eod)


def documents_of_batch(
    batch: Mapping[str, Optional[torch.Tensor]], rule: DocumentRule
) -> Optional[DocumentMask]:
    """The documents of a full-sequence (pre-CP-split) ``get_batch`` dict under ``rule``, in
    natural order; None when every sequence is one causal document (no ``--reset-attention-mask``).
    Never builds an ``[s, s]`` tensor."""
    source = rule.source(batch)
    if source is None:
        return None
    mask = batch.get("attention_mask")
    if torch.is_tensor(mask):
        return DocumentMask.from_attention_mask(mask)
    if rule.reset_position_ids:
        positions = batch.get("position_ids")
        if not torch.is_tensor(positions):
            raise _missing("position_ids")
        return from_start_flags(starts_of_position_ids(positions))
    tokens = batch.get("tokens")
    if not torch.is_tensor(tokens):
        raise _missing("tokens")
    return from_start_flags(starts_after_eod(tokens, rule.eod_id()))


def _missing(key: str) -> PackedBatchError:
    return PackedBatchError(
        f"{RESET_MASK_FLAG}: this micro-batch has no {key} (a later pipeline stage receives "
        "only labels and loss_mask), so TSP cannot find its documents"
    )
