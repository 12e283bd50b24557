"""FSDP x CP's layer in the traffic benchmark (``bench --traffic --schemes fsdp_cp,fsdp_cp_ring``,
``megatron_tsp.tools.traffic_fsdp_cp``) and the planner pricing its recorded kernels.

One tiny layer recorded on shape-only CUDA tensors (N = 4 ranks, rank 0) in a fresh interpreter;
every count and byte below follows from the layer's shapes:

* whole-weight GEMMs on the S/N local tokens: 2 (S/N) W FLOPs per weight forward, a dgrad and a
  wgrad each backward, (m k + k n + m n) elements each;
* ZeRO-3: one all-gather of the layer's weight bytes before the forward and one before the
  backward, one copy of the gradients into the reduce-scatter input (reads and writes the
  layer's weight bytes) and one reduce-scatter of it, after every weight gradient;
* CP all-gather: K and V gathered (S rows each) forward and again backward, one causal flash call
  per local chunk, dK / dV reduce-scattered; P2P ring: N-1 steps forward (one merge of the fp32
  log-sum-exp each, one output correction per step), K/V and dK/dV around the ring backward; the
  attention FLOPs of both are the rank's causal (query, key) pairs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_tsp.tools import traffic
from tests.test_traffic import FFN, HEADS, SEQ, H, tiny_model_file

N = 4
HD = H // HEADS
BF16 = 2
C = SEQ // (2 * N)  # zigzag chunk rows
LOCAL = SEQ // N
WEIGHTS = {"qkv": 3 * H * H, "proj": H * H, "fc1": H * FFN, "fc2": FFN * H}
NORMS = 2 * 2 * H  # two LayerNorms, weight and bias
LAYER_PARAMS = sum(WEIGHTS.values()) + NORMS


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model_file(tmp_path_factory, "fsdp_cp_traffic")


@pytest.fixture(scope="module")
def layer(model):
    cfg = traffic.TrafficConfig(
        model=model, seq=SEQ, world_size=N, top=100, schemes=["fsdp_cp", "fsdp_cp_ring", "tp_sp"]
    )
    return traffic.measure_isolated(cfg, timeout=600)


def _kernels(summary, phase=None, source=None, name=None):
    return [
        r
        for r in summary["records"]
        if r["kind"] == "kernel"
        and (phase is None or r["phase"] == phase)
        and (source is None or r["source"] == source)
        and (name is None or r["name"] == name)
    ]


def _collectives(summary, source, phase=None):
    return [
        r
        for r in summary["records"]
        if r["kind"] == "collective"
        and r["source"] == source
        and (phase is None or r["phase"] == phase)
    ]


def causal_pairs(rank: int) -> int:
    """(query, key) pairs of the rank's two zigzag chunks under causal attention."""
    return sum(C * (c * C) + C * (C + 1) // 2 for c in (rank, 2 * N - 1 - rank))


@pytest.mark.parametrize("scheme", ["fsdp_cp", "fsdp_cp_ring"])
def test_whole_weight_gemms_on_local_tokens(layer, scheme):
    s = layer[scheme]
    fwd = [r for r in _kernels(s, "forward") if r["flop_kind"] == "gemm"]
    bwd = [r for r in _kernels(s, "backward") if r["flop_kind"] == "gemm"]
    assert len(fwd) == 4 and len(bwd) == 8  # one launch per weight and direction
    assert sorted(r["flops"] for r in fwd) == sorted(2 * LOCAL * w for w in WEIGHTS.values())
    assert sum(r["flops"] for r in bwd) == 2 * sum(r["flops"] for r in fwd)
    m, expected = LOCAL, 0
    for k, n in ((H, 3 * H), (H, H), (H, FFN), (FFN, H)):  # qkv, proj, fc1, fc2 (in, out)
        expected += 3 * (m * k + k * n + m * n) * BF16  # forward, dgrad, wgrad
    assert sum(r["read"] + r["written"] for r in fwd + bwd) == expected
    # the same GEMM work per rank as TP+SP over N (1/N of the weights on all the tokens)
    assert s["gemm_flops"] == layer["tp_sp"]["gemm_flops"]
    check = traffic.gemm_check(s)
    assert check["forward_exact"] and check["backward_recompute"] == "none"


@pytest.mark.parametrize("scheme", ["fsdp_cp", "fsdp_cp_ring"])
def test_weight_gathers_and_gradient_reduce_scatter(layer, scheme):
    s = layer[scheme]
    layer_bytes = LAYER_PARAMS * BF16
    gathers = _collectives(s, "traffic_fsdp_cp.unshard")
    assert [g["phase"] for g in gathers] == ["forward", "backward"]
    assert all(g["name"] == "_allgather_base_" and g["comm_bytes"] == layer_bytes for g in gathers)
    reduce = _collectives(s, "traffic_fsdp_cp.reduce_scatter")
    assert len(reduce) == 1 and reduce[0]["comm_bytes"] == layer_bytes
    copy_in = _kernels(s, source="traffic_fsdp_cp.reduce_scatter")
    assert len(copy_in) == 1 and copy_in[0]["phase"] == "backward"
    assert (copy_in[0]["read"], copy_in[0]["written"]) == (layer_bytes, layer_bytes)
    # after every weight gradient: the last kernel of the layer
    assert _kernels(s)[-1] == copy_in[0]
    # no other kernel touches the whole layer's weights at once (no copy-out of the gather), and
    # autograd accumulates every weight gradient without a copy (the wgrad GEMM's output is it)
    assert not _kernels(s, source="traffic_fsdp_cp.unshard")
    weight_bytes = {w * BF16 for w in WEIGHTS.values()}
    assert not [r for r in _kernels(s, name="copy_") if r["written"] in weight_bytes]


def test_kv_all_gather(layer):
    s = layer["fsdp_cp"]
    kv_rows = SEQ * HEADS * HD * BF16  # one of K, V over the whole sequence
    gathers = _collectives(s, "traffic_fsdp_cp._gather")
    assert [g["phase"] for g in gathers] == ["forward"] * 2 + ["backward"] * 2
    assert all(g["comm_bytes"] == kv_rows for g in gathers)
    reduce = [
        r
        for r in s["records"]
        if r["kind"] == "collective" and r["name"] == "_reduce_scatter_base_"
    ]
    assert sum(r["comm_bytes"] == kv_rows for r in reduce) == 2  # dK, dV
    reorders = _kernels(s, name="index_select")
    assert len(reorders) == 6  # K, V to sequence order fwd and bwd; dK, dV back
    attention = [r for r in _kernels(s) if r["flop_kind"] == "attention"]
    assert len(attention) == 4  # one flash call per local chunk, forward and backward
    fwd = sum(r["flops"] for r in attention if r["phase"] == "forward")
    assert fwd == 2 * HEADS * 2 * HD * causal_pairs(0)


def test_kv_ring(layer):
    s, ag = layer["fsdp_cp_ring"], layer["fsdp_cp"]
    block = 2 * LOCAL * HEADS * HD * BF16  # packed K and V of one rank
    sends = [r for r in _collectives(s, "traffic_fsdp_cp._ring_exchange") if r["name"] == "send"]
    assert [r["phase"] for r in sends] == ["forward"] * (N - 1) + ["backward"] * (2 * (N - 1) + 1)
    assert all(r["comm_bytes"] == block for r in sends)
    merges = _kernels(s, name="logaddexp")
    assert len(merges) == N - 1
    # rank 0: every later step is a later rank's block, seen by the second local chunk (C rows);
    # each merge reads the running and the step's fp32 [b, h, C] log-sum-exp, writes the first
    assert all((r["read"], r["written"]) == (2 * HEADS * C * 4, HEADS * C * 4) for r in merges)
    assert len(_kernels(s, name="cp_out_correction")) == N
    flash = [r for r in _kernels(s) if r["flop_kind"] == "attention"]
    assert len(flash) == 2 * N  # one call per step and direction
    for phase in ("forward", "backward"):
        assert s["by_phase"][phase]["attention_flops"] == ag["by_phase"][phase]["attention_flops"]


def test_fsdp_cp_schemes_in_the_cli():
    argv = ["--model", "tiny", "--world-size", "2"]
    args = traffic.parse_args(["--schemes", "fsdp_cp,fsdp_cp_ring", *argv])
    assert args.schemes == ["fsdp_cp", "fsdp_cp_ring"]
    assert traffic.parse_args(argv).schemes == list(traffic.DEFAULT_SCHEMES)
    with pytest.raises(SystemExit):
        traffic.parse_args(["--schemes", "fsdp", *argv])


def test_only_the_schemes_that_split_over_d_are_recorded():
    """The planner's recordings skip a TSP / TP+SP layer whose heads do not split over D (the
    tiny model's 4 heads over 8 ranks) and keep FSDP x CP's, which holds whole heads."""
    assert traffic.scheme_fits("tiny", "tsp", 2) and traffic.scheme_fits("tiny", "tp_sp", 4)
    assert not traffic.scheme_fits("tiny", "tsp", 8) and not traffic.scheme_fits("tiny", "tp_sp", 8)
    assert traffic.scheme_fits("tiny", "fsdp_cp", 8) and traffic.scheme_fits(
        "tiny", "fsdp_cp_ring", 8
    )


def test_planner_prices_the_recorded_fsdp_cp_kernels(model, tmp_path, monkeypatch):
    """The planner's fsdp_cp layer compute under the measured model is the sum of the priced
    recorded kernels of the FSDP x CP recording (all-gather and ring flavours)."""
    from megatron_tsp.core.model_shape import load_model
    from megatron_tsp.tools.estimator import measured_traffic, timing
    from megatron_tsp.tools.estimator.planner_inputs import load_hardware
    from megatron_tsp.tools.estimator.strategies import Options, make_strategy

    monkeypatch.setenv("MEGATRON_TSP_CACHE", str(tmp_path))
    m = replace(load_model(model), num_layers=2)
    hw = load_hardware("h100")
    o = Options(compute_model="measured", recompute="none")
    seq = 3 * SEQ
    curves = measured_traffic.layer_curves(m, N, 1, "bf16")
    costs = hw.kernel_costs()
    for kind, scheme in (("fsdp_cp", "fsdp_cp"), ("fsdp_cp_ring", "fsdp_cp_ring")):
        s = make_strategy(kind, N)
        assert measured_traffic.scheme_of(s) == scheme
        r = timing.evaluate(m, hw, s, seq, N, o)
        assert r["compute_model"] == "measured"
        for phase in ("fwd", "bwd"):
            priced = sum(costs.seconds(*c.at(seq)) for c in curves[scheme] if c.phase == phase)
            assert r["layer_compute_s"][phase] == pytest.approx(priced, rel=1e-12)
    # the two flavours issue different kernels, so they are priced apart
    assert len(curves["fsdp_cp"]) != len(curves["fsdp_cp_ring"])
