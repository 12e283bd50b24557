"""Megatron ``ModuleSpec``s that put the TSP layers into a stock ``GPTModel``.

``get_gpt_layer_tsp_spec`` is the transformer-layer spec; ``get_gpt_block_tsp_spec`` wraps it into
``TransformerBlockSubmodules`` whose final norm is ``SequenceParallelNorm`` too (with a bare
layer spec Megatron would use its default final norm, which rejects sequence-parallel configs
without apex/TE).
Parameter holders are Megatron's own Column/RowParallelLinear, so every parameter name matches
``get_gpt_layer_local_spec`` and a TP=D + SP checkpoint.

Mixture-of-Experts ("EP folded onto the TSP axis"): a layer whose ``moe_layer_freq`` entry is 1
gets megatron-core's own ``MoELayer`` (router, token dispatcher, ``SequentialMLP`` experts, shared
experts) from Megatron's local MoE spec, with TSP attention in front of it. The MoE layer is
token-wise and its input is this rank's S/D tokens (two zigzag chunks instead of TP+SP's one
contiguous block), so it runs unchanged: the experts are spread over the expert-model-parallel
group (``--expert-model-parallel-size``, folded onto the TSP ranks, expert-tensor-parallel size 1)
and the dispatcher exchanges exactly the tokens it exchanges under TP+SP. The router's load
balancing statistics are summed over ``pg_collection.tp_cp``, which is the TSP group here, so the
aux loss sees the same token set as under TP+SP (docs/moe.md).

The TSP expert ring (``config.tsp_moe_ring``, Megatron-LM ``--tsp-moe-ring``): every rank holds
1/D of every expert (expert-tensor-parallel size D, expert-model-parallel size 1), tokens stay on
their rank and each expert's weight shards circulate on the MLP's P2P ring
(``megatron_tsp/core/layers/moe_ring.py``).

``get_gpt_layer_tsp_mlp_spec`` / ``get_gpt_block_tsp_mlp_spec`` are the hybrid for a TP+SP run
(Megatron-LM ``--tsp-mlp``): Megatron's local layer spec with only the MLP replaced by the TSP
MLP ring; no zigzag, no batch permutation.
"""

from __future__ import annotations

import logging
from typing import List, Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_tsp.core import rejections
from megatron_tsp.core.layers.attention import TSPSelfAttention
from megatron_tsp.core.layers.mlp import TSPMLP
from megatron_tsp.core.layers.norm import SequenceParallelNorm


class TSPMLPSpec(ModuleSpec):
    """``ModuleSpec`` of ``TSPMLP``; its own type names it in megatron-core's log.

    megatron-core 0.16's ``TransformerLayer`` passes ``tp_group`` only to an MLP spec whose module
    is exactly ``MLP`` (or an MoE / TE class) and logs, once per layer, "Unknown MLP type ...
    Using default kwargs" for any other. For ``TSPMLP`` the default is right (it finds its group
    with ``resolve_group``), so ``_drop_tsp_mlp_notice`` filters out exactly those records: the
    message names this class, so a user's own unknown MLP still gets its warning. (0.19 has
    neither the branch nor the log.)
    """


class TSPRingMoESpec(ModuleSpec):
    """``ModuleSpec`` of the TSP expert ring's MoE layer (``TSPRingMoELayer``), named for the same
    reason as ``TSPMLPSpec``: megatron-core 0.16's ``TransformerLayer`` hands ``pg_collection``
    only to an MLP spec whose module is exactly ``MoELayer`` and logs "Unknown MLP type" for a
    subclass; ``TSPRingMoELayer`` then takes megatron-core's default process groups (the MoE
    layer's own fallback), which are the groups this layer needs, so the notice is dropped."""


_TRANSFORMER_LAYER_LOGGER = "megatron.core.transformer.transformer_layer"


def _drop_tsp_mlp_notice(record: logging.LogRecord) -> bool:
    """Logging filter: False (drop) for megatron-core's "Unknown MLP type" notice about a
    ``TSPMLPSpec`` or ``TSPRingMoESpec``, True for everything else."""
    message = record.getMessage()
    return not (
        message.startswith("Unknown MLP type:")
        and any(f"{c.__module__}.{c.__qualname__}" in message for c in (TSPMLPSpec, TSPRingMoESpec))
    )


