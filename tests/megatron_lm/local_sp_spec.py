"""``--spec tests.megatron_lm.local_sp_spec block_spec``: stock TP + SP on CPU for the real-loop
tests. Megatron's local layers (``get_gpt_layer_local_spec``) with the norm that accepts
sequence-parallel activations (Megatron's CPU norm asserts they are off); two layers, one pipeline
stage (core_v0.16 takes ``--spec`` objects as they are)."""

from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_tsp.core.layers.norm import SequenceParallelNorm
from megatron_tsp.core.specs import get_gpt_layer_local_sp_spec

NUM_LAYERS = 2

block_spec = TransformerBlockSubmodules(
    layer_specs=[get_gpt_layer_local_sp_spec()] * NUM_LAYERS, layer_norm=SequenceParallelNorm
)
