"""Megatron-LM integration: ``--tensor-sequence-parallel-size D`` in an unmodified ``pretrain_gpt.py``.

* ``install()`` hooks TSP into Megatron-LM's argument parsing/validation, batch path and model
  building (see ``hooks.py``); ``python -m megatron_tsp.launch pretrain_gpt.py ...`` calls it.
* ``arguments``: the "tensor-sequence parallel" argument group, translation and rejection of
  unsupported combinations.
* ``spec``: the stage-dependent TSP block spec handed to Megatron's ``--spec``.
* ``batch``: zigzag permutation after Megatron's TP broadcast.
* ``dry_run``: ``--tsp-dry-run``.
* ``configs``: the JSON model/parallel configs in ``configs/`` and their Megatron arguments.
* ``compare``: side-by-side table and loss-curve PNG from Megatron logs.

Importing this package does not import Megatron.
"""

from megatron_tsp.megatron_lm.arguments import (
    TSPArgumentError,
    add_tsp_arguments,
    translate_args,
    unsupported_combinations,
)
from megatron_tsp.megatron_lm.hooks import install, is_installed, uninstall

__all__ = [
    "TSPArgumentError",
    "add_tsp_arguments",
    "install",
    "is_installed",
    "translate_args",
    "uninstall",
    "unsupported_combinations",
]
