"""Communication and FLOP formulas: hand-checked cases, invariances, the crossover inequality."""

import math
import random

import pytest

from megatron_tsp.tools.estimator import formulas as fm
from megatron_tsp.tools.estimator.formulas import LayerShape


def _shape(**kw):
    base = dict(batch=1, seq=16, hidden=8, heads=2, dtype_bytes=2)
    base.update(kw)
    return LayerShape(**base)


def _random_shapes(seed, n=20):
    """``n`` random valid layer shapes (fresh per run: ``seed`` comes from the ``seed`` fixture,
    which prints it on failure)."""
    rng = random.Random(seed)
    for _ in range(n):
        heads = rng.choice([2, 4, 8])
        groups = rng.choice([g for g in (1, 2, 4, 8) if heads % g == 0])
        hn = rng.choice([2, 4, 8])
        yield LayerShape(
            batch=rng.randint(1, 4),
            seq=rng.choice([16, 32, 64]),
            hidden=heads * hn,
            heads=heads,
            query_groups=groups,
            ffn=rng.choice([None, 24, 40]),
            gated=rng.random() < 0.5,
            bias=rng.random() < 0.5,
            dtype_bytes=rng.choice([2, 4]),
            normalization=rng.choice(["LayerNorm", "RMSNorm"]),
        )


# --- hand-checked small cases -----------------------------------------------------------------
def test_tsp_hand_checked_mha():
    # h=8, a=g=2, F=4h=32, no bias: W_qkv = 24*8 = 192, W_proj = 64 -> W_attn = 256;
    # W_fc1 = W_fc2 = 256 -> W_mlp = 512. B*S = 16, K/V = 2*16*8 = 256 elements. D=4: f = 3/4.
    s = _shape()
    assert (s.w_attn, s.w_mlp, s.kv_hidden) == (256, 512, 8)
    c = fm.tsp_layer_comm(s, 4)
    assert c == {
        "attn_fwd": (192 + 192) * 2,  # f*W_attn + f*KV, bf16
        "mlp_fwd": 384 * 2,  # f*W_mlp
        # re-bcast, re-gather, dKV RS (bf16); grad reduce (fp32 accumulators)
        "attn_bwd": (192 + 192) * 2 + 192 * 2 + 192 * 4,
        "mlp_bwd": 384 * 2 + 384 * 4,  # ring (bf16) + grad accumulator (fp32)
    }
    split = fm.tsp_layer_split(s, 4)
    assert split["attn_bwd"] == {"weight": 384.0, "grad": 768.0, "activation": 192 * 2 + 192 * 2}
    assert split["mlp_fwd"] == {"weight": 768.0, "grad": 0.0, "activation": 0.0}
    # --tsp-kv-grad-reduce-in-fp32: the dK/dV reduce-scatter at 4 bytes, nothing else changes
    c32 = fm.tsp_layer_comm(s, 4, kv_grad_reduce_in_fp32=True)
    assert c32 == {**c, "attn_bwd": c["attn_bwd"] + 192 * 2}


def test_tsp_hand_checked_gqa_gated_bias():
    # h=8, a=4, g=2 -> hn=2, h_kv=4; qkv rows 8+8=16: W_qkv=128 (+16 bias), W_proj=64 -> 208.
    # SwiGLU F=12: fc1 24x8=192 (+24 bias), fc2 8x12=96 -> W_mlp=312.
    # Replicated: 2 LayerNorms (w+b) 32, proj bias 8, fc2 bias 8 -> 48.
    s = LayerShape(
        batch=1,
        seq=4,
        hidden=8,
        heads=4,
        query_groups=2,
        ffn=12,
        gated=True,
        bias=True,
        dtype_bytes=2,
    )
    assert (s.w_attn, s.w_mlp, s.replicated_params) == (208, 312, 48)
    assert s.layer_params == 208 + 312 + 48
    # D=2, f=1/2, K/V = 2*4*4 = 32 elements
    # weight gradients rounded to bf16 on the wire (not what the layers do; grad_dtype_bytes=2);
    # the dK/dV reduce-scatter (16 elements) in bf16 (the default) or fp32
    assert fm.tsp_layer_comm(s, 2, grad_dtype_bytes=2) == {
        "attn_fwd": 240.0,
        "mlp_fwd": 312.0,
        "attn_bwd": 480.0,
        "mlp_bwd": 624.0,
    }
    assert (
        fm.tsp_layer_comm(s, 2, grad_dtype_bytes=2, kv_grad_reduce_in_fp32=True)["attn_bwd"]
        == 480.0 + 16 * 2
    )
    # default: fp32 gradient accumulators, grads at 4 bytes, weights/activations at 2
    c = fm.tsp_layer_comm(s, 2)
    assert c == fm.tsp_layer_comm(s, 2, grad_dtype_bytes=4)
    assert c["attn_bwd"] == (104 + 16) * 2 + 16 * 2 + 104 * 4
    assert c["mlp_bwd"] == 156 * 2 + 156 * 4
    # fp32 / fp64 models: accumulators in the model dtype
    assert fm.accumulation_bytes(4) == 4 and fm.accumulation_bytes(8) == 8
    # without the backward K/V re-gather
    assert fm.tsp_layer_comm(s, 2, regather_kv_bwd=False)["attn_bwd"] == c["attn_bwd"] - 16 * 2


