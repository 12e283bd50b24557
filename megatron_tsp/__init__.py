"""megatron-tsp: Tensor + Sequence Parallelism (TSP) for Megatron-LM / megatron-core.

One process-group axis of size D (Megatron's tensor-parallel ranks) holds 1/D of every layer's
weights and 1/D of the tokens (zigzag chunks). Weights move, tokens stay.

Public names are imported lazily so ``python -m megatron_tsp.megatron_lm.launch`` and the CLI
start fast.
"""

from __future__ import annotations

import importlib
import os as _os

if _os.environ.get("MEGATRON_TSP_WARNINGS"):  # a rank spawned by a megatron-tsp tool
    from megatron_tsp.console import quiet as _quiet  # hides what the tool hides (console/quiet.py)

    _quiet.install_from_env()

__version__ = "0.1.0"

_EXPORTS = {
    # parallel state
    "initialize_model_parallel": "megatron_tsp.core.parallel_state",
    "destroy_model_parallel": "megatron_tsp.core.parallel_state",
    "get_tensor_sequence_parallel_group": "megatron_tsp.core.parallel_state",
    "get_tensor_sequence_parallel_world_size": "megatron_tsp.core.parallel_state",
    "get_tensor_sequence_parallel_rank": "megatron_tsp.core.parallel_state",
    "is_tensor_sequence_parallel": "megatron_tsp.core.parallel_state",
    # zigzag sequence sharding
    "TSPLayout": "megatron_tsp.core.layout",
    "get_batch_on_this_tsp_rank": "megatron_tsp.core.zigzag",
    # layers, specs, model
    "TSPSelfAttention": "megatron_tsp.core.layers.attention",
    "TSPMLP": "megatron_tsp.core.layers.mlp",
    "SequenceParallelNorm": "megatron_tsp.core.layers.norm",  # LayerNorm/RMSNorm, SP-tagged
    "get_gpt_layer_tsp_spec": "megatron_tsp.core.specs",
    "get_gpt_block_tsp_spec": "megatron_tsp.core.specs",
    "get_gpt_layer_tsp_mlp_spec": "megatron_tsp.core.specs",  # TP+SP attention + TSP MLP
    "get_gpt_block_tsp_mlp_spec": "megatron_tsp.core.specs",
    "build_tsp_gpt_model": "megatron_tsp.core.model",
    # tools
    "CommCounter": "megatron_tsp.tools.comm_counter",
    "enable_cpu_support": "megatron_tsp.megatron_lm.cpu_support",
    "install": "megatron_tsp.megatron_lm.hooks",
}

__all__ = sorted(_EXPORTS) + ["zigzag"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in ("zigzag", "parallel_state", "comm", "specs", "sharding", "validation"):
        return importlib.import_module(f"megatron_tsp.core.{name}")
    raise AttributeError(f"module 'megatron_tsp' has no attribute {name!r}")