if _drop_tsp_mlp_notice not in logging.getLogger(_TRANSFORMER_LAYER_LOGGER).filters:
    logging.getLogger(_TRANSFORMER_LAYER_LOGGER).addFilter(_drop_tsp_mlp_notice)


def _tsp_mlp_spec(recompute_activation: bool) -> TSPMLPSpec:
    """The TSP MLP over Megatron's own Column/RowParallelLinear (TP=D parameter names)."""
    return TSPMLPSpec(
        module=TSPMLP,
        params={"recompute_activation": recompute_activation},
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )


def _moe_spec(num_experts: int, moe_grouped_gemm: bool = False) -> ModuleSpec:
    """megatron-core's ``MoELayer`` spec with its local (non-TE) modules: ``SequentialMLP``
    experts and a ``SharedExpertMLP`` over Column/RowParallelLinear. Nothing of TSP inside."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

    return get_moe_module_spec_for_backend(
        backend=LocalSpecProvider(), num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm
    )


def _moe_ring_spec(num_experts: int) -> ModuleSpec:
    """The TSP expert ring (``--tsp-moe-ring``): megatron-core's local MoE spec with
    ``TSPRingMoELayer`` (local dispatcher) and ``TSPRingExperts`` (a ``SequentialMLP`` whose
    experts, sharded 1/D per rank like ETP=D, run on the weight ring); router and shared expert
    are Megatron's (``megatron_tsp/core/layers/moe_ring.py``)."""
    import copy
    import dataclasses
    import functools

    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_tsp.core.layers.moe_ring import TSPRingExperts, TSPRingMoELayer

    stock = copy.deepcopy(_moe_spec(num_experts))
    if isinstance(stock, functools.partial):
        # megatron-core 0.19: the MoE spec is a builder, partial(MoELayer, submodules=...), whose
        # experts are partial(SequentialMLP, submodules=...); the ring keeps both submodules
        submodules = stock.keywords["submodules"]
        experts = submodules.experts
        if not (isinstance(experts, functools.partial) and experts.func is SequentialMLP):
            raise TypeError(f"the TSP expert ring replaces SequentialMLP experts, got {experts!r}")
        experts = functools.partial(TSPRingExperts, *experts.args, **experts.keywords)
        return TSPRingMoESpec(
            module=TSPRingMoELayer,
            submodules=dataclasses.replace(submodules, experts=experts),
        )
    stock.submodules.experts.module = TSPRingExperts
    return TSPRingMoESpec(
        module=TSPRingMoELayer,
        params=stock.params,
        submodules=stock.submodules,
        metainfo=stock.metainfo,
    )


