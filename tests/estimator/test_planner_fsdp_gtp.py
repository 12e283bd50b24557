"""Issue 33's layouts in the planner: ZeRO-3 x CP (``fsdp_cp``, ``fsdp_cp_ring``) and Megatron-LM's
Generalized Tensor Parallelism (``gtp``, ``gtp_mxfp8``, ``gtp_nvfp4``), against hand counts on a
tiny model, monotonic sanity and the CLI."""

import pytest

from megatron_tsp.core.model_shape import ModelShape
from megatron_tsp.tools.estimator import formulas as fm
from megatron_tsp.tools.estimator import planner
from megatron_tsp.tools.estimator.memory_model import analytic_memory
from megatron_tsp.tools.estimator.strategies import (
    STRATEGY_NAMES,
    WIRE_BITS,
    Options,
    Strategy,
    default_strategies,
    make_strategy,
    wire_bytes,
)
from megatron_tsp.tools.estimator.timing import evaluate, layer_terms

# h=64, 2 layers, 4 heads, 2 K/V groups, FFN 128 (not gated), no bias, RMSNorm, vocab 256
TINY = ModelShape(
    name="tiny-fsdp",
    hidden=64,
    num_layers=2,
    heads=4,
    query_groups=2,
    ffn=128,
    gated=False,
    bias=False,
    normalization="RMSNorm",
    vocab=256,
    tied_embeddings=False,
    rope=True,
    dtype_bytes=2,
)
H, HKV, F = 64, 32, 128
W_LIN = (H + 2 * HKV) * H + H * H + F * H + H * F  # qkv, proj, fc1, fc2 = 28,672
W_LAYER = W_LIN + 2 * H  # + two RMSNorm weights
S = 1024


def _bytes(terms, **match):
    return sum(t.nbytes for t in terms if all(getattr(t, k) == v for k, v in match.items()))


def test_wire_sizes_from_the_formats():
    assert WIRE_BITS == {"bf16": 16.0, "mxfp8": 8.25, "nvfp4": 4.5}
    assert wire_bytes("mxfp8") == 1.03125 and wire_bytes("nvfp4") == 0.5625
    with pytest.raises(ValueError, match="wire"):
        wire_bytes("fp8")


@pytest.mark.parametrize("flavour", ["all_gather", "ring"])
def test_fsdp_cp_wire_bytes_by_hand(flavour):
    shape = fm.LayerShape.of(TINY, 1, S)
    N = 8
    f = 7 / 8
    terms = layer_terms(
        shape, make_strategy("fsdp_cp" if flavour == "all_gather" else "fsdp_cp_ring", N), Options()
    )
    # two gathers of the whole layer in bf16, one reduce-scatter in bf16 (Megatron-LM's default)
    assert _bytes(terms, group="fsdp", op="all_gather") == pytest.approx(2 * f * W_LAYER * 2)
    assert _bytes(terms, group="fsdp", op="reduce_scatter") == pytest.approx(f * W_LAYER * 2)
    # K/V: all-gather fwd, re-gather + dK/dV reduce-scatter bwd, f * 2 S h_kv each, bf16
    kv = f * 2 * S * HKV * 2
    assert _bytes(terms, group="cp", phase="attn_fwd") == pytest.approx(kv)
    assert _bytes(terms, group="cp", phase="attn_bwd") == pytest.approx(2 * kv)
    total = sum(t.nbytes for t in terms)
    assert total == pytest.approx(3 * f * W_LAYER * 2 + 3 * kv)
    ring = all(t.link == "p2p" for t in terms if t.group == "cp")
    assert ring == (flavour == "ring")
    # fp32 gradient reduce (--grad-reduce-in-fp32) doubles only the reduce-scatter
    t32 = layer_terms(shape, make_strategy("fsdp_cp", N), Options(fsdp_grad_reduce_bytes=4))
    assert _bytes(t32, op="reduce_scatter", group="fsdp") == pytest.approx(f * W_LAYER * 4)


@pytest.mark.parametrize("name,wire", [("gtp", 2.0), ("gtp_mxfp8", 1.03125), ("gtp_nvfp4", 0.5625)])
def test_gtp_wire_bytes_by_hand(name, wire):
    shape = fm.LayerShape.of(TINY, 1, S)
    T, R = 2, 4
    s = make_strategy(name, T, T, R)
    assert (s.tp, s.cp, s.remat) == (2, 1, 4)
    terms = layer_terms(shape, s, Options())
    f = 3 / 4
    # each linear weight's TP slice gathered twice at the wire size, reduce-scattered in bf16
    assert _bytes(terms, group="gtp", op="all_gather") == pytest.approx(2 * f * W_LIN / T * wire)
    assert _bytes(terms, group="gtp", op="reduce_scatter") == pytest.approx(f * W_LIN / T * 2)
    # and TP+SP's activation terms over T, unchanged: f_T * 10 B S h bf16
    assert _bytes(terms, group="tp") == pytest.approx(0.5 * 10 * S * H * 2)