def test_megatron_tp_sp_and_tp():
    s = _shape(batch=2, seq=12, hidden=16, heads=4, dtype_bytes=4)
    x = 2 * 12 * 16 * 4  # B*S*h bytes
    for D in (2, 4, 8):
        f = (D - 1) / D
        c = fm.tp_sp_layer_comm(s, D)
        assert c == pytest.approx(
            {
                "attn_fwd": 2 * f * x,
                "mlp_fwd": 2 * f * x,
                "attn_bwd": 3 * f * x,
                "mlp_bwd": 3 * f * x,
            }
        )
        assert fm.fwd(c) == pytest.approx(4 * f * x) and fm.bwd(c) == pytest.approx(6 * f * x)
        t = fm.tp_layer_comm(s, D)
        assert fm.fwd(t) == pytest.approx(4 * f * x) and fm.bwd(t) == pytest.approx(4 * f * x)
        ops = fm.sum_terms(fm.tp_layer_terms(s, D), by="op")
        assert set(ops) == {"all_reduce"}


def test_cp_and_tp_cp():
    s = LayerShape(batch=1, seq=32, hidden=16, heads=4, query_groups=2, dtype_bytes=2)
    kv = 2 * 32 * 8 * 2  # 2*B*S*h_kv bytes
    c = fm.cp_layer_comm(s, 4)
    assert c == pytest.approx(
        {"attn_fwd": 0.75 * kv, "attn_bwd": 1.5 * kv, "mlp_fwd": 0.0, "mlp_bwd": 0.0}
    )
    assert fm.cp_layer_comm(s, 4, regather_kv_bwd=False)["attn_bwd"] == pytest.approx(0.75 * kv)
    # TP2 x CP2: TP+SP on the B*S/2 local tokens + CP of K/V heads split over TP
    tc = fm.tp_cp_layer_comm(s, 2, 2)
    x_local = 1 * 16 * 16 * 2
    assert fm.fwd(tc) == pytest.approx(0.5 * 4 * x_local + 0.5 * kv / 2)
    assert fm.bwd(tc) == pytest.approx(0.5 * 6 * x_local + 2 * 0.5 * kv / 2)


# --- invariances ------------------------------------------------------------------------------
def test_group_of_one_moves_nothing(seed):
    for s in _random_shapes(seed, 5):
        for fn in (fm.tsp_layer_comm, fm.tp_sp_layer_comm, fm.tp_layer_comm, fm.cp_layer_comm):
            assert set(fn(s, 1).values()) == {0.0}


