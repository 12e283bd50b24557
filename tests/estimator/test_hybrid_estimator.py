"""The hybrid (TP+SP attention + TSP MLP, ``--tsp-mlp``) in the formulas, planner and memory tool.
Counted bytes of a real hybrid layer == these formulas: ``tests/test_hybrid.py``."""

from __future__ import annotations

import warnings

import pytest

from megatron_tsp.tools.estimator import formulas as fm
from megatron_tsp.tools.estimator import planner as pl
from megatron_tsp.tools.estimator.formulas import LayerShape

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")


def test_hybrid_bytes_hand_checked():
    # h=8, a=g=2, F=32, no bias: W_mlp = 256 + 256 = 512. B*S=16 -> BSh = 128 elements. D=4, bf16.
    s = LayerShape(batch=1, seq=16, hidden=8, heads=2, dtype_bytes=2)
    f = 3 / 4
    assert fm.hybrid_layer_comm(s, 4) == pytest.approx(
        {
            "attn_fwd": 2 * f * 128 * 2,  # AG before QKV + RS after proj
            "attn_bwd": 3 * f * 128 * 2,  # AG of proj's output grad, QKV re-gather, QKV dgrad RS
            "mlp_fwd": f * 512 * 2,  # weight ring
            # ring again (bf16) + the fp32 gradient accumulator ring (bf16 model: fp32 partials)
            "mlp_bwd": f * 512 * 2 + f * 512 * 4,
        }
    )
    ops = fm.sum_terms(fm.hybrid_layer_terms(s, 4), by="op")
    assert set(ops) == {"all_gather", "reduce_scatter", "p2p"}
    split = fm.split_terms(fm.hybrid_layer_terms(s, 4))
    assert split["mlp_fwd"]["activation"] == split["mlp_bwd"]["activation"] == 0


@pytest.mark.parametrize("gated,bias,groups", [(False, False, None), (True, True, 2)])
def test_hybrid_is_tp_sp_attention_plus_tsp_mlp(gated, bias, groups):
    s = LayerShape(
        batch=2,
        seq=64,
        hidden=16,
        heads=4,
        query_groups=groups,
        gated=gated,
        bias=bias,
        dtype_bytes=2,
    )
    for D in (2, 4, 8):
        h, tpsp, tsp = (
            fm.hybrid_layer_comm(s, D),
            fm.tp_sp_layer_comm(s, D),
            fm.tsp_layer_comm(s, D),
        )
        assert (h["attn_fwd"], h["attn_bwd"]) == (tpsp["attn_fwd"], tpsp["attn_bwd"])
        assert (h["mlp_fwd"], h["mlp_bwd"]) == (tsp["mlp_fwd"], tsp["mlp_bwd"])


def test_hybrid_crossover_is_w_mlp_over_2h():
    """Forward: f*(2BSh + W_mlp) <= f*4BSh  <=>  BS >= W_mlp / 2h; 7B (GELU, F=4h): 4h = 16384.
    fwd+bwd in bf16 bytes, the gradient ring sending fp32 partials (4 B):
    f*(2*5BSh + (2 + 2 + 4) W_mlp) <= f*2*10BSh  <=>  BS >= 4 W_mlp / 5h."""
    m = pl.load_model("7b")
    shape = LayerShape.of(m, 1, 1)
    h = m.hidden
    fwd = fm.crossover_seq_length(shape, 8, "fwd", candidate="hybrid")
    total = fm.crossover_seq_length(shape, 8, "total", candidate="hybrid")
    assert fwd == pytest.approx(shape.w_mlp / (2 * h)) == pytest.approx(16384)
    assert total == pytest.approx(4 * shape.w_mlp / (5 * h))
    # the hybrid wins earlier than full TSP (whose attention weights move too)
    assert fwd < fm.crossover_seq_length(shape, 8, "fwd")
    big = shape.with_seq(int(2 * fwd))
    assert fm.fwd(fm.hybrid_layer_comm(big, 8)) < fm.fwd(fm.tp_sp_layer_comm(big, 8))


