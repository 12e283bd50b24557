"""The arguments a TSP run stores in its checkpoints are a stock run's.

Megatron-LM saves its live ``args`` in every checkpoint (``state_dict['args']``, written by
``megatron.training.checkpointing.generate_state_dict``) and ``--use-checkpoint-args`` copies
fields of them into the loading run before ``validate_args`` -- ``spec`` among them, with
``force=True``. A TSP run's live args hold the translation (``spec = megatron_tsp.megatron_lm.spec
tsp_block_spec``, set by the launcher) and the TSP-only flags; stored as they are, a stock
Megatron-LM run loading the checkpoint with ``--use-checkpoint-args`` would build its model from
the TSP spec (and fail without the launcher's hooks, or silently run TSP layers).

``install()`` (``hooks.py``) therefore wraps ``generate_state_dict``: the stored args are a copy
with the user's own ``--spec`` in place of any ``megatron_tsp.megatron_lm.spec`` spec (``None``
unless one was given; ``tsp_replaced_spec`` keeps it) and without the TSP-only attributes
(``tensor_sequence_parallel_size`` and every ``tsp_*``, e.g. ``--tsp-mlp``'s ``tsp_mlp``).
Everything else -- ``tensor_model_parallel_size = D`` and ``sequence_parallel`` included -- is what
TP=D + SP stores, which is what the checkpoint is. A TSP run that loads it with
``--use-checkpoint-args`` is translated again by ``validate_args`` (which runs after Megatron copies
the checkpoint's args).
"""

from __future__ import annotations

import copy
import functools

from megatron_tsp.megatron_lm import arguments as tsp_args

TSP_ONLY_ATTRIBUTES = ("tensor_sequence_parallel_size",)
TSP_ONLY_PREFIX = "tsp_"


def is_tsp_only(name: str) -> bool:
    return name in TSP_ONLY_ATTRIBUTES or name.startswith(TSP_ONLY_PREFIX)


def stock_args(args):
    """A shallow copy of ``args`` as a stock Megatron-LM run with the same layout would have them
    (``args`` itself is unchanged). Non-TSP args are returned as they are."""
    spec = list(getattr(args, "spec", None) or [])
    tsp_spec = bool(spec) and spec[0] == tsp_args.SPEC_MODULE  # any TSP spec (TSP, --tsp-mlp)
    if not tsp_spec and not any(is_tsp_only(name) for name in vars(args)):
        return args
    stored = copy.copy(args)
    user_spec = getattr(args, "tsp_replaced_spec", None)
    if tsp_spec:
        stored.spec = list(user_spec) if user_spec else None
    for name in list(vars(stored)):
        if is_tsp_only(name):
            delattr(stored, name)
    return stored


def wrap_generate_state_dict(original):
    @functools.wraps(original)
    def generate_state_dict(args, *rest, **kwargs):
        state_dict = original(args, *rest, **kwargs)
        if isinstance(state_dict, dict) and state_dict.get("args") is args:
            state_dict["args"] = stock_args(args)
        return state_dict

    return generate_state_dict