def test_fsdp_cp_memory_by_hand():
    m, N = TINY, 4
    mem = analytic_memory(m, make_strategy("fsdp_cp", N), S, recompute="none")
    total = m.num_params(1)  # every parameter, 1/N per rank
    # FSDP2, as megatron-tsp memory --scheme fsdp_cp runs it: fp32 shards (the master weights)
    # and Adam's m, v; gradient shards only from each unit's backward to the step
    assert mem["params"] == pytest.approx(total / N * 4)
    assert mem["grads"] == 0
    assert mem["optimizer"] == pytest.approx(total / N * 8)
    # at the backward peak the layer's and the output layer's unsharded weight gradients are in
    # the reduce dtype: 2 B more per element with an fp32 reduce
    assert mem["transient"] > 0
    fp32 = analytic_memory(
        m,
        make_strategy("fsdp_cp", N),
        S,
        recompute="none",
        options=Options(fsdp_grad_reduce_bytes=4),
    )
    assert sum(fp32.values()) - sum(mem.values()) == pytest.approx((W_LAYER + 256 * H) * 2)


def test_gtp_memory_by_hand():
    m, T, R = TINY, 2, 4
    g = analytic_memory(m, make_strategy("gtp", T, T, R), S, dp=R, recompute="none")
    t = analytic_memory(m, make_strategy("tp_sp", T), S, dp=R, recompute="none")
    # the linear weights' TP slices 1/R, everything else as TP+SP
    assert t["params"] - g["params"] == pytest.approx(2 * W_LIN / T * (1 - 1 / R) * 2)
    assert t["grads"] - g["grads"] == pytest.approx(2 * W_LIN / T * (1 - 1 / R) * 4)
    assert g["activations"] == t["activations"]


def test_more_cp_less_memory():
    peaks = [
        sum(analytic_memory("7b", make_strategy(k, n), 131072, recompute=r).values())
        for k in ("fsdp_cp", "fsdp_cp_ring")
        for r in ("none", "full")
        for n in (8, 16, 32, 64)
    ]
    for i in range(0, len(peaks), 4):
        assert peaks[i] > peaks[i + 1] > peaks[i + 2] > peaks[i + 3]
    # the ring never holds the whole sequence's K/V: at most the all-gather's memory
    assert all(a >= b for a, b in zip(peaks[:8], peaks[8:]))


def test_nvfp4_gathers_fewer_bytes_and_not_slower():
    rows = {
        k: evaluate(
            "7b", "h100", make_strategy(k, 4, 4, 2), 131072, 8, Options(compute_model="flops")
        )
        for k in ("gtp", "gtp_mxfp8", "gtp_nvfp4")
    }
    comm = [rows[k]["layer_comm_fwd"] + rows[k]["layer_comm_bwd"] for k in rows]
    assert comm[0] > comm[1] > comm[2]
    steps = [rows[k]["step_s"] for k in rows]
    assert steps[0] >= steps[1] >= steps[2]


def test_default_strategies_enumerate_gtp_and_fsdp():
    labels = [s.label for s in default_strategies(8, ["fsdp_cp", "fsdp_cp_ring", "gtp_nvfp4"], [2])]
    assert labels == [
        "FSDPxCP16",
        "FSDPxCP16 ring",
        "GTP1x8xCP2 nvfp4",
        "GTP2x4xCP2 nvfp4",
        "GTP4x2xCP2 nvfp4",
    ]
    for k in ("fsdp_cp", "fsdp_cp_ring", "gtp", "gtp_mxfp8", "gtp_nvfp4"):
        assert k in STRATEGY_NAMES
    assert Strategy("gtp", tp=4, cp=1, remat=2).layout == "tp_sp"
    assert Strategy("fsdp_cp", cp=8).layout == "cp"


def test_cli_prints_the_rows(capsys, tmp_path):
    png = tmp_path / "p.png"
    rc = planner.main(
        "--model 7b --hardware h100 --gpus 16 --seq-length 65536 --compute-model flops "
        "--strategies tsp,fsdp_cp,fsdp_cp_ring,gtp,gtp_mxfp8 --sweep 32768,65536 "
        f"--plot {png}".split()
    )
    assert rc == 0
    out = capsys.readouterr().out
    for label in ("TSP8 ", "FSDPxCP8 ", "FSDPxCP8 ring", "GTP4x2 ", "GTP1x8 mxfp8"):
        assert "\n" + label in out, label
    pytest.importorskip("matplotlib")
    assert png.exists()


def test_cli_refuses_unknown_names_by_name(capsys):
    with pytest.raises(SystemExit) as e:
        planner.main("--gpus 8 --seq-length 4096 --strategies tsp,fsdp_cpp,gtp_fp8".split())
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--strategies" in err and "fsdp_cpp, gtp_fp8" in err and "tsp," not in err.split(":")[2]
