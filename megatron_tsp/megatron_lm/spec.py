"""The TSP block spec as Megatron-LM's ``--spec megatron_tsp.megatron_lm.spec tsp_block_spec``.

A block spec depends on the pipeline stage (how many layers this stage builds), which is known
only when the model is built, not when the arguments are parsed. ``tsp_block_spec`` is therefore a
*function* ``tsp_block_spec(config, vp_stage=None, pp_rank=None)`` that returns the TSP
``TransformerBlockSubmodules`` (TSP layers plus the TSP final norm) for that stage:

* Megatron-LM 0.19 / main builds the model from ``GPTModelConfig.transformer_layer_spec``, which
  may be a callable taking ``(model_config, vp_stage=...)``: it calls this function itself.
* Megatron-LM core_v0.16 hands the ``--spec`` object to ``GPTModel`` as-is.
  ``install_gpt_model_hook`` wraps ``GPTModel.__init__`` so that when (and only when) the spec
  argument is this function, it is resolved with the model's config, ``vp_stage`` and pipeline rank
  before the block is built.

``--normalization``, ``--swiglu``, ``--disable-bias-linear``, ``--group-query-attention`` /
``--num-query-groups`` and ``--position-embedding-type rope`` all reach the TSP layers through the
``TransformerConfig`` (and ``GPTModel``'s rotary embedding), exactly as for the stock local spec.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

from megatron_tsp.core import output_head
from megatron_tsp.core.batch_guard import has_zigzag_layers
from megatron_tsp.megatron_lm import patches


def _transformer_config(config):
    """A ``TransformerConfig`` from either a TransformerConfig or 0.19's ``GPTModelConfig``."""
    inner = getattr(config, "transformer", None)
    return inner if inner is not None else config


def _mark_tsp_groups(config) -> None:
    """Record in ``megatron_tsp.core.parallel_state`` that Megatron's TP group is the TSP group.

    Under Megatron-LM the groups are made by ``megatron.training.initialize`` (Megatron's own
    ``initialize_model_parallel`` with ``tensor_model_parallel_size = D``), not by
    ``megatron_tsp.initialize_model_parallel``; the TSP accessors must still answer.
    """
    from megatron.core import parallel_state as mpu

    from megatron_tsp.core import parallel_state as tsp_ps

    if tsp_ps.is_tensor_sequence_parallel():
        return
    if not mpu.model_parallel_is_initialized():
        return
    tsp_ps.mark_initialized(config.tensor_model_parallel_size)


def tsp_block_spec(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None):
    """TSP ``TransformerBlockSubmodules`` for this pipeline stage (see the module docstring)."""
    from megatron_tsp.core.specs import get_gpt_block_tsp_spec

    cfg = _transformer_config(config)
    _mark_tsp_groups(cfg)
    if _megatron_arg("tsp_kv_grad_all_to_all"):
        # read by TSPSelfAttention from the config (not a TransformerConfig field)
        cfg.tsp_kv_grad_all_to_all = True
    _activation_sums(cfg)
    if _megatron_arg("tsp_moe_ring"):
        # read by get_gpt_block_tsp_spec and the config check (not a TransformerConfig field)
        cfg.tsp_moe_ring = True
    return get_gpt_block_tsp_spec(
        cfg,
        normalization=cfg.normalization,
        vp_stage=vp_stage,
        pp_rank=pp_rank,
        kv_grad_reduce_in_fp32=_megatron_arg("tsp_kv_grad_reduce_in_fp32"),
    )


def _activation_sums(cfg) -> None:
    if _megatron_arg("tsp_activation_sums_in_fp32"):
        # read by the TSP MLP, expert ring and attention (not a TransformerConfig field)
        cfg.tsp_activation_sums_in_fp32 = True


def _megatron_arg(name: str):
    """A TSP flag from Megatron-LM's parsed arguments (None outside a Megatron-LM run or before
    its arguments are parsed): flags that are not ``TransformerConfig`` fields reach the spec
    this way, since ``core_transformer_config_from_args`` copies only the config's fields."""
    try:
        from megatron.training.global_vars import get_args

        return getattr(get_args(), name, None)
    except (ImportError, AssertionError, AttributeError):
        return None


tsp_block_spec.is_tsp_spec = True  # type: ignore[attr-defined]


def tsp_mlp_block_spec(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None):
    """``--tsp-mlp``: the hybrid block (Megatron's TP+SP attention, TSP MLP ring) for this stage.

    Resolved like ``tsp_block_spec``. Megatron's groups are not marked as TSP groups: the
    hybrid's MLP finds the tensor-parallel group itself, and no batch is permuted."""
    from megatron_tsp.core.specs import get_gpt_block_tsp_mlp_spec

    cfg = _transformer_config(config)
    _activation_sums(cfg)
    return get_gpt_block_tsp_mlp_spec(
        cfg, normalization=cfg.normalization, vp_stage=vp_stage, pp_rank=pp_rank
    )


tsp_mlp_block_spec.is_tsp_spec = True  # type: ignore[attr-defined]


def is_tsp_spec(spec) -> bool:
    return getattr(spec, "is_tsp_spec", False) is True


