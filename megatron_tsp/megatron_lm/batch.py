"""Zigzag the batch on the TSP group, right after Megatron's own batch path.

In every supported Megatron-LM version ``pretrain_gpt.get_batch`` does: TP rank 0 reads the
micro-batch, ``get_batch_on_this_tp_rank`` broadcasts it to the other TP ranks, then
``get_batch_on_this_cp_rank`` slices it for context parallelism (identity when CP = 1). The
script imports that function by name at import time from ``megatron.training.utils``
(core_v0.16) or ``megatron.core.utils`` (0.19 / main); we wrap it in both modules before the
script runs, so every TSP rank permutes its (CP rank's) broadcast batch to
``[c0, c_{2D-1}, c1, c_{2D-2}, ...]`` and Megatron's contiguous sequence-parallel shards are the
zigzag chunks.

Under TSP x CP (``--context-parallel-size`` C) Megatron's CP split runs first (CP rank c keeps CP
chunks c and 2C-1-c of 2C) and this hook zigzags that local sequence over the D TSP ranks: TSP
rank t of CP rank c then holds chunks q and 2DC-1-q of the D*C zigzag, q = c*D + t, the layout
TSP x CP attention assumes (``TSPLayout.cp_batch_positions``; ``tests/test_tsp_cp.py`` checks
the composition equals that one permutation).

No S x S attention mask is built, broadcast or permuted: the launcher turns Megatron's dataloader
mask off (``--no-create-attention-mask-in-dataloader``), and causality comes from the zigzag
positions. Packed documents (``--reset-attention-mask``) reach TSP attention as a
``core.documents.DocumentMask`` in the batch's ``attention_mask`` slot: the hook reads them from
the *full* sequence before Megatron's CP split (``documents.documents_of_batch``: from the
position-id restarts under ``--reset-position-ids``, else after each EOD token, or from the dense
mask when the dataloader built one), in natural order, so the same object serves every TSP and CP
rank. ``--reset-position-ids`` alone keeps one causal document per sequence; its restarted
``position_ids`` are permuted like the tokens (the learned position embedding reads them, RoPE
does not). The permuted tensors are marked; under TSP, ``megatron_tsp.core.batch_guard`` makes
TSP attention refuse a micro-batch that did not pass through this hook.

Loss normalization is untouched: labels and ``loss_mask`` are permuted like the tokens, the
vocab-parallel cross-entropy gives every rank the per-token loss of the full (permuted) sequence,
and ``sum(loss * mask)`` / ``sum(mask)`` are invariant under a permutation.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

from megatron_tsp.core.batch_contract import check_single_causal_document
from megatron_tsp.core.validation import TSP_FLAG
from megatron_tsp.core.zigzag import get_batch_on_this_tsp_rank
from megatron_tsp.megatron_lm import documents as tsp_documents
from megatron_tsp.megatron_lm import patches

_ACTIVE_SIZE: Optional[int] = None
_RULE = tsp_documents.DocumentRule()
_LOGGED_DOCUMENTS = False

# the batch hook's launch patches: one per module from which pretrain scripts import
# ``get_batch_on_this_cp_rank`` by name
_BATCH_HOOKS = patches.declare(
    [
        patches.row(
            patches.LAUNCH,
            "megatron.core.utils:get_batch_on_this_cp_rank",
            "zigzag permutation of each micro-batch after the TP broadcast, its documents read "
            "before the CP split (0.19 scripts import it from here)",
            ("batch",),
        ),
        patches.row(
            patches.LAUNCH,
            "megatron.training.utils:get_batch_on_this_cp_rank",
            "zigzag permutation and documents (core_v0.16 scripts import it from here)",
            ("batch",),
            versions=("0.16",),
        ),
    ]
)


def activate(tsp_size: Optional[int], rule: Optional[tsp_documents.DocumentRule] = None) -> None:
    """Permute batches for a TSP group of ``tsp_size`` ranks (None: pass batches through), with
    documents defined by ``rule`` (default: one causal document per sequence)."""
    global _ACTIVE_SIZE, _RULE, _LOGGED_DOCUMENTS
    _ACTIVE_SIZE = tsp_size
    _RULE = rule or tsp_documents.DocumentRule()
    _LOGGED_DOCUMENTS = False
    from megatron_tsp.core import batch_guard

    batch_guard.enforce(tsp_size is not None)


def document_rule(args) -> tsp_documents.DocumentRule:
    """Megatron-LM's document flags of a parsed command line (the EOD id is read from Megatron's
    tokenizer on first use: it is built after the arguments)."""
    return tsp_documents.DocumentRule(
        reset_attention_mask=bool(getattr(args, "reset_attention_mask", False)),
        reset_position_ids=bool(getattr(args, "reset_position_ids", False)),
        eod=tsp_documents.megatron_eod,
    )


def active_size() -> Optional[int]:
    return _ACTIVE_SIZE


def active_rule() -> tsp_documents.DocumentRule:
    return _RULE


def batch_documents(batch):
    """The documents of a full-sequence ``get_batch`` dict (before Megatron's CP split) under
    the active rule, or None (TSP inactive, or one causal document per sequence)."""
    if _ACTIVE_SIZE is None or not isinstance(batch, dict):
        return None
    documents = tsp_documents.documents_of_batch(batch, _RULE)
    _log_documents(batch, documents)
    return documents


def tsp_permute_batch(batch, documents=None):
    """Apply the TSP zigzag to a ``get_batch`` dict when TSP is active (else return it as is).

    ``documents``: the batch's ``DocumentMask`` (``batch_documents`` of the full sequence), put
    in the ``attention_mask`` slot as ``DocumentMask.to_tensor()`` under ``--reset-attention-mask``
    (None for one document per sequence: TSP attention's causal path)."""
    if _ACTIVE_SIZE is None or batch is None:
        return batch
    from megatron.core import parallel_state as mpu

    size = mpu.get_tensor_model_parallel_world_size()
    if size != _ACTIVE_SIZE:
        raise RuntimeError(
            f"{TSP_FLAG}={_ACTIVE_SIZE} but the tensor-parallel group has {size} ranks"
        )
    if not isinstance(batch, dict):
        raise TypeError(
            f"TSP batch hook expects the dict Megatron's get_batch builds, got {type(batch)!r}"
        )
    # Megatron's CP split ran first: this rank's slice holds CP chunks c and 2C-1-c. What the
    # flags define is not checked against one causal document: the documents replace the mask,
    # and --reset-position-ids restarts the positions the embedding reads (as under TP)
    checked = {
        key: value
        for key, value in batch.items()
        if not (key == "attention_mask" and _RULE.reset_attention_mask)
        and not (key == "position_ids" and _RULE.reset_position_ids)
    }
    check_single_causal_document(
        checked, mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
    )
    if _RULE.reset_attention_mask:
        batch = dict(batch)
        # the encoded form: Megatron hands attention_mask to every layer, and full recompute
        # passes it through save_for_backward / detach (core/documents.py)
        batch["attention_mask"] = (
            None if documents is None or documents.is_single_document else documents.to_tensor()
        )
    return get_batch_on_this_tsp_rank(
        batch, group_size=size, permute_attention_mask=False, check_single_document=False
    )


def _log_documents(batch, documents) -> None:
    """One line on global rank 0 for the first micro-batch with documents: where they come
    from and how many there are."""
    global _LOGGED_DOCUMENTS
    if documents is None or _LOGGED_DOCUMENTS:
        return
    _LOGGED_DOCUMENTS = True
    if os.environ.get("RANK", "0") != "0":
        return
    samples = len(documents.starts)
    count = sum(len(row) for row in documents.starts)
    print(
        f"[megatron_tsp] packed documents ({tsp_documents.RESET_MASK_FLAG}): read from "
        f"{_RULE.source(batch)}; first micro-batch: {count} documents in {samples} sequences "
        f"of {documents.seq_length} tokens",
        flush=True,
    )


def _wrap(original):
    @functools.wraps(original)
    def get_batch_on_this_cp_rank(batch, *args, **kwargs):
        # documents from the whole sequence, before the CP split slices (and, in place, replaces)
        # the batch's tensors
        documents = batch_documents(batch)
        return tsp_permute_batch(original(batch, *args, **kwargs), documents)

    get_batch_on_this_cp_rank.__wrapped_by_tsp__ = original
    return get_batch_on_this_cp_rank


def install_batch_hook() -> None:
    """Wrap ``get_batch_on_this_cp_rank`` where scripts import it from (idempotent)."""
    for patch in _BATCH_HOOKS:
        patches.apply(patch.mode, patch.target, make=_wrap)


def uninstall_batch_hook() -> None:
    for patch in _BATCH_HOOKS:
        patches.remove(patch.mode, patch.target)