def test_tsp_activation_traffic_is_cp_traffic_and_weights_ignore_tokens(seed):
    for s in _random_shapes(seed):
        D = 4
        split = fm.tsp_layer_split(s, D)
        split32 = fm.tsp_layer_split(s, D, kv_grad_reduce_in_fp32=True)
        cp = fm.cp_layer_comm(s, D)
        for p in fm.PHASES:
            # same elements and bytes as CP (its dK/dV reduce-scatter is in the compute dtype
            # too); with kv_grad_reduce_in_fp32 TSP's is in the accumulation dtype
            assert split[p]["activation"] == pytest.approx(cp[p])
            extra = 0.0
            if p == "attn_bwd":
                extra = (
                    fm.ring_factor(D)
                    * 2
                    * s.tokens
                    * s.kv_hidden
                    * (fm.accumulation_bytes(s.dtype_bytes) - s.dtype_bytes)
                )
            assert split32[p]["activation"] == pytest.approx(cp[p] + extra)
        # weights and grads do not depend on B or S; activations only through B*S
        other = s.with_seq(s.seq * 3).with_batch(s.batch * 2)
        split2 = fm.tsp_layer_split(other, D)
        folded = LayerShape(**{**s.__dict__, "batch": 1, "seq": s.batch * s.seq})
        for p in fm.PHASES:
            assert split2[p]["weight"] == split[p]["weight"]
            assert split2[p]["grad"] == split[p]["grad"]
            assert split2[p]["activation"] == pytest.approx(6 * split[p]["activation"])
        assert fm.tsp_layer_comm(folded, D) == pytest.approx(fm.tsp_layer_comm(s, D))
        # totals are the sum of the split
        tot = fm.tsp_layer_comm(s, D)
        for p in fm.PHASES:
            assert sum(split[p].values()) == pytest.approx(tot[p])


def test_attention_mlp_symmetry():
    # MHA without bias: W_attn = 4h^2, W_mlp = 2Fh -> equal for F = 2h; then TSP moves the same
    # weight bytes in both blocks, and TP+SP is symmetric for any F.
    s = LayerShape(batch=1, seq=64, hidden=32, heads=4, ffn=64)
    split = fm.tsp_layer_split(s, 8)
    assert split["attn_fwd"]["weight"] == split["mlp_fwd"]["weight"]
    assert (
        split["attn_bwd"]["weight"] + split["attn_bwd"]["grad"]
        == split["mlp_bwd"]["weight"] + split["mlp_bwd"]["grad"]
    )
    c = fm.tp_sp_layer_comm(s.with_seq(48), 8)
    assert c["attn_fwd"] == c["mlp_fwd"] and c["attn_bwd"] == c["mlp_bwd"]


def test_weight_traffic_scales_with_f():
    s = _shape()
    w = [fm.tsp_layer_split(s, D)["mlp_fwd"]["weight"] for D in (2, 4, 8)]
    assert w[0] / (1 / 2) == pytest.approx(w[1] / (3 / 4)) == pytest.approx(w[2] / (7 / 8))


# --- crossover --------------------------------------------------------------------------------
PAPER_7B = LayerShape(batch=1, seq=1, hidden=4096, heads=32, ffn=16384)


@pytest.mark.parametrize("D", [2, 4, 8, 16])
def test_paper_model_crossover_constants(D):
    h = PAPER_7B.hidden
    # forward: 12h^2 + 2BSh <= 4BSh  <=>  BS >= 6h (independent of D)
    assert fm.crossover_seq_length(PAPER_7B, D, "fwd") == pytest.approx(6 * h)
    # fwd+bwd with bf16 weight gradients on the wire (the paper's count); the layers' dK/dV
    # reduce-scatter in bf16, so the activation traffic is 2 + 2 + 2 = 6BSh (bf16 units):
    # vs TP+SP: 36h^2 + 6BSh <= 10BSh -> 9h; vs plain TP (8BSh): 18h
    bf16_grads = {"grad_dtype_bytes": 2}
    assert fm.crossover_seq_length(PAPER_7B, D, "total", **bf16_grads) == pytest.approx(9 * h)
    tp = fm.crossover_seq_length(PAPER_7B, D, "total", baseline="tp", **bf16_grads)
    assert tp == pytest.approx(18 * h)
    # what the layers send: fp32 gradient accumulators, the 12h^2 grad term counts twice:
    # 48h^2 + 6BSh <= 10BSh -> 12h; vs TP: 24h
    assert fm.crossover_seq_length(PAPER_7B, D, "total") == pytest.approx(12 * h)
    assert fm.crossover_seq_length(PAPER_7B, D, "total", baseline="tp") == pytest.approx(24 * h)
    # --tsp-kv-grad-reduce-in-fp32: dK/dV at 4 bytes, 2 + 2 + 2*2 = 8BSh: 48h^2 + 8BSh <= 10BSh
    # -> 24h; vs TP never in bytes
    kv32 = {"kv_grad_reduce_in_fp32": True}
    assert fm.crossover_seq_length(PAPER_7B, D, "total", **kv32) == pytest.approx(24 * h)
    assert math.isinf(fm.crossover_seq_length(PAPER_7B, D, "total", baseline="tp", **kv32))
    # batch: the crossover is in B*S
    assert fm.crossover_seq_length(PAPER_7B.with_batch(4), D) == pytest.approx(6 * h / 4)
    ca = fm.crossover_analysis(PAPER_7B, D)
    assert ca["weights_over_h2"] == 12 and ca["weights_for_8h_over_h2"] == 16
    assert ca["fwd_weights_without_f"] == pytest.approx(6 / ((D - 1) / D))


