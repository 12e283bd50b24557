"""Loud failure when a micro-batch reaches TSP attention without the zigzag permutation.

Under Megatron-LM, TSP relies on ``get_batch_on_this_tsp_rank`` running on every micro-batch
(the launcher wraps ``get_batch_on_this_cp_rank``, which ``pretrain_gpt.get_batch`` calls after
the TP broadcast). If a future ``pretrain_gpt.py`` stopped calling that function, TSP attention
would run on unpermuted tokens — Megatron's contiguous sequence shards instead of the zigzag
chunks — with the wrong causal structure and no error. So:

* ``get_batch_on_this_tsp_rank`` marks the tensors it returns (``mark_zigzagged``);
* while the launcher's TSP mode is active, ``GPTModel.forward`` on a stage that embeds tokens
  (``pre_process``) records whether its ``input_ids`` carry the mark (``guard_model_forward``);
* TSP attention calls ``check_attention_input()`` and refuses, naming the hook, to run inside a
  forward whose tokens were not marked.

Outside a guarded forward (megatron-core users calling the layers or ``GPTModel`` themselves,
activation recomputation during backward) nothing is checked.
"""

from __future__ import annotations

import functools
import threading
from typing import Optional

import torch

_MARK = "_tsp_zigzag_group_size"
HOOK_NAME = "get_batch_on_this_tsp_rank"

_state = threading.local()
_ENFORCED = False


class UnpermutedBatchError(RuntimeError):
    """A micro-batch reached TSP attention without passing through the zigzag batch hook."""


def mark_zigzagged(tensor: Optional[torch.Tensor], group_size: int) -> None:
    if torch.is_tensor(tensor):
        setattr(tensor, _MARK, group_size)


def zigzag_mark(tensor) -> Optional[int]:
    return getattr(tensor, _MARK, None) if torch.is_tensor(tensor) else None


def _current() -> Optional[dict]:
    return getattr(_state, "forward", None)


def check_attention_input() -> None:
    """Called by TSP attention before it runs. Raises ``UnpermutedBatchError`` inside a guarded
    ``GPTModel.forward`` whose tokens did not come out of ``get_batch_on_this_tsp_rank``."""
    current = _current()
    if current is None or current["zigzagged"]:
        return
    raise UnpermutedBatchError(
        "TSP attention refuses a micro-batch that did not pass through "
        f"{HOOK_NAME} (megatron_tsp's zigzag batch hook, installed on Megatron's "
        "get_batch_on_this_cp_rank): the tokens are in natural order, so every rank would attend "
        "over the wrong chunks. The training script's get_batch must call "
        "get_batch_on_this_cp_rank after get_batch_on_this_tp_rank (as pretrain_gpt.py does), or "
        f"call megatron_tsp.{HOOK_NAME} on the batch itself"
        + (f"; got input_ids of shape {tuple(current['shape'])}" if current.get("shape") else "")
    )


def has_zigzag_layers(model) -> bool:
    """Whether ``model`` has layers that read the zigzag batch (a class attribute
    ``needs_zigzag_batch``: TSP attention), cached on the model."""
    cached = getattr(model, "_tsp_has_zigzag_layers", None)
    if cached is None:
        cached = any(getattr(m, "needs_zigzag_batch", False) for m in model.modules())
        model._tsp_has_zigzag_layers = cached
    return cached


def guard_model_forward(original):
    @functools.wraps(original)
    def forward(self, input_ids=None, *args, **kwargs):
        if not (
            _ENFORCED
            and getattr(self, "pre_process", False)
            and torch.is_tensor(input_ids)
            and has_zigzag_layers(self)
        ):
            return original(self, input_ids, *args, **kwargs)
        previous = _current()
        _state.forward = {"zigzagged": zigzag_mark(input_ids) is not None, "shape": input_ids.shape}
        try:
            return original(self, input_ids, *args, **kwargs)
        finally:
            _state.forward = previous

    forward.__tsp_guard__ = True
    return forward


def enforce(on: bool) -> None:
    """Turn the check on or off (the launcher wraps ``GPTModel.forward`` with
    ``guard_model_forward``: a ``launch`` row of ``megatron_tsp.megatron_lm.patches``)."""
    global _ENFORCED
    _ENFORCED = on
