"""Megatron-LM model arguments -> ``TransformerConfig`` fields and ``GPTModel`` arguments.

One mapping for every reader of a Megatron-LM argument set: the args stored in a checkpoint
(``state_dict['args']``, read by ``megatron-tsp generate --load``) and a run config's ``model``
block (``configs/*.json``, Megatron-LM argument names). It follows what Megatron-LM itself does
with the same arguments (``core_transformer_config_from_args`` for the config, ``pretrain_gpt.py``'s
model provider for the GPTModel arguments), for every argument that changes the model's math:
sizes, GQA groups (only with ``group_query_attention``, as Megatron-LM reads them), norm type and
epsilon, activation (SwiGLU / squared ReLU / GeLU), biases (linear and QKV), QK layernorm, tied
embeddings, position embedding type, RoPE base / percent / interleaving / Llama-3 scaling and
factor / linear interpolation factor.

Arguments that would change the math but that this package cannot honour are refused by name
(``UnsupportedModelArgument``) instead of being dropped: ``generate`` would otherwise produce
different tokens from the training run, silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping

# Megatron-LM defaults (megatron/training/arguments.py) for the arguments read below, used when
# an argument set (an older checkpoint, a run config) does not carry the name.
_DEFAULTS = {
    "normalization": "LayerNorm",
    "norm_epsilon": 1e-5,
    "swiglu": False,
    "squared_relu": False,
    "disable_bias_linear": False,
    "add_bias_linear": None,  # the config field name; disable_bias_linear is the flag
    "add_qkv_bias": False,
    "qk_layernorm": False,
    "untie_embeddings_and_output_weights": False,
    "position_embedding_type": "learned_absolute",
    "rotary_percent": 1.0,
    "rotary_base": 10000,
    "rotary_interleaved": False,
    "use_rope_scaling": False,
    "rope_scaling_factor": 8.0,
    "rotary_seq_len_interpolation_factor": None,
    "apply_layernorm_1p": False,
    "num_experts": None,
    "multi_latent_attention": False,
}

# Arguments with a non-default value that the mapping cannot express: (argument, reason).
_REFUSED = (
    ("num_experts", "mixture-of-experts models are not supported by TSP"),
    ("multi_latent_attention", "multi-latent attention is not supported by TSP"),
    ("apply_layernorm_1p", "the 1p (zero-centred gamma) LayerNorm is not mapped"),
)


class UnsupportedModelArgument(ValueError):
    """A Megatron-LM model argument whose value this package cannot reproduce."""


@dataclass
class ModelArgs:
    """What a Megatron-LM argument set says about the model."""

    config: Dict[str, Any] = field(default_factory=dict)  # TransformerConfig fields
    gpt: Dict[str, Any] = field(default_factory=dict)  # GPTModel keyword arguments
    vocab_size: int = 0
    max_sequence_length: int = 0


def _get(m: Mapping[str, Any], name: str):
    value = m.get(name, _DEFAULTS.get(name))
    return _DEFAULTS.get(name) if value is None and name in _DEFAULTS else value


def from_megatron_args(m: Mapping[str, Any]) -> ModelArgs:
    """Map Megatron-LM argument names (``vars(args)`` of a checkpoint, or a run config's model
    block) to config fields and GPTModel arguments. Raises ``UnsupportedModelArgument`` naming the
    argument for settings that cannot be reproduced."""
    import torch.nn.functional as F

    for name, reason in _REFUSED:
        if m.get(name):
            raise UnsupportedModelArgument(f"--{name.replace('_', '-')}={m[name]!r}: {reason}")
    heads = int(m["num_attention_heads"])
    # Megatron-LM reads --num-query-groups only under --group-query-attention (its default of 1
    # would otherwise make every multi-head checkpoint multi-query). A run config has no flag and
    # names the groups directly.
    gqa = m.get("group_query_attention")
    if gqa is None:
        gqa = m.get("num_query_groups") is not None
    groups = int(m["num_query_groups"]) if gqa and m.get("num_query_groups") else heads
    swiglu = bool(_get(m, "swiglu"))
    squared_relu = bool(_get(m, "squared_relu"))
    if swiglu and squared_relu:
        raise UnsupportedModelArgument("--swiglu and --squared-relu are exclusive")
    if swiglu:
        activation = F.silu
    elif squared_relu:
        from megatron.core.activations import squared_relu as activation
    else:
        activation = F.gelu
    add_bias = m.get("add_bias_linear")
    if add_bias is None:
        add_bias = not bool(_get(m, "disable_bias_linear"))
    hidden = int(m["hidden_size"])
    config = dict(
        num_layers=int(m["num_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=int(m.get("ffn_hidden_size") or 4 * hidden),
        kv_channels=m.get("kv_channels"),
        normalization=_get(m, "normalization"),
        layernorm_epsilon=float(_get(m, "norm_epsilon")),
        gated_linear_unit=swiglu,
        activation_func=activation,
        add_bias_linear=bool(add_bias),
        add_qkv_bias=bool(_get(m, "add_qkv_bias")),
        qk_layernorm=bool(_get(m, "qk_layernorm")),
        rotary_interleaved=bool(_get(m, "rotary_interleaved")),
    )
    if config["kv_channels"] is None:
        del config["kv_channels"]
    position = _get(m, "position_embedding_type")
    untied = bool(_get(m, "untie_embeddings_and_output_weights"))
    gpt = dict(position_embedding_type=position, share_embeddings_and_output_weights=not untied)
    if position in ("rope", "yarn", "mrope"):
        gpt.update(
            rotary_percent=float(_get(m, "rotary_percent")),
            rotary_base=int(_get(m, "rotary_base")),
            rope_scaling=bool(_get(m, "use_rope_scaling")),
            rope_scaling_factor=float(_get(m, "rope_scaling_factor")),
            seq_len_interpolation_factor=_get(m, "rotary_seq_len_interpolation_factor"),
        )
    vocab = m.get("padded_vocab_size") or m["vocab_size"]
    seq = m.get("max_position_embeddings") or m["seq_length"]
    return ModelArgs(config=config, gpt=gpt, vocab_size=int(vocab), max_sequence_length=int(seq))
