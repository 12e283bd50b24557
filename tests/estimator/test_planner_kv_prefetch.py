"""The planner's model of the hand-off of the first backward K/V re-gather to the MLP backward
(``megatron_tsp.core.layers.kv_prefetch``, tests/test_kv_prefetch.py): hidden where the layers
post it early (saved attention, a TSP MLP in the layer), the exposed fill where they do not
(attention recompute, MoE layers), and nothing else of the schedule changed."""

from dataclasses import replace

import pytest

from megatron_tsp.tools.estimator import formulas as fm
from megatron_tsp.tools.estimator import timing
from megatron_tsp.tools.estimator.planner_inputs import load_hardware, load_model
from megatron_tsp.tools.estimator.strategies import Options, make_strategy


def _overlap(terms):
    return {(t.phase, t.op): t.overlap for t in terms}


def test_regather_overlap_follows_the_layers():
    shape = fm.LayerShape.of(load_model("7b"), 1, 131072)
    saved = _overlap(fm.tsp_layer_terms(shape, 8))
    recompute = _overlap(fm.tsp_layer_terms(shape, 8, recompute_attn=True))
    moe_layer = _overlap(fm.tsp_layer_terms(shape, 8, regather_handoff=False))
    assert saved[("attn_bwd", "all_gather")] == "prefetch"
    assert recompute[("attn_bwd", "all_gather")] == "pipelined"
    assert moe_layer[("attn_bwd", "all_gather")] == "pipelined"
    # only that row differs; the forward gather and the dK/dV reduce-scatter keep their fill
    assert {k: v for k, v in saved.items() if k != ("attn_bwd", "all_gather")} == {
        k: v for k, v in moe_layer.items() if k != ("attn_bwd", "all_gather")
    }
    assert saved[("attn_fwd", "all_gather")] == saved[("attn_bwd", "reduce_scatter")]
    assert saved[("attn_fwd", "all_gather")] == "pipelined"


def test_moe_layers_keep_the_exposed_regather():
    m = load_model("mixtral-8x7b")
    shape = fm.LayerShape.of(m, 1, 32768)
    terms = timing.layer_terms(shape, make_strategy("tsp", 8), Options())
    assert _overlap(terms)[("attn_bwd", "all_gather")] == "pipelined"


@pytest.mark.parametrize("recompute_attn", [False, True])
def test_backward_exposure_is_the_reduce_scatter_fill(recompute_attn):
    """Llama-2-70B / 128k, TSP8 x CP8, full recompute: the backward's exposed communication is
    the first dK/dV reduce-scatter chunk, plus (attention recompute) the first re-gather and the
    first re-broadcast."""
    m, hw = load_model("llama2-70b"), load_hardware("h100")
    s = make_strategy("tsp_cp", 64, tp=8)
    o = replace(Options(compute_model="flops"), tsp_recompute_attn=recompute_attn)
    shape = fm.LayerShape.of(m, 1, 131072)
    layer = timing._layer_time(shape, s, hw, o, full=True)
    first = {
        (t.phase, t.op): timing._term_time(t, s, hw) / t.chunks
        for t in layer["terms"]
        if t.phase == "attn_bwd"
    }
    expected = first[("attn_bwd", "reduce_scatter")]
    if recompute_attn:
        expected += first[("attn_bwd", "all_gather")] + first[("attn_bwd", "broadcast")]
    assert layer["exposed"]["bwd"] == pytest.approx(expected)
