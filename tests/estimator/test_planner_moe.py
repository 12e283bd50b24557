"""The planner (``megatron-tsp plan``) on MoE models.

* its peak memory (``analytic_memory``: params by layer type, what megatron-core's MoE layer
  saves, the MoE backward's working set, both TSP schedules and TP+SP with the experts folded)
  agrees with the fake-tensor tool within 5%, with and without full recompute: 8 experts top-2
  (2 per rank), 4 experts (one per rank), and 16 experts top-4 behind a dense layer with a
  shared expert (about 1 min each);
* its MoE communication terms are ``estimator.moe``'s counted formulas (tests/test_moe.py and
  test_memory_moe.py count those against the issued collectives) plus the shared expert's TP+SP
  terms; its MoE FLOPs are k experts per token plus router and shared expert;
* ``auto`` picks the schedule that fits and trains faster; strategies without an MoE model are
  refused by name; the CLI prints the schedule and the crossover.
"""

import json

import pytest

from megatron_tsp.core.model_shape import ModelShape, load_model
from megatron_tsp.tools.comm_counter import received_fraction
from megatron_tsp.tools.estimator import formulas as fm
from megatron_tsp.tools.estimator import moe, planner
from megatron_tsp.tools.estimator.formulas import LayerShape
from tests.estimator.planner_check import run


def _fake_vs_planned(*args):
    return run("planner_moe_vs_fake.py", args, timeout=900)


@pytest.mark.parametrize(
    "experts,topk,layers,shared",
    [(8, 2, 2, 0), (4, 2, 2, 0), (16, 4, 3, 512)],
    ids=["8-experts", "1-expert-per-rank", "dense-then-moe-shared"],
)
def test_planner_moe_memory_matches_fake_tool(experts, topk, layers, shared):
    rows = _fake_vs_planned(experts, topk, layers, 8192, 4, shared)
    assert len(rows) == 7
    for r in rows:
        err = r["planned"] / r["measured"] - 1
        print(
            f"{r['layout']:<28} measured {r['measured'] / 1e6:8.1f} MB ({r['measured_phase']}) "
            f"planned {r['planned'] / 1e6:8.1f} MB {100 * err:+.1f}%"
        )
    for r in rows:
        assert abs(r["planned"] / r["measured"] - 1) <= 0.05, r


def _mlp_bytes(terms):
    return sum(t.nbytes for t in terms if t.phase.startswith("mlp"))


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-v2-lite"])
def test_planner_moe_terms_are_the_counted_formulas(name):
    m, d, seq = load_model(name), 8, 32768
    shape = LayerShape.of(m, 1, seq)
    tokens = seq // d
    router = received_fraction("all_reduce", d) * 8 * m.num_experts
    shared = _mlp_bytes(fm.tp_sp_layer_terms(shape, d)) if m.moe_shared_ffn else 0.0
    for schedule, dispatcher, expected in (
        ("ring", "alltoall", moe.ring_received(m, d)),
        ("folded", "alltoall", moe.alltoall_expected_received(m, d, tokens) + router),
        ("folded", "allgather", moe.allgather_received(m, d, d, tokens)),
    ):
        terms = moe.comm_terms(shape, d, schedule, dispatcher)
        assert _mlp_bytes(terms) == pytest.approx(expected + shared, rel=1e-12), schedule
        # the attention's terms stay the dense layer's
        o = planner.Options(moe_schedule=schedule, moe_dispatcher=dispatcher)
        full = planner.layer_terms(shape, planner.make_strategy("tsp", d), o)
        # ... of a dense layer whose MLP is not the TSP MLP: no MLP backward posts the attention's
        # first K/V re-gather (layers.kv_prefetch), so it stays the exposed fill
        dense = fm.tsp_layer_terms(moe.dense_layer(shape), d, regather_handoff=False)
        attn = [t for t in dense if t.phase.startswith("attn")]
        assert [t for t in full if t.phase.startswith("attn")] == attn


