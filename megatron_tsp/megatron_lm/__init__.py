"""Megatron-LM integration: ``--tensor-sequence-parallel-size D`` in an unmodified
``pretrain_gpt.py``.

* ``install()`` hooks TSP into Megatron-LM's argument parsing/validation, batch path and model
  building (see ``hooks.py``); ``python -m megatron_tsp.megatron_lm.launch pretrain_gpt.py ...``
  calls it.
* ``arguments``: the "tensor-sequence parallel" argument group, translation and rejection of
  unsupported combinations.
* ``spec``: the stage-dependent TSP block spec handed to Megatron's ``--spec``.
* ``batch``: zigzag permutation after Megatron's TP broadcast.
* ``dry_run``: ``--tsp-dry-run``.
* ``configs``: the JSON model/parallel configs in ``configs/`` and their Megatron arguments.
* ``compare``: side-by-side table and loss-curve PNG from Megatron logs or TensorBoard event files
  (``event_files``).

Importing this package does not import Megatron.
"""

import importlib

_EXPORTS = {
    "TSPArgumentError": "megatron_tsp.megatron_lm.arguments",
    "add_tsp_arguments": "megatron_tsp.megatron_lm.arguments",
    "translate_args": "megatron_tsp.megatron_lm.arguments",
    "unsupported_combinations": "megatron_tsp.megatron_lm.arguments",
    "install": "megatron_tsp.megatron_lm.hooks",
    "is_installed": "megatron_tsp.megatron_lm.hooks",
    "uninstall": "megatron_tsp.megatron_lm.hooks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    # Lazy, so that the shell tools (configs, compare) start without importing torch.
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megatron_tsp.megatron_lm' has no attribute {name!r}")