def _pp_rank_of(pg_collection) -> Optional[int]:
    pp = getattr(pg_collection, "pp", None) if pg_collection is not None else None
    if pp is None:
        return None
    import torch.distributed as dist

    return dist.get_rank(pp)


GPT_MODEL = "megatron.core.models.gpt.gpt_model:GPTModel"
_MODEL_HOOK = patches.declare(
    [
        patches.row(
            patches.LAUNCH,
            f"{GPT_MODEL}.__init__",
            "resolves the stage-dependent TSP block spec function (core_v0.16 passes --spec as is)",
            ("self", "config", "transformer_layer_spec", "pg_collection", "vp_stage"),
        )
    ]
)[0]


def describe_attention_backends(model) -> Optional[str]:
    """ "attention backend: aten_flash (default) in 32 TSP attention layers" for the TSP attention
    layers of ``model`` (None when it has none): the kernel each layer chose and why (default,
    or the ``TSP_ATTENTION_KERNEL`` override)."""
    counts = {}
    for module in model.modules():
        text = getattr(module, "attention_kernel_description", None)
        if text is not None:
            counts[text] = counts.get(text, 0) + 1
    if not counts:
        return None
    parts = [
        f"{text} in {n} TSP attention layer{'s' if n > 1 else ''}" for text, n in counts.items()
    ]
    return "attention backend: " + "; ".join(parts)


def describe_moe_schedule(model) -> Optional[str]:
    """ "MoE schedule: TSP expert ring in 1 MoE layer" (or "experts folded onto the TSP axis")
    for a TSP model with MoE layers; None for a model without any or a non-TSP model."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_tsp.core.layers.moe_ring import TSPRingMoELayer

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers or not has_zigzag_layers(model):
        return None
    ring = sum(isinstance(m, TSPRingMoELayer) for m in layers)
    parts = []
    for n, what in (
        (ring, "TSP expert ring"),
        (len(layers) - ring, "experts folded onto the TSP axis"),
    ):
        if n:
            parts.append(f"{what} in {n} MoE layer{'s' if n > 1 else ''}")
    return "MoE schedule: " + "; ".join(parts)


def describe_output_head(model) -> Optional[str]:
    """How a TSP model's last stage computes its loss (None for a non-TSP model or a stage
    without the output layer)."""
    if not has_zigzag_layers(model) or not getattr(model, "post_process", False):
        return None
    weight = output_head.output_weight(model)
    padded_vocab = weight.shape[0] * model.config.tensor_model_parallel_size
    text = output_head.describe(
        output_head.policy_of(model), padded_vocab, weight.shape[1], weight.element_size()
    )
    return f"output layer: {text}"


def _log_attention_backends(model) -> None:
    """Name the attention backend, the MoE schedule and the output layer in the training log
    when the model is built (rank 0)."""
    import os

    if os.environ.get("RANK", "0") != "0":
        return
    texts = (
        describe_attention_backends(model),
        describe_moe_schedule(model),
        describe_output_head(model),
    )
    for text in texts:
        if text is not None:
            print(f"[megatron_tsp] {text}", flush=True)


def _resolve_tsp_spec(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs)
        spec = bound.arguments.get("transformer_layer_spec")
        if is_tsp_spec(spec):
            config = bound.arguments["config"]
            bound.arguments["transformer_layer_spec"] = spec(
                config,
                vp_stage=bound.arguments.get("vp_stage"),
                pp_rank=_pp_rank_of(bound.arguments.get("pg_collection")),
            )
            result = original(*bound.args, **bound.kwargs)
        else:  # 0.19 resolves a callable spec itself: the layers may still be TSP's
            result = original(self, *args, **kwargs)
        if has_zigzag_layers(self):
            output_head.install(self, policy=_megatron_arg("tsp_vocab_ring") or "auto")
        _log_attention_backends(self)
        return result

    return __init__


def install_gpt_model_hook() -> None:
    """Let ``GPTModel(transformer_layer_spec=tsp_block_spec)`` resolve the function (idempotent).

    Any other spec goes through untouched, so stock models built in the same process (the TP+SP
    reference in tests, a teacher model) are unaffected.
    """
    patches.apply(_MODEL_HOOK.mode, _MODEL_HOOK.target, make=_resolve_tsp_spec)


def uninstall_gpt_model_hook() -> None:
    patches.remove(_MODEL_HOOK.mode, _MODEL_HOOK.target)


def tp_sp_block_spec(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None):
    """Megatron's stock local TP+SP block (``get_gpt_block_local_sp_spec``) for machines without
    apex / Transformer Engine, where Megatron's torch norms refuse ``--sequence-parallel``:
    ``--spec megatron_tsp.megatron_lm.spec tp_sp_block_spec`` through the launcher (no TSP flag)
    gives the TP+SP baseline a TSP or ``--tsp-mlp`` run is compared with on CPU."""
    from megatron_tsp.core.specs import get_gpt_block_local_sp_spec

    cfg = _transformer_config(config)
    return get_gpt_block_local_sp_spec(
        cfg, normalization=cfg.normalization, vp_stage=vp_stage, pp_rank=pp_rank
    )


tp_sp_block_spec.is_tsp_spec = True  # type: ignore[attr-defined]
