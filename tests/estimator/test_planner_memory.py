"""The planner's analytic peak memory agrees with the fake-tensor tool within 5%.

The tool (``megatron-tsp memory``) runs one rank of the real model code; the planner models what
each layer saves (``memory_model._layer_activation_bytes``), so a change to what the layers save
shows up here. Reduced config: h=512, 2 layers, 8 heads, vocab 4096, S=8192, D=4 (TSP saved /
recompute attention, TP+SP with and without full recompute, TP2 x CP2): about 1-2 min; the same with
2 and 1 query groups (fewer K/V heads than D), TSP layouts: about 30 s each; TSP x CP (TSP2 x CP2,
TSP4 x CP2; MHA and 2 query groups): about 20 s each. The 7B / 128k check is marked slow (TSP D=8
saved attention and full recompute, TP=8+SP without and with full recompute: about 3 min on an idle
2-core machine, ~12 min with the cores shared).
"""

import pytest

from tests.estimator.planner_check import run


def _run(args, timeout):
    return run("planner_vs_fake.py", args, timeout)


def _check(rows):
    assert rows
    for r in rows:
        err = r["planned"] / r["measured"] - 1
        print(
            f"{r['layout']:<28} measured {r['measured'] / 1e6:10.1f} MB ({r['measured_phase']})"
            f"  planned {r['planned'] / 1e6:10.1f} MB  {100 * err:+.1f}%"
        )
    for r in rows:
        assert abs(r["planned"] / r["measured"] - 1) <= 0.05, r


BASE_LAYOUTS = "tsp,tsp-attn-recompute,tpsp,tpsp-full,tsp-full,tpcp"
TSP_CP_LAYOUTS = "tspcp,tspcp-attn-recompute,tspcp-full,tspcp-d,tspcp-d-attn-recompute,tspcp-d-full"


def test_planner_memory_matches_fake_tool_reduced():
    _check(_run([512, 2, 8, 4096, 8192, 4, BASE_LAYOUTS], timeout=900))


@pytest.mark.parametrize("groups", [8, 2])
def test_planner_memory_matches_fake_tool_tsp_cp(groups):
    """TSP x CP (``megatron-tsp memory --scheme tsp --cp 2``) at TSP2 x CP2 and TSP4 x CP2, saved
    / recomputed attention and full recompute, MHA and 2 K/V heads (fewer than D = 4)."""
    _check(_run([512, 2, 8, 4096, 8192, 4, TSP_CP_LAYOUTS, groups], timeout=900))


@pytest.mark.parametrize("groups", [2, 1])
def test_planner_memory_matches_fake_tool_fewer_kv_heads_than_d(groups):
    """num_query_groups < D: TSP attention's steps hold a whole head group (np/ng query heads and
    one K/V head over the full sequence, D/ng weight shards), which the planner accounts for."""
    _check(_run([512, 2, 8, 4096, 8192, 4, "tsp,tsp-attn-recompute", groups], timeout=900))


@pytest.mark.slow
def test_planner_memory_matches_fake_tool_7b_128k():
    _check(_run([4096, 32, 32, 32000, 131072, 8, "tsp,tsp-full,tpsp,tpsp-full"], timeout=2400))