def test_planner_moe_flops_are_k_experts_per_token():
    m = load_model("deepseek-v2-lite")
    shape = LayerShape.of(m, 1, 4096)
    fl = fm.layer_flops(shape)
    dense = fm.layer_flops(moe.dense_layer(shape))
    tokens = 4096
    experts = 2 * tokens * m.moe_topk * m.w_expert
    extra = 2 * tokens * (m.num_experts * m.hidden + m.w_shared_expert)
    mlp_dense = 2 * tokens * (m.w_fc1 + m.w_fc2)
    assert fl["fwd_matmul"] - dense["fwd_matmul"] == pytest.approx(experts + extra - mlp_dense)


def test_planner_moe_auto_takes_the_faster_schedule_and_refuses_other_strategies():
    m = load_model("mixtral-8x7b")
    s = planner.make_strategy("tsp", 8)
    by = {
        x: planner.evaluate(m, "mi300x", s, 131072, 64, planner.Options(moe_schedule=x))
        for x in ("folded", "ring", "auto")
    }
    faster = max(("folded", "ring"), key=lambda x: (by[x]["fits"], by[x]["tokens_per_s"]))
    assert by["auto"]["moe_schedule"] == faster
    assert by["auto"]["tokens_per_s"] == by[faster]["tokens_per_s"]
    other = "ring" if faster == "folded" else "folded"
    assert by["auto"]["moe_alternative"]["schedule"] == other
    # the memory difference the choice rests on: the ring saves [C, rows] per MoE layer, the
    # folded experts [C, rows + 4F]
    assert by["ring"]["memory_total_bytes"]["none"] < by["folded"]["memory_total_bytes"]["none"]
    with pytest.raises(ValueError, match="strategy cp: the planner models MoE layers"):
        planner.analytic_memory(m, "cp", 32768, degree=8)


def test_planner_moe_cli(capsys):
    args = ["--model", "mixtral-8x7b", "--seq-length", "131072", "--gpus", "64", "--plot", ""]
    assert planner.main(args) == 0
    out = capsys.readouterr().out
    assert "Mixture of experts (8 experts, top-2, 32 MoE layers of 32)" in out
    assert "TSP8: experts " in out and "TP8+SP: experts folded" in out
    assert f"from S = {moe.ring_crossover_seq(load_model('mixtral-8x7b'), 8):,.0f}" in out
    assert planner.main(args + ["--strategies", "tsp,cp"]) == 2
    assert "--strategies cp" in capsys.readouterr().err


def test_planner_moe_cli_plot_and_json(tmp_path, capsys):
    """The CLI's defaults write a plot: an MoE plan marks the expert ring's crossover instead of
    the dense bytes crossover; the JSON carries each row's schedule."""
    png, js = tmp_path / "plan.png", tmp_path / "plan.json"
    args = ["--model", "deepseek-v2-lite", "--seq-length", "32768", "--gpus", "64"]
    args += ["--plot", str(png), "--json", str(js), "--sweep", "16384,65536"]
    assert planner.main(args) == 0
    d = json.loads(js.read_text())
    assert [r["moe_schedule"] for r in d["rows"]][1] == "folded"  # TP+SP: experts folded
    assert d["moe_ring_crossover_seq"] == pytest.approx(
        moe.ring_crossover_seq(load_model("deepseek-v2-lite"), 8)
    )
    assert d["sweep"]["seqs"] == [16384, 65536]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "skipped" in capsys.readouterr().out
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dense_model_plans_are_unchanged_by_the_moe_path():
    """A dense model never enters the MoE code: no schedule, the dense layer terms."""
    m = ModelShape(name="dense", hidden=512, num_layers=2, heads=8, vocab=4096)
    r = planner.evaluate(m, "mi300x", planner.make_strategy("tsp", 4), 8192, 4)
    assert r["moe_schedule"] is None and "moe_alternative" not in r
