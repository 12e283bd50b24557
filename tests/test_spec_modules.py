"""What the specs name besides the TSP layers: the sequence-parallel norm and the TSP MLP's spec.

Single process, no group: the norm is a torch module with tagged parameters, and the MLP spec's
log filter is a pure function of the log record.
"""

from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron_tsp.core.layers.mlp import TSPMLP
from megatron_tsp.core.layers.moe_ring import TSPRingMoELayer
from megatron_tsp.core.layers.norm import (
    SequenceParallelLayerNorm,
    SequenceParallelNorm,
    SequenceParallelRMSNorm,
)
from megatron_tsp.core.specs import (
    TSPMLPSpec,
    TSPRingMoESpec,
    _drop_tsp_mlp_notice,
    get_gpt_layer_tsp_spec,
)
from tests.common import make_config

HIDDEN = 16
EPS = 1e-6


def _config(normalization: str, sequence_parallel: bool = True):
    config = make_config(1, torch.float64, hidden_size=HIDDEN, normalization=normalization)
    config.sequence_parallel = sequence_parallel  # the config refuses SP without TP > 1
    return config


def _reference_norm(x, weight, bias, normalization):
    """Textbook LayerNorm / RMSNorm over the last dimension (float64)."""
    if normalization == "LayerNorm":
        centred = x - x.mean(-1, keepdim=True)
        return centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + EPS) * weight + bias
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


@pytest.mark.parametrize(
    "normalization,subclass,torch_norm",
    [
        ("LayerNorm", SequenceParallelLayerNorm, torch.nn.LayerNorm),
        ("RMSNorm", SequenceParallelRMSNorm, torch.nn.RMSNorm),
    ],
)
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_norm_is_the_torch_norm_with_tagged_parameters(
    normalization, subclass, torch_norm, sequence_parallel, seed
):
    config = _config(normalization, sequence_parallel)
    norm = build_module(SequenceParallelNorm, config=config, hidden_size=HIDDEN, eps=EPS)
    assert type(norm) is subclass
    assert isinstance(norm, SequenceParallelNorm) and isinstance(norm, torch_norm)
    assert [name for name, _ in norm.named_parameters()] == (
        ["weight", "bias"] if normalization == "LayerNorm" else ["weight"]
    )
    assert all(p.sequence_parallel is sequence_parallel for p in norm.parameters())
    assert all(p.dtype == torch.float64 for p in norm.parameters())

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    x = torch.randn(5, 3, HIDDEN, generator=gen, dtype=torch.float64)
    bias = norm.bias if normalization == "LayerNorm" else None
    expected = _reference_norm(x, norm.weight, bias, normalization)
    torch.testing.assert_close(norm(x), expected, msg=f"seed={seed}")

    clone = copy.deepcopy(norm)
    assert type(clone) is subclass  # deepcopy / pickle rebuild through __new__ without arguments
    assert type(pickle.loads(pickle.dumps(norm))) is subclass


def test_norm_explicit_normalization_wins_over_config():
    norm = SequenceParallelNorm(_config("LayerNorm"), HIDDEN, EPS, normalization="RMSNorm")
    assert type(norm) is SequenceParallelRMSNorm


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(normalization="Foo"), "--normalization='Foo'"),
        (dict(zero_centered_gamma=True), "--apply-layernorm-1p"),
    ],
)
def test_norm_refuses_by_flag(kw, message):
    with pytest.raises(ValueError, match=message):
        SequenceParallelNorm(_config("LayerNorm"), HIDDEN, **kw)


def test_norm_subclass_refuses_the_other_normalization():
    with pytest.raises(ValueError, match="normalization='RMSNorm'"):
        SequenceParallelLayerNorm(_config("LayerNorm"), HIDDEN, normalization="RMSNorm")


def _notice(spec) -> logging.LogRecord:
    # megatron-core 0.16's TransformerLayer formats the notice from the type of the MLP spec.
    return logging.LogRecord(
        "megatron.core.transformer.transformer_layer",
        logging.WARNING,
        __file__,
        0,
        f"Unknown MLP type: {type(spec)}. Using default kwargs.",
        None,
        None,
    )


def test_tsp_mlp_notice_is_dropped_and_only_that_one():
    spec = get_gpt_layer_tsp_spec().submodules.mlp
    assert isinstance(spec, TSPMLPSpec) and spec.module is TSPMLP
    assert _drop_tsp_mlp_notice(_notice(spec)) is False
    assert _drop_tsp_mlp_notice(_notice(ModuleSpec(module=TSPMLP))) is True  # a user's spec
    other = logging.LogRecord("x", logging.WARNING, __file__, 0, "TSPMLPSpec", None, None)
    assert _drop_tsp_mlp_notice(other) is True
    logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    assert _drop_tsp_mlp_notice in logger.filters
    # the TSP expert ring's MoE layer (a MoELayer subclass: megatron-core 0.16 logs it too)
    ring = get_gpt_layer_tsp_spec(num_experts=4, moe_ring=True).submodules.mlp
    assert isinstance(ring, TSPRingMoESpec) and ring.module is TSPRingMoELayer
    assert _drop_tsp_mlp_notice(_notice(ring)) is False
    assert _drop_tsp_mlp_notice(_notice(ModuleSpec(module=TSPRingMoELayer))) is True
