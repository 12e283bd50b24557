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

The attention mask is left alone: TSP attention never reads it (causality comes from the zigzag
positions), and the launcher turns Megatron's dataloader mask off
(``--no-create-attention-mask-in-dataloader``), so at long sequence lengths no S x S mask is built,
broadcast or permuted. The permuted tensors are marked; under TSP, ``megatron_tsp.core.batch_guard``
makes TSP attention refuse a micro-batch that did not pass through this hook.

Loss normalization is untouched: labels and ``loss_mask`` are permuted like the tokens, the
vocab-parallel cross-entropy gives every rank the per-token loss of the full (permuted) sequence,
and ``sum(loss * mask)`` / ``sum(mask)`` are invariant under a permutation.
"""

from __future__ import annotations

import functools
from typing import Optional

from megatron_tsp.core.batch_contract import check_single_causal_document
from megatron_tsp.core.validation import TSP_FLAG
from megatron_tsp.core.zigzag import get_batch_on_this_tsp_rank
from megatron_tsp.megatron_lm import patches

_ACTIVE_SIZE: Optional[int] = None

# the batch hook's launch patches: one per module from which pretrain scripts import
# ``get_batch_on_this_cp_rank`` by name
_BATCH_HOOKS = patches.declare(
    [
        patches.row(
            patches.LAUNCH,
            "megatron.core.utils:get_batch_on_this_cp_rank",
            "zigzag permutation of each micro-batch after the TP broadcast (0.19 scripts import "
            "it from here)",
            ("batch",),
        ),
        patches.row(
            patches.LAUNCH,
            "megatron.training.utils:get_batch_on_this_cp_rank",
            "zigzag permutation (core_v0.16 scripts import it from here)",
            ("batch",),
            versions=("0.16",),
        ),
    ]
)


def activate(tsp_size: Optional[int]) -> None:
    """Permute batches for a TSP group of ``tsp_size`` ranks (None: pass batches through)."""
    global _ACTIVE_SIZE
    _ACTIVE_SIZE = tsp_size
    from megatron_tsp.core import batch_guard

    batch_guard.enforce(tsp_size is not None)


def active_size() -> Optional[int]:
    return _ACTIVE_SIZE


def tsp_permute_batch(batch):
    """Apply the TSP zigzag to a ``get_batch`` dict when TSP is active (else return it as is)."""
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
    # Megatron's CP split ran first: this rank's slice holds CP chunks c and 2C-1-c
    check_single_causal_document(
        batch, mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
    )
    return get_batch_on_this_tsp_rank(
        batch, group_size=size, permute_attention_mask=False, check_single_document=False
    )


def _wrap(original):
    @functools.wraps(original)
    def get_batch_on_this_cp_rank(batch, *args, **kwargs):
        return tsp_permute_batch(original(batch, *args, **kwargs))

    get_batch_on_this_cp_rank.__wrapped_by_tsp__ = original
    return get_batch_on_this_cp_rank


def install_batch_hook() -> None:
    """Wrap ``get_batch_on_this_cp_rank`` where scripts import it from (idempotent)."""
    for patch in _BATCH_HOOKS:
        patches.apply(patch.mode, patch.target, make=_wrap)


def uninstall_batch_hook() -> None:
    for patch in _BATCH_HOOKS:
        patches.remove(patch.mode, patch.target)
