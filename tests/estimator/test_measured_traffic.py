"""The planner's measured-traffic compute model (``tools/estimator/measured_traffic.py``).

One recording of a tiny model's TSP and TP+SP layer (D = 2) at four sequence lengths, in a fresh
interpreter with the CUDA stand-in (~30 s): the curves fitted on the first three predict every
kernel's bytes and FLOPs at the fourth exactly; the planner's compute time is the sum of the
kernels' rooflines; the CLI runs with it.
"""

from __future__ import annotations

import json
import random

import pytest

from megatron_tsp.core.model_shape import load_model
from megatron_tsp.tools.estimator import measured_traffic as mt
from megatron_tsp.tools.estimator import planner as pl

D = 2


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Records at the three sample lengths and a fourth, and a cache holding the first three."""
    cache = tmp_path_factory.mktemp("traffic_cache")
    model = load_model("tiny")
    samples = mt.sample_seqs(D)
    fourth = 5 * samples[0]
    raw = mt.record(model, D, 1, "bf16", seqs=samples + (fourth,))
    mp = pytest.MonkeyPatch()
    mp.setenv("MEGATRON_TSP_CACHE", str(cache))
    mt._FITTED.clear()
    path = mt.cache_path(model, D, 1, "bf16")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({k: {str(s): v[str(s)] for s in samples} for k, v in raw.items()}))
    yield model, raw, samples, fourth
    mp.undo()
    mt._FITTED.clear()


def test_quadratic_through_three_points():
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    c = [rng.uniform(-5, 5) for _ in range(3)]
    xs = sorted(rng.sample(range(1, 10_000), 3))
    ys = [c[0] + c[1] * x + c[2] * x * x for x in xs]
    got = mt._quadratic(xs, ys)
    # rounding: c_k is a sum of y_i times Lagrange weights w_ki, so it carries ~eps sum |y_i w_ki|
    # (large where the points lie close: c0 of a curve reaching 5e8 can be off by 1e-4)
    (x0, x1, x2) = xs
    ds = [(x0 - x1) * (x0 - x2), (x1 - x0) * (x1 - x2), (x2 - x0) * (x2 - x1)]
    others = [(x1, x2), (x0, x2), (x0, x1)]
    weights = [
        [a * b / d for (a, b), d in zip(others, ds)],
        [(a + b) / d for (a, b), d in zip(others, ds)],
        [1 / d for d in ds],
    ]
    for k, (g, e) in enumerate(zip(got, c)):
        tol = 64 * 2.0**-52 * sum(abs(y * w) for y, w in zip(ys, weights[k]))
        assert g == pytest.approx(e, rel=1e-6, abs=max(tol, 1e-9)), f"seed={seed}"


def test_curves_predict_a_fourth_recording_exactly(recorded):
    model, raw, samples, fourth = recorded
    for scheme, by_seq in raw.items():
        curves = mt.fit_curves({s: by_seq[str(s)] for s in samples})
        kernels = [r for r in by_seq[str(fourth)] if r["kind"] == "kernel"]
        assert len(curves) == len(kernels) > 0, scheme
        for c, r in zip(curves, kernels):
            flops, nbytes = c.at(fourth)
            assert c.name == r["name"]
            assert flops == pytest.approx(r["flops"], rel=1e-9, abs=1e-3), (scheme, c.name)
            assert nbytes == pytest.approx(r["read"] + r["written"], rel=1e-9, abs=1e-3), (
                scheme,
                c.name,
            )
        # attention FLOPs grow with S^2: the curve is not affine in S
        assert any(abs(c.flops[2]) > 0 for c in curves), scheme


def test_tpsp_is_recorded_with_the_fused_rope(recorded):
    """The planner prices TP+SP as on a Transformer Engine box (``bench --traffic``'s default):
    Megatron's fused RoPE, one launch per tensor (q, k) and direction, at every length."""
    _, raw, _, _ = recorded
    for s, recs in raw["tp_sp"].items():
        names = [(r["name"], r["phase"]) for r in recs if r["kind"] == "kernel"]
        assert names.count(("fused_rope", "forward")) == 2, s
        assert names.count(("fused_rope_backward", "backward")) == 2, s
        assert not [n for n, _ in names if n in ("sin", "cos")], s  # no unfused RoPE tables


def test_different_kernel_sequences_are_refused(recorded):
    _, raw, samples, _ = recorded
    by_seq = {s: list(raw["tsp"][str(s)]) for s in samples}
    kernel = next(i for i, r in enumerate(by_seq[samples[1]]) if r["kind"] == "kernel")
    by_seq[samples[1]] = by_seq[samples[1]][:kernel] + by_seq[samples[1]][kernel + 1 :]
    with pytest.raises(ValueError, match=f"S={samples[0]} and S={samples[1]}"):
        mt.fit_curves(by_seq)


def test_planner_prices_every_recorded_kernel(recorded):
    model, raw, samples, _ = recorded
    hw = pl.load_hardware("h100")
    costs = hw.kernel_costs()
    seq = 7 * samples[0]
    for kind in mt.RECORDED_KINDS:
        s = pl.make_strategy(kind, D)
        o = pl.Options(recompute="none")
        r = pl.evaluate(model, hw, s, seq, D, o)
        assert r["compute_model"] == "measured"
        curves = mt.fit_curves({x: raw[kind][str(x)] for x in samples})
        for phase in ("fwd", "bwd"):
            expected = sum(costs.seconds(*c.at(seq)) for c in curves if c.phase == phase)
            assert r["layer_compute_s"][phase] == pytest.approx(expected, rel=1e-12)
            assert r["layer_kernels"][phase]["kernels"] == sum(c.phase == phase for c in curves)
        flops_only = pl.evaluate(
            model, hw, s, seq, D, pl.Options(recompute="none", compute_model="flops")
        )
        assert flops_only["compute_model"] == "flops" and flops_only["layer_kernels"] is None
        # every kernel costs at least its launch floor: the tiny layer is launch-bound
        assert r["layer_compute_s"]["fwd"] > flops_only["layer_compute_s"]["fwd"]
        full = pl.evaluate(model, hw, s, seq, D, pl.Options(recompute="full"))
        assert full["layer_compute_s"]["bwd"] == pytest.approx(
            r["layer_compute_s"]["bwd"] + r["layer_compute_s"]["fwd"]
        )
    # strategies without a recorded layer keep the FLOP model
    cp = pl.evaluate(model, hw, pl.make_strategy("cp", D), seq, D, pl.Options())
    assert cp["compute_model"] == "flops"
    with pytest.raises(ValueError, match="compute_model"):
        pl.evaluate(model, hw, pl.make_strategy("tsp", D), seq, D, pl.Options(compute_model="x"))


def test_cli_uses_the_measured_model(recorded, capsys):
    model, _, samples, _ = recorded
    argv = ["--seq-length", str(4 * samples[0]), "--gpus", str(D), "--degree", str(D)]
    argv += ["--strategies", "tsp,tp_sp", "--plot", "", "--hardware", "h100", "--model", "tiny"]
    assert pl.main(argv) == 0
    out = capsys.readouterr().out
    assert "compute (TSP, TP+SP, FSDP x CP): every kernel the layer issues" in out
    assert pl.main(argv + ["--compute-model", "flops"]) == 0
    assert "compute: FLOPs only (--compute-model flops)" in capsys.readouterr().out


def test_hardware_without_hbm_bandwidth_is_refused():
    hw = pl.load_hardware("h100")
    hw.hbm_GBps = 0
    with pytest.raises(ValueError, match="hbm_GBps"):
        hw.kernel_costs()