def test_planner_hybrid_row_7b_128k_d8():
    """Analytic memory and comm at 7B / 128k / D=8: the hybrid keeps the fc1 outputs (the same
    bytes as TP+SP's) but not TP+SP's activation output, and drops its MLP activation
    collectives; parameters are TP=8's."""
    o = pl.Options(recompute="none", compute_model="flops")
    rows = {
        r["kind"]: r
        for r in (
            pl.evaluate("7b", "h200", pl.make_strategy(k, 8), 131072, 8, o)
            for k in ("tp_sp", "hybrid", "tsp")
        )
    }
    hyb, tpsp = rows["hybrid"], rows["tp_sp"]
    assert hyb["strategy"] == "TP8+SP+TSP-MLP"
    assert hyb["memory_bytes"]["none"]["params"] == tpsp["memory_bytes"]["none"]["params"]
    assert hyb["memory_total_bytes"]["none"] < tpsp["memory_total_bytes"]["none"]
    shape = LayerShape.of(pl.load_model("7b"), 1, 131072)
    mid = 131072 * shape.ffn_hidden / 8 * 2 * 32  # TP+SP's activation output, per layer
    saved = tpsp["memory_bytes"]["none"]["activations"] - hyb["memory_bytes"]["none"]["activations"]
    assert saved == pytest.approx(mid)
    assert (
        hyb["layer_comm_fwd"] + hyb["layer_comm_bwd"]
        < tpsp["layer_comm_fwd"] + tpsp["layer_comm_bwd"]
    )
    assert hyb["step_s"] > 0 and "step_s" in rows["tsp"]
    p = pl.plan("7b", "h200", 131072, 8, 8, options=o)
    assert "TP8+SP+TSP-MLP" in [r["strategy"] for r in p["rows"]]
    assert p["hybrid_bytes_crossover_seq"]["fwd"] == pytest.approx(16384)
    text = pl.render(p)
    assert "hybrid (TP+SP attention + TSP MLP, --tsp-mlp)" in text and "S* fwd = 16,384" in text


def test_planner_cli_hybrid_only(capsys):
    assert (
        pl.main(
            [
                "--model",
                "tiny",
                "--seq-length",
                "4096",
                "--gpus",
                "8",
                "--degree",
                "4",
                "--strategies",
                "tp_sp,hybrid",
                "--plot",
                "",
                "--compute-model",
                "flops",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "TP4+SP+TSP-MLP" in out


def test_fake_run_hybrid_matches_real_allocator_and_flops():
    """``--scheme hybrid`` at small scale: fake-tensor peak within 10% of the real allocator's
    (fresh process); GEMM FLOPs = TP+SP's (+ the per-shard fc1 GEMMs with TSP's opt-in
    recompute); counted bytes of the step below TP+SP's at this S."""
    from megatron_tsp.core.model_shape import load_model
    from megatron_tsp.tools.estimator import fake_run
    from megatron_tsp.tools.estimator.fake_run import RunConfig, run_step

    base = dict(model=load_model("small"), world_size=4, tp=4, seq=2048)
    fake = run_step(RunConfig(scheme="hybrid", **base))
    real = fake_run.run_step_isolated(
        RunConfig(scheme="hybrid", fake=False, count_flops=False, count_comm=False, **base)
    )
    err = abs(fake.peak_bytes - real.real_peak_bytes) / real.real_peak_bytes
    assert err < 0.10, (fake.peak_bytes, real.real_peak_bytes)
    tpsp = run_step(RunConfig(scheme="tp_sp", **base))
    m = base["model"]
    fc1 = 2 * base["seq"] // 4 * m.hidden * m.ffn_hidden * m.num_layers
    assert fake.flops["matmul"] == tpsp.flops["matmul"]
    opt_in = run_step(RunConfig(scheme="hybrid", tsp_mlp_recompute_activation=True, **base))
    assert opt_in.flops["matmul"] - tpsp.flops["matmul"] == pytest.approx(fc1, rel=1e-9)
    assert opt_in.peak_bytes < fake.peak_bytes and opt_in.label == "TP=4+SP+TSP-MLP rec-fc1"
    assert fake.flops["attention"] == tpsp.flops["attention"]
    assert fake.peak_bytes < tpsp.peak_bytes
    assert fake.label == "TP=4+SP+TSP-MLP"
    from megatron_tsp.tools.estimator.memory import _teardown

    _teardown()