def test_crossover_solves_the_inequality(seed):
    for s in _random_shapes(seed, 30):
        for D in (2, 4, 8):
            for direction, baseline in (
                ("fwd", "tp_sp"),
                ("bwd", "tp_sp"),
                ("total", "tp_sp"),
                ("total", "tp"),
            ):
                x = fm.crossover_seq_length(s, D, direction, baseline)
                sel = {"fwd": fm.fwd, "bwd": fm.bwd, "total": fm.total}[direction]
                base = {"tp_sp": fm.tp_sp_layer_comm, "tp": fm.tp_layer_comm}[baseline]

                def gap(seq):  # TSP - baseline at a real-valued sequence length
                    shp = LayerShape(**{**s.__dict__, "seq": seq})
                    return sel(fm.tsp_layer_comm(shp, D)) - sel(base(shp, D))

                case = f"{s} D={D} {direction} vs {baseline}: crossover {x}"
                if math.isinf(x):
                    # documented: TSP's per-token traffic is not below the baseline's (e.g. the
                    # backward of MHA, where the fp32 dK/dV reduce-scatter outweighs TP+SP), so
                    # TSP moves more bytes at every length
                    assert gap(1.0) > 0 and gap(1e12) > 0, case
                    continue
                assert x > 0, case
                scale = sel(fm.tsp_layer_comm(s.with_seq(1), D))
                assert abs(gap(x)) <= 1e-9 * scale, case
                assert gap(x * 1.01) < 0 < gap(x * 0.99), case
            # closed form of the forward crossover
            fwd_x = fm.crossover_seq_length(s, D, "fwd")
            assert fwd_x * s.batch == pytest.approx(s.w_layer / (4 * s.hidden - 2 * s.kv_hidden))


def test_crossover_trivial_group():
    assert fm.crossover_seq_length(PAPER_7B, 1) == 0.0


# --- per-step terms -----------------------------------------------------------------------------
def test_step_level_terms():
    s = LayerShape(batch=2, seq=8, hidden=8, heads=2, bias=True)
    # replicated per layer: 2 LayerNorms (2*8 each) + proj bias + fc2 bias = 48
    assert (
        fm.replicated_grad_allreduce(s, 4, num_layers=3, extra_params=16)
        == 2 * 0.75 * (3 * 48 + 16) * 4
    )
    d = fm.dp_step_comm(1000, 4)
    assert d == {"grad_reduce": 0.75 * 1000 * 4, "param_gather": 0.75 * 1000 * 2}
    d = fm.dp_step_comm(1000, 4, distributed_optimizer=False)
    assert d == {"grad_reduce": 2 * 0.75 * 1000 * 4, "param_gather": 0.0}
    x = 2 * 8 * 8 * 2
    hc = fm.head_comm(s, 4, "tp_sp")
    assert hc == fm.head_comm(s, 4, "tsp", vocab_ring="never")
    # 16 tokens against a 32k vocabulary: "auto" keeps Megatron's output layer (fewer bytes)
    assert hc == fm.head_comm(s, 4, "tsp")
    assert hc["fwd"] == pytest.approx(2 * 0.75 * x + 3 * 2 * 0.75 * 16 * 4)
    assert hc["bwd"] == pytest.approx(3 * 0.75 * x)
    # TSP's vocabulary ring: the padded vocabulary's weight shards (32000 -> 32256 = 63 x 512),
    # bf16 each way plus the fp32 gradient accumulator; the losses' fp32 gather; the embedding
    v = 32256 * 8
    hc = fm.head_comm(s, 4, "tsp", vocab_ring="always")
    assert hc["fwd"] == pytest.approx(0.75 * x + 0.75 * v * 2 + 0.75 * 16 * 4)
    assert hc["bwd"] == pytest.approx(0.75 * x + 0.75 * v * 2 + 0.75 * v * 4)
    assert fm.head_comm(s, 4, "tp")["bwd"] == pytest.approx(2 * 0.75 * x)
    with pytest.raises(ValueError, match="policy 'on'"):
        fm.head_comm(s, 4, "tsp", vocab_ring="on")


