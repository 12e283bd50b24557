"""(g) bad configurations inside ranks: every rank must raise ValueError, none may hang."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules

from megatron_tsp.core import parallel_state
from tests.common import make_config, reset_groups, setup_tsp


def _error_of(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except ValueError as exc:
        return str(exc)
    return None


def init_with_per_rank_sizes(sizes, **kwargs):
    """Initialise with a TSP size that may differ per rank; return this rank's ValueError text."""
    reset_groups()
    err = _error_of(
        parallel_state.initialize_model_parallel,
        tensor_sequence_parallel_size=sizes[dist.get_rank()],
        create_gloo_process_groups=False,
        **kwargs,
    )
    reset_groups()
    return err


def layer_errors(d):
    """Layers reject shapes the group cannot shard, before any collective."""
    setup_tsp(d)
    errors = {}
    attn_sub = SelfAttentionSubmodules(
        linear_qkv=ColumnParallelLinear,
        core_attention=DotProductAttention,
        linear_proj=RowParallelLinear,
    )
    from megatron_tsp.core.layers.attention import TSPSelfAttention
    from megatron_tsp.core.layers.mlp import TSPMLP

    # Configs built for one device, used on a group of d: the layers check against the group.
    cfg = make_config(1, torch.float32, hidden_size=48, num_attention_heads=6, num_query_groups=6)
    errors["heads"] = _error_of(TSPSelfAttention, cfg, attn_sub, 1, AttnMaskType.causal)
    cfg = make_config(1, torch.float32, hidden_size=48, num_attention_heads=12, num_query_groups=3)
    errors["groups"] = _error_of(TSPSelfAttention, cfg, attn_sub, 1, AttnMaskType.causal)
    cfg = make_config(1, torch.float32, hidden_size=32, ffn_hidden_size=66)
    errors["ffn"] = _error_of(
        TSPMLP, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    )
    cfg = make_config(d, torch.float32, hidden_size=32, num_attention_heads=4)
    layer = TSPSelfAttention(cfg, attn_sub, 1, AttnMaskType.causal)
    errors["local_seq"] = _error_of(layer, torch.randn(3, 1, 32))
    # Settings of the rejection table that reach the layers directly (bypassing the specs).
    for name, overrides in (
        ("qk_layernorm", dict(qk_layernorm=True)),
        ("softmax", dict(softmax_type="learnable")),
        ("window", dict(window_size=(16, 0))),
    ):
        refused = make_config(d, torch.float32, hidden_size=32, num_attention_heads=4, **overrides)
        errors[name] = _error_of(TSPSelfAttention, refused, attn_sub, 1, AttnMaskType.causal)
    from megatron_tsp.core.model import build_tsp_gpt_model

    errors["vocab"] = _error_of(build_tsp_gpt_model, cfg, vocab_size=130, max_sequence_length=32)
    errors["seq"] = _error_of(build_tsp_gpt_model, cfg, vocab_size=128, max_sequence_length=36)
    return errors