def get_gpt_layer_tsp_spec(
    normalization: Optional[str] = None,
    qk_layernorm: bool = False,
    num_experts: Optional[int] = None,
    multi_latent_attention: bool = False,
    attention_backward: Optional[str] = None,
    mlp_recompute_activation: bool = False,
    kv_grad_reduce_in_fp32: Optional[bool] = None,
    moe_grouped_gemm: bool = False,
    moe_ring: bool = False,
) -> ModuleSpec:
    """TransformerLayer spec with TSP attention and the TSP MLP, or, with ``num_experts``,
    megatron-core's ``MoELayer`` (local modules) as the MLP (see the module docstring).

    ``normalization`` is accepted for parity with Megatron's spec getters; the norm follows
    ``config.normalization`` ("LayerNorm" or "RMSNorm") when the model is built.
    ``attention_backward``: None follows Megatron's recompute options (selective recompute of
    ``core_attn``, i.e. ``--recompute-activations``, means "recompute", else "saved"); "saved"
    keeps each head group's local q/k/v, output and log-sum-exp (no attention recompute),
    "recompute" keeps only the layer input. ``mlp_recompute_activation``: False (default) keeps
    the per-shard fc1 outputs (TP+SP's activation memory, no recompute; Megatron's selective
    ``"mlp"`` / full recompute then apply as in any Megatron model); True is TSP's opt-in that
    recomputes each shard's fc1 in backward (the [s/D, b, ffn] intermediate is never kept).
    ``kv_grad_reduce_in_fp32``: the attention's dK/dV reduce-scatter travels in the accumulation
    dtype (fp32 for bf16/fp16; Megatron-LM flag ``--tsp-kv-grad-reduce-in-fp32``) instead of
    the compute dtype; None follows ``config.tsp_kv_grad_reduce_in_fp32`` (default False).
    ``moe_ring`` (with ``num_experts``): the TSP expert ring instead of experts folded onto the
    TSP axis (docs/moe.md; the config needs expert-tensor-parallel size D, expert-model-parallel
    size 1).
    """
    rejections.check_values(
        {
            "qk_layernorm": qk_layernorm,
            "num_moe_experts": num_experts,
            "multi_latent_attention": multi_latent_attention,
            "moe_grouped_gemm": moe_grouped_gemm,
        },
        d=None,
    )
    if normalization not in (None, "LayerNorm", "RMSNorm"):
        raise ValueError(f"--normalization={normalization!r}: TSP supports LayerNorm and RMSNorm")
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=SequenceParallelNorm,
            self_attention=ModuleSpec(
                module=TSPSelfAttention,
                params={
                    "attn_mask_type": AttnMaskType.causal,
                    "attention_backward": attention_backward,
                    "kv_grad_reduce_in_fp32": kv_grad_reduce_in_fp32,
                },
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=DotProductAttention,
                    linear_proj=RowParallelLinear,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=SequenceParallelNorm,
            mlp=(
                _tsp_mlp_spec(mlp_recompute_activation)
                if num_experts is None
                else (
                    _moe_ring_spec(num_experts)
                    if moe_ring
                    else _moe_spec(num_experts, moe_grouped_gemm)
                )
            ),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def _num_layers_on_stage(config, vp_stage: Optional[int], pp_rank: Optional[int]) -> int:
    """Layers this pipeline (virtual) stage builds; megatron-core 0.16 has no ``pp_rank``."""
    try:
        return get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    except TypeError:  # older signature without pp_rank
        return get_num_layers_to_build(config, vp_stage=vp_stage)


def moe_layer_pattern(config) -> List[int]:
    """1 for an MoE layer, 0 for a dense one, for every layer of the model (all pipeline stages),
    from ``config.moe_layer_freq`` exactly as megatron-core's ``get_gpt_decoder_layer_specs``
    reads it (an int N: every N-th layer from the first; a list: one entry per layer). All zeros
    without experts."""
    n = config.num_layers
    if config.num_moe_experts is None:
        return [0] * n
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(n)]
    if isinstance(freq, list):
        if len(freq) != n or any(v not in (0, 1) for v in freq):
            raise ValueError(
                f"--moe-layer-freq={freq}: needs one 0 (dense) or 1 (MoE) per layer "
                f"(--num-layers={n})"
            )
        return list(freq)
    raise ValueError(f"--moe-layer-freq={freq!r}: an int or a list of 0/1 per layer")


def _layer_ids_on_stage(config, vp_stage: Optional[int], pp_rank: Optional[int]) -> List[int]:
    """Global (0-based) ids of the layers this pipeline (virtual) stage builds."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        from megatron.core.transformer.enums import LayerType

        return list(
            layout.get_layer_id_list(
                layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank
            )
        )
    try:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    except TypeError:  # older signature without pp_rank
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    return list(range(offset, offset + _num_layers_on_stage(config, vp_stage, pp_rank)))


def get_gpt_block_tsp_spec(
    config,
    normalization: Optional[str] = None,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
    kv_grad_reduce_in_fp32: Optional[bool] = None,
) -> TransformerBlockSubmodules:
    """Block spec for this pipeline stage: TSP layers plus the TSP final norm. With
    ``config.num_moe_experts`` the layers ``moe_layer_pattern`` marks 1 are MoE layers
    (TSP attention + megatron-core's ``MoELayer``, or with ``config.tsp_moe_ring`` the TSP expert
    ring), the others dense TSP layers (``kv_grad_reduce_in_fp32``: see
    ``get_gpt_layer_tsp_spec``)."""
    from megatron_tsp.core.validation import check_transformer_config

    check_transformer_config(config)
    kwargs = dict(
        normalization=normalization or config.normalization,
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
        kv_grad_reduce_in_fp32=kv_grad_reduce_in_fp32,
    )
    dense = get_gpt_layer_tsp_spec(**kwargs)
    if config.num_moe_experts is None:
        num_layers = _num_layers_on_stage(config, vp_stage, pp_rank)
        return TransformerBlockSubmodules(
            layer_specs=[dense] * num_layers, layer_norm=SequenceParallelNorm
        )
    moe = get_gpt_layer_tsp_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        moe_ring=bool(getattr(config, "tsp_moe_ring", False)),
        **kwargs,
    )
    pattern = moe_layer_pattern(config)
    layers = [moe if pattern[i] else dense for i in _layer_ids_on_stage(config, vp_stage, pp_rank)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=SequenceParallelNorm)


# Module attributes for Megatron-LM's ``--spec megatron_tsp.core.specs <name>``.
gpt_tsp_layer_spec = get_gpt_layer_tsp_spec()


def get_gpt_layer_local_sp_spec(normalization: Optional[str] = None) -> ModuleSpec:
    """Megatron's stock local layer spec (TP / TP+SP baseline) with a norm that accepts
    sequence-parallel configs on machines without apex / Transformer Engine. Only the norm class
    differs from ``get_gpt_layer_local_spec``; the linear layers and attention are Megatron's."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=normalization))
    spec.submodules.input_layernorm = SequenceParallelNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelNorm
    return spec