def test_vocab_ring_auto_takes_the_head_that_receives_fewer_bytes(seed):
    """ "auto" (the layer's rule, ``output_head.ring_receives_fewer_bytes``) picks whichever of
    the two heads ``head_comm`` counts fewer bytes for, on both sides of the crossover."""
    from megatron_tsp.core import output_head

    rng = random.Random(seed)
    for _ in range(20):
        hidden, vocab, b = rng.choice([64, 512, 4096]), rng.choice([1000, 32000, 128256]), 2
        d = rng.choice([2, 4, 8])
        cross = output_head.crossover_tokens(-(-vocab // (128 * d)) * 128 * d, hidden, b, 4)
        for seq in (cross - 1, cross, 2 * cross):
            s = LayerShape(batch=1, seq=seq, hidden=hidden, heads=8, vocab=vocab, dtype_bytes=b)
            auto, ring, megatron = (
                sum(fm.head_comm(s, d, "tsp", vocab_ring=p).values())
                for p in ("auto", "always", "never")
            )
            assert auto == min(ring, megatron), (seed, hidden, vocab, d, seq)
            assert (auto == ring) == (seq >= cross) or ring == megatron, (seed, seq, cross)


# --- FLOPs ------------------------------------------------------------------------------------
def test_layer_flops_hand_checked():
    s = _shape()  # weights 192 + 64 + 256 + 256 = 768, B*S = 16, S = 16, h = 8
    f = fm.layer_flops(s)
    assert f["fwd_matmul"] == 2 * 16 * 768
    assert f["fwd_attn_core"] == 2 * 2 * 16 * 16 * 8 * 0.5
    assert f["fwd"] == 24576 + 4096 and f["bwd"] == 2 * f["fwd"] and f["recompute"] == 0
    tsp = fm.layer_flops(s, recompute_fc1=True, recompute_attn_core=True)
    assert tsp["recompute"] == 2 * 16 * 256 + 4096
    assert tsp["total"] == 3 * f["fwd"] + tsp["recompute"]
    full = fm.layer_flops(s, full_recompute=True)
    assert full["recompute"] == f["fwd"] and full["total"] == 4 * f["fwd"]
    # gated MLP: fc1 has 2F rows; GQA does not change attention-core FLOPs
    g = fm.layer_flops(
        LayerShape(batch=1, seq=16, hidden=8, heads=2, query_groups=1, ffn=32, gated=True)
    )
    assert g["fwd_matmul"] == 2 * 16 * ((8 + 8) * 8 + 64 + 64 * 8 + 256)
    assert g["fwd_attn_core"] == f["fwd_attn_core"]
    # doubling S doubles GEMMs and quadruples attention
    f2 = fm.layer_flops(s.with_seq(32))
    assert f2["fwd_matmul"] == 2 * f["fwd_matmul"] and f2["fwd_attn_core"] == 4 * f["fwd_attn_core"]


def test_shape_validation():
    with pytest.raises(ValueError):
        LayerShape(batch=1, seq=4, hidden=10, heads=4)
    with pytest.raises(ValueError):
        LayerShape(batch=1, seq=4, hidden=8, heads=4, query_groups=3)


def test_design_md_shows_the_current_layer_schedule():
    """docs/design.md's schedule table is ``formulas.TSP_SCHEDULE``, generated."""
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "design.md")
    with open(path) as f:
        text = f.read()
    assert fm.schedule_doc_block() in text, (
        "docs/design.md is out of date: replace the block between the schedule markers with "
        "megatron_tsp.tools.estimator.formulas.schedule_doc_block()"
    )
    assert len(fm.TSP_SCHEDULE) == len(fm.tsp_layer_terms(_shape(), 4))  # defaults: every row
