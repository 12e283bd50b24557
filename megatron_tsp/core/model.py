"""Build a megatron-core ``GPTModel`` that runs its transformer layers under TSP."""

from __future__ import annotations

from typing import Optional

from megatron_tsp.core.validation import check_transformer_config


def build_tsp_gpt_model(
    config,
    vocab_size: int,
    max_sequence_length: int,
    seq_length: Optional[int] = None,
    vocab_ring: str = "auto",
    **gpt_kwargs,
):
    """``GPTModel`` with the TSP block spec, after checking every TSP constraint.

    ``config`` is a ``TransformerConfig`` with ``tensor_model_parallel_size = D`` (the TSP group
    size) and ``sequence_parallel = True``; ``seq_length`` (default ``max_sequence_length``) is the
    training sequence length, which must split into 2D zigzag chunks. Raises ``ValueError`` naming
    the setting before any parameter or collective is created. ``vocab_ring``: the policy
    (``output_head.POLICIES``) for computing the loss of a call with labels on the vocabulary
    ring instead of Megatron's output-layer gather and vocab-parallel cross-entropy.
    """
    from megatron.core.models.gpt import GPTModel

    from megatron_tsp.core import output_head
    from megatron_tsp.core.sharding import mark_tensor_parallel
    from megatron_tsp.core.specs import get_gpt_block_tsp_spec

    check_transformer_config(
        config, vocab_size=vocab_size, seq_length=seq_length or max_sequence_length
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_block_tsp_spec(config),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        **gpt_kwargs,
    )
    output_head.install(model, policy=vocab_ring)
    # Megatron marks parallel weights only when it initialises them; loading needs the marks.
    mark_tensor_parallel(model)
    # The model description inference reads (the decode model is built from the same arguments).
    model.tsp_gpt_kwargs = dict(gpt_kwargs)
    return model
