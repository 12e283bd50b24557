"""TSP x CP in the planner: the formulas against the bytes the code issues, the what-if ring, and
the ``tsp_cp`` strategy end to end.

The counted bytes come from one rank of the real model code (``fake_run.run_step``, the code of
``megatron-tsp memory --scheme tsp --cp C``) on fake tensors, at a tiny shape: a few seconds per
case on one core.
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")

from megatron_tsp.core.model_shape import load_model  # noqa: E402
from megatron_tsp.tools.estimator import fake_run, timing  # noqa: E402
from megatron_tsp.tools.estimator import formulas as fm  # noqa: E402
from megatron_tsp.tools.estimator import planner as pl  # noqa: E402
from tests.estimator.fake_world_fixture import _fake_world_teardown  # noqa: E402,F401

SEQ = 256


def _counted(monkeypatch, model, D, C, **kw):
    """One fake-tensor training step of TSP D x CP C; returns the run and its comm records split
    into fwd / bwd / step (grad sync and optimizer)."""
    seen = {}
    original = fake_run._comm_by_phase

    def keep(records, marks):
        seen["records"], seen["marks"] = list(records), list(marks)
        return original(records, marks)

    monkeypatch.setattr(fake_run, "_comm_by_phase", keep)
    cfg = fake_run.RunConfig(
        scheme="tsp",
        model=model,
        world_size=D * C,
        tp=D,
        cp=C,
        seq=SEQ,
        count_flops=False,
        **kw,
    )
    result = fake_run.run_step(cfg)
    records, (end_fwd, end_bwd) = seen["records"], seen["marks"]
    parts = {
        "fwd": records[:end_fwd],
        "bwd": records[end_fwd:end_bwd],
        "step": records[end_bwd:],
    }
    return result, parts


def _recv(records, **match) -> float:
    return sum(r.recv_bytes for r in records if all(getattr(r, k) == v for k, v in match.items()))


@pytest.mark.parametrize(
    "model_name,D,C,kw",
    [
        ("tiny", 2, 2, {}),
        ("tiny", 4, 2, {}),
        ("tiny-llama", 4, 2, {}),  # GQA: 2 K/V heads < D = 4 (head groups share a K/V head)
        ("tiny", 2, 4, {"tsp_kv_grad_fp32": True}),  # dK/dV reduce-scatter in fp32
        ("tiny", 2, 2, {"tsp_attention_backward": "recompute"}),
    ],
)
def test_tsp_cp_formula_equals_counted_bytes(monkeypatch, model_name, D, C, kw):
    """Per layer and phase, ``formulas.tsp_cp_layer_terms`` is exactly what one rank receives:
    the weight traffic over the D-rank TSP group, the K/V all-gathers and dK/dV reduce-scatters
    over the D*C sequence group; the rest of a micro-batch is the output layer on the local
    S/C tokens (``head_comm`` over the TSP group); the step adds the replicated-parameter
    all-reduce over TSP and the gradient all-reduce over DP x CP."""
    model = load_model(model_name)
    result, parts = _counted(monkeypatch, model, D, C, **kw)
    shape = fm.LayerShape.of(model, 1, SEQ)
    terms = fm.tsp_cp_layer_terms(
        shape,
        D,
        C,
        recompute_attn=kw.get("tsp_attention_backward") == "recompute",
        kv_grad_reduce_in_fp32=kw.get("tsp_kv_grad_fp32", False),
    )
    L = model.num_layers
    for phase in ("fwd", "bwd"):
        mine = [t for t in terms if t.phase.endswith(phase)]
        seq_terms = sum(t.nbytes for t in mine if t.group == "seq")
        tsp_terms = sum(t.nbytes for t in mine if t.group == "tsp")
        # the K/V collectives are the only ones over all D*C ranks
        assert _recv(parts[phase], group_size=D * C) == pytest.approx(L * seq_terms, rel=1e-12)
        # the weights stay in the TSP group (the layers label their traffic tsp_*)
        weights = sum(
            r.recv_bytes for r in parts[phase] if r.group_size == D and r.scope.startswith("tsp_")
        )
        assert weights == pytest.approx(L * tsp_terms, rel=1e-12)
        head = fm.head_comm(shape.with_seq(SEQ // C), D)[phase]
        total = sum(r.recv_bytes for r in parts[phase])
        assert total == pytest.approx(L * (seq_terms + tsp_terms) + head, rel=1e-12), phase
    # the step: replicated params' grads over TSP, every grad over DP x CP (no distributed
    # optimizer here: an all-reduce)
    local = result.params_local
    repl = fm.replicated_grad_allreduce(shape, D, L, model.final_norm_params())
    dp = fm.dp_step_comm(local, C, distributed_optimizer=False)
    expected = {D: repl}
    expected[C] = expected.get(C, 0.0) + dp["grad_reduce"]  # D == C: one group size for both
    for size, nbytes in expected.items():
        assert _recv(parts["step"], group_size=size) == pytest.approx(nbytes, rel=1e-12)
    assert len(parts["step"]) == 2
    # the planner's parameter count is the code's
    mem = pl.analytic_memory(model, pl.Strategy("tsp_cp", tp=D, cp=C), SEQ)
    assert mem["params"] / model.dtype_bytes == local


def test_tsp_cp_terms_reduce_to_tsp_and_scale_kv_only():
    """C = 1 is TSP; C only changes the K/V terms' ring factor (f_DC) and group; the ring what-if
    receives the same total per rank, split into f_D inside the node and (C-1)/(DC) across."""
    s = fm.LayerShape(batch=2, seq=64, hidden=32, heads=4, query_groups=2, dtype_bytes=2)
    assert fm.tsp_cp_layer_terms(s, 4, 1) == fm.tsp_layer_terms(s, 4)
    kv = 2 * s.tokens * s.kv_hidden * 2
    for D, C in ((2, 2), (4, 2), (8, 8)):
        ag = fm.tsp_cp_layer_terms(s, D, C)
        tsp = fm.tsp_layer_terms(s, D)
        assert [t for t in ag if t.category != "activation"] == [
            t for t in tsp if t.category != "activation"
        ]
        acts = [t for t in ag if t.category == "activation"]
        assert len(acts) == 3 and all(t.group == "seq" for t in acts)
        for t in acts:
            assert t.nbytes == pytest.approx((D * C - 1) / (D * C) * kv)
        ring = fm.tsp_cp_layer_terms(s, D, C, kv_flavour="ring")
        assert fm.sum_terms(ring) == pytest.approx(fm.sum_terms(ag))
        intra, inter = fm.ring_split(D, C)
        assert intra + inter == pytest.approx((D * C - 1) / (D * C))
        assert {t.group for t in ring if t.category == "activation"} == {"cp_ring"}
    with pytest.raises(ValueError):
        fm.tsp_cp_layer_terms(s, 2, 2, kv_flavour="p2p")


def test_tsp_cp_timing_uses_inter_node_bandwidth():
    """The sequence group of TSP8 x CP C spans C nodes: its K/V collectives run at the node's NIC
    bandwidth, the weight traffic at NVLink's; the ring what-if is paced by the slower of its
    NVLink gather and its one-NIC hop."""
    hw = pl.load_hardware("h100")
    shape = fm.LayerShape.of(pl.load_model("7b"), 1, 1048576)
    s = pl.Strategy("tsp_cp", tp=8, cp=8)
    nic = hw.nic_per_node * hw.nic_gbps / 8 * pl.GB * hw.comm_efficiency  # the node's 8 NICs
    nvlink = hw.link_GBps * pl.GB * hw.comm_efficiency
    for t in pl.layer_terms(shape, s, pl.Options()):
        bw = nic if t.group == "seq" else nvlink
        assert timing._term_time(t, s, hw) == pytest.approx(t.nbytes / bw)
    ring = pl.Strategy("tsp_cp", tp=8, cp=8, kv_flavour="ring")
    for t in pl.layer_terms(shape, ring, pl.Options()):
        if t.group != "cp_ring":
            continue
        intra, inter = fm.ring_split(8, 8)
        n = t.nbytes / (intra + inter)
        expected = max(intra * n / nvlink, inter * n / (nic / hw.gpus_per_node))
        assert timing._term_time(t, ring, hw) == pytest.approx(expected)


def test_tsp_cp_memory_relations():
    """TSP x CP memory: C = 1 is TSP; more C, less memory; the distributed optimizer shards over
    DP x CP; the what-if ring holds node blocks instead of whole-sequence K/V buffers."""
    m = pl.load_model("7b")
    o = pl.Options()

    def total(s, seq=131072, **kw):
        return sum(pl.analytic_memory(m, s, seq, options=o, **kw).values())

    assert total(pl.Strategy("tsp_cp", tp=8, cp=1)) == total(pl.Strategy("tsp", tp=8))
    by_c = [total(pl.Strategy("tsp_cp", tp=8, cp=c)) for c in (2, 4, 8)]
    assert by_c == sorted(by_c, reverse=True)
    a = pl.analytic_memory(m, pl.Strategy("tsp_cp", tp=8, cp=4), 131072, dp=2)
    b = pl.analytic_memory(
        m, pl.Strategy("tsp_cp", tp=8, cp=4), 131072, dp=2, distributed_optimizer=False
    )
    assert a["optimizer"] == pytest.approx(b["optimizer"] / 8)
    ring = pl.Strategy("tsp_cp", tp=8, cp=8, kv_flavour="ring")
    assert total(ring, seq=1048576) < total(pl.Strategy("tsp_cp", tp=8, cp=8), seq=1048576)


def test_plan_cli_tsp_cp(tmp_path, capsys):
    """``megatron-tsp plan --strategies tsp_cp,tsp_cp_ring,tp_cp --cp ...``: one row per layout
    and C, the side-by-side comparison, the JSON; C whose D*C does not divide the GPUs is
    skipped, tsp_cp without --cp refused."""
    out = tmp_path / "plan.json"
    base = ["--model", "7b", "--hardware", "h100", "--seq-length", "1048576", "--gpus", "64"]
    base += ["--compute-model", "flops", "--plot", ""]
    argv = base + ["--strategies", "tsp_cp,tsp_cp_ring,tp_cp", "--cp", "8,16"]
    assert pl.main(argv + ["--json", str(out)]) == 0
    text = capsys.readouterr()
    assert "skipping --cp [16]" in text.err
    for label in ("TSP8xCP8 ", "TSP8xCP8 ring", "TP8+SPxCP8"):
        assert label in text.out
    assert "TSP x CP vs TP+SP x CP at equal C" in text.out
    data = json.loads(out.read_text())
    rows = {r["strategy"]: r for r in data["rows"]}
    assert rows["TSP8xCP8"]["dp"] == 1 and rows["TSP8xCP8"]["cp"] == 8
    (cmp,) = data["tsp_cp_comparison"]
    assert cmp["cp"] == 8 and cmp["tsp_cp"]["best"] is not None
    assert pl.main(base + ["--strategies", "tsp_cp"]) == 2


def test_strategy_names():
    s = pl.make_strategy("tsp_cp", 64, 8)
    assert (s.kind, s.tp, s.cp, s.kv_flavour, s.label) == ("tsp_cp", 8, 8, "all_gather", "TSP8xCP8")
    r = pl.make_strategy("tsp_cp_ring", 32, 8)
    assert (r.kind, r.cp, r.kv_flavour, r.label) == ("tsp_cp", 4, "ring", "TSP8xCP4 ring")
    got = pl.default_strategies(8, ("tsp_cp", "tp_cp"), cps=(2, 4))
    assert [x.label for x in got] == ["TSP8xCP2", "TSP8xCP4", "TP8+SPxCP2", "TP8+SPxCP4"]
    # without CP sizes tp_cp keeps its factorisations of the group
    assert [x.label for x in pl.default_strategies(8, ("tp_cp",))] == ["TP2+SPxCP4", "TP4+SPxCP2"]
    with pytest.raises(ValueError):
        pl.default_strategies(8, ("tsp_cp",))
    assert dataclasses.replace(s, cp=1).degree == 8