def get_gpt_block_local_sp_spec(
    config,
    normalization: Optional[str] = None,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """Block spec of the TP / TP+SP baseline (``get_gpt_layer_local_sp_spec`` + final norm).

    With experts: Megatron's own local decoder layers (``get_gpt_decoder_layer_specs``: dense or
    MoE per ``moe_layer_freq``) for this stage, with the same sequence-parallel-tagged norms."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs

    normalization = normalization or config.normalization
    if config.num_moe_experts is None:
        layer = get_gpt_layer_local_sp_spec(normalization)
        num_layers = _num_layers_on_stage(config, vp_stage, pp_rank)
        return TransformerBlockSubmodules(
            layer_specs=[layer] * num_layers, layer_norm=SequenceParallelNorm
        )
    every_layer = get_gpt_decoder_layer_specs(config, False, normalization)
    layers = []
    for i in _layer_ids_on_stage(config, vp_stage, pp_rank):
        spec = copy.deepcopy(every_layer[i])
        spec.submodules.input_layernorm = SequenceParallelNorm
        spec.submodules.pre_mlp_layernorm = SequenceParallelNorm
        layers.append(spec)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=SequenceParallelNorm)


# ---------------------------------------------------------------------------------------------
# TP+SP attention + TSP MLP ("--tsp-mlp")
# ---------------------------------------------------------------------------------------------
def get_gpt_layer_tsp_mlp_spec(
    normalization: Optional[str] = None,
    num_experts: Optional[int] = None,
    mlp_recompute_activation: bool = False,
) -> ModuleSpec:
    """TransformerLayer spec of the hybrid: Megatron's own TP+SP attention, TSP's MLP ring.

    Under TP=D + sequence parallelism the MLP's input is already sequence-sharded ([s/D, b, h]
    per rank, contiguous blocks) and the MLP is token-wise, so the TSP weight ring replaces
    ColumnParallelLinear's activation all-gather before fc1 and RowParallelLinear's
    reduce-scatter after fc2. No zigzag and no batch permutation: the attention (and everything
    outside the MLP) is ``get_gpt_layer_local_spec``'s, the MLP parameters are the same
    Column/RowParallelLinear TP=D shards, so state dicts and checkpoints are TP=D+SP's.
    """
    rejections.check_values({"num_moe_experts": num_experts}, d=None, mode=rejections.TSP_MLP)
    if normalization not in (None, "LayerNorm", "RMSNorm"):
        raise ValueError(
            f"--normalization={normalization!r}: --tsp-mlp supports LayerNorm and RMSNorm"
        )
    spec = get_gpt_layer_local_sp_spec(normalization)
    spec.submodules.mlp = _tsp_mlp_spec(mlp_recompute_activation)
    return spec


def get_gpt_block_tsp_mlp_spec(
    config,
    normalization: Optional[str] = None,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """Block spec for this pipeline stage: hybrid layers (``get_gpt_layer_tsp_mlp_spec``) plus
    the sequence-parallel-tagged final norm."""
    from megatron_tsp.core.validation import check_tsp_mlp_config

    check_tsp_mlp_config(config)
    layer = get_gpt_layer_tsp_mlp_spec(
        normalization=normalization or config.normalization, num_experts=config.num_moe_experts
    )
    num_layers = _num_layers_on_stage(config, vp_stage, pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * num_layers, layer_norm=SequenceParallelNorm
    )
