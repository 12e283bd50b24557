"""(e) Communication of one TSP layer, counted from the collectives actually issued, equals the
schedule's formula, with no all-reduce; (f) the ring posts the next shard's transfer before the
current shard's matmuls."""

import pytest

from tests import checks_comm

# One configuration: S=32, B=2, h=32, fp32 (4 bytes), D in {2, 4}.
S, B, H, E = 32, 2, 32, 4


def mlp_formula(d, ffn, gated, bias, elem=E, grad_elem=E):
    """Bytes received per rank. The ring moves each rank's (fc1, fc1 bias, fc2) shard D-1 hops:
    forward f*W_mlp; backward the weights again plus a gradient accumulator one hop behind:
    2 f*W_mlp (f = (D-1)/D). The fc2 bias is replicated and never moves. The accumulator has
    ``grad_elem`` bytes per element (fp32 when the model runs in bf16)."""
    f = (d - 1) / d
    rows = (2 if gated else 1) * ffn
    w_mlp = rows * H + (rows if bias else 0) + H * ffn
    return {"fwd": f * w_mlp * elem, "bwd": f * w_mlp * (elem + grad_elem)}


def attention_formula(d, heads, groups, bias):
    """Bytes received per rank. Forward: D broadcasts of (qkv, qkv bias, proj) shards = f*W_attn,
    K and V all-gathered (one packed call) per head group = f*2*B*S*h_kv. Backward: broadcasts
    again (f*W_attn), K/V re-gathered (f*2BSh_kv), dK/dV reduce-scattered (f*2BSh_kv), weight grads
    reduced to the owner (f*W_attn). Same as the table in shared/notes/tsp-algorithm.md."""
    f = (d - 1) / d
    hn = H // heads
    h_kv = groups * hn
    qkv_rows = H + 2 * h_kv
    w_attn = qkv_rows * H + (qkv_rows if bias else 0) + H * H
    kv = 2 * B * S * h_kv
    return {"fwd": f * (w_attn + kv) * E, "bwd": f * (2 * w_attn + 2 * kv) * E}


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("gated,bias", [(False, True), (True, False)])
def test_mlp_comm_matches_formula(pool4, d, gated, bias):
    results = pool4.run(
        checks_comm.measure_layer,
        "mlp",
        d,
        seq=S,
        batch=B,
        hidden=H,
        ffn=64,
        gated=gated,
        bias=bias,
    )
    expected = mlp_formula(d, 64, gated, bias)
    for r in results:
        for phase in ("fwd", "bwd"):
            assert r[phase]["ops"] == ["irecv", "isend"], r[phase]
            assert "all_reduce" not in r[phase]["calls"]
            assert r[phase]["recv"] == pytest.approx(expected[phase], rel=1e-12), (phase, r)
        assert r["fwd"]["calls"] == {"isend": d - 1, "irecv": d - 1}
        assert r["bwd"]["calls"] == {"isend": 2 * (d - 1), "irecv": 2 * (d - 1)}
        assert r["scopes"] == ["tsp_mlp"]


@pytest.mark.parametrize("d", [2, 4])
def test_mlp_bf16_grad_accumulator_travels_in_fp32(pool4, d):
    """bf16 model: weights hop in bf16 (2 bytes), the gradient accumulator in fp32 (4 bytes), and
    the counted bytes still equal the closed form of estimator/formulas.py."""
    from megatron_tsp.tools.estimator import formulas as fm

    results = pool4.run(
        checks_comm.measure_layer,
        "mlp",
        d,
        "bfloat16",
        seq=S,
        batch=B,
        hidden=H,
        ffn=64,
        gated=True,
        bias=False,
    )
    expected = mlp_formula(d, 64, True, False, elem=2, grad_elem=4)
    shape = fm.LayerShape(
        batch=B, seq=S, hidden=H, heads=4, ffn=64, gated=True, bias=False, dtype_bytes=2
    )
    comm = fm.tsp_layer_comm(shape, d)
    assert comm["mlp_fwd"] == pytest.approx(expected["fwd"])
    assert comm["mlp_bwd"] == pytest.approx(expected["bwd"])
    for r in results:
        for phase in ("fwd", "bwd"):
            assert r[phase]["recv"] == pytest.approx(expected[phase], rel=1e-12), (phase, r)


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize(
    "heads,groups,bias",
    [(4, 4, True), (8, 4, False), (8, 2, True), (8, 1, False)],  # groups < D: shared K/V heads
)
def test_attention_comm_matches_formula(pool4, d, heads, groups, bias):
    """Also fewer K/V heads than D (megatron-core's TP layout): the weights still move once per
    shard, but each K/V head is gathered once for the D / groups shards that share it, so the K/V
    bytes stay f*2BSh_kv (h_kv = groups x head dim) in min(D, groups) calls. The estimator's
    closed form (``formulas.tsp_layer_terms``) gives the same bytes and call counts."""
    from megatron_tsp.tools.estimator import formulas as fm

    results = pool4.run(
        checks_comm.measure_layer,
        "attention",
        d,
        seq=S,
        batch=B,
        hidden=H,
        heads=heads,
        groups=groups,
        bias=bias,
    )
    expected = attention_formula(d, heads, groups, bias)
    steps = min(d, groups)  # head groups the schedule walks (one K/V gather each)
    shape = fm.LayerShape(
        batch=B, seq=S, hidden=H, heads=heads, query_groups=groups, bias=bias, dtype_bytes=E
    )
    comm = fm.tsp_layer_comm(shape, d)
    assert comm["attn_fwd"] == pytest.approx(expected["fwd"], rel=1e-12)
    assert comm["attn_bwd"] == pytest.approx(expected["bwd"], rel=1e-12)
    calls = {"broadcast": d, "reduce": d, "all_gather": 2 * steps, "reduce_scatter": 2 * steps}
    for term in fm.tsp_layer_terms(shape, d):
        if term.phase.startswith("attn"):
            assert term.chunks * term.calls_per_chunk == calls[term.op], term
    for r in results:
        # one broadcast and (backward) one weight-gradient reduce per weight shard; per head
        # group two packed K/V all-gathers, the late and the early zigzag halves (and in backward
        # two packed dK/dV reduce-scatters, one per half)
        assert r["fwd"]["calls"] == {"broadcast": d, "all_gather_into_tensor": 2 * steps}
        assert r["bwd"]["calls"] == {
            "broadcast": d,
            "all_gather_into_tensor": 2 * steps,
            "reduce_scatter_tensor": 2 * steps,
            "reduce": d,
        }
        for phase in ("fwd", "bwd"):
            assert r[phase]["recv"] == pytest.approx(expected[phase], rel=1e-12), (phase, r)
        assert r["scopes"] == ["tsp_attention"]


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("kv_grad_fp32,a2a", [(False, False), (True, False), (False, True)])
def test_attention_bf16_dkv_wire_matches_formula(pool4, d, kv_grad_fp32, a2a):
    """bf16 model: the dK/dV reduce-scatter travels in bf16 by default (2 bytes, like TP+SP's
    activation gradients) and in fp32 with ``kv_grad_reduce_in_fp32`` (4 bytes); weights move in
    bf16 and the weight-gradient reduce in fp32. Counted bytes equal the hand formula and
    estimator/formulas.py for both settings (what ``megatron-tsp memory`` and the planner use).
    ``a2a`` (--tsp-kv-grad-all-to-all): one all-to-all per head group instead of the
    reduce-scatter, the same bytes."""
    from megatron_tsp.tools.estimator import formulas as fm

    heads, groups = 8, 4
    results = pool4.run(
        checks_comm.measure_layer,
        "attention",
        d,
        "bfloat16",
        seq=S,
        batch=B,
        hidden=H,
        heads=heads,
        groups=groups,
        bias=False,
        kv_grad_fp32=kv_grad_fp32,
        kv_grad_a2a=a2a,
    )
    f = (d - 1) / d
    h_kv = groups * (H // heads)
    w_attn = (H + 2 * h_kv) * H + H * H
    kv = 2 * B * S * h_kv
    wire = 4 if kv_grad_fp32 else 2
    expected = {"fwd": f * (w_attn + kv) * 2, "bwd": f * (w_attn * (2 + 4) + kv * (2 + wire))}
    shape = fm.LayerShape(
        batch=B, seq=S, hidden=H, heads=heads, query_groups=groups, num_layers=1, dtype_bytes=2
    )
    comm = fm.tsp_layer_comm(shape, d, kv_grad_reduce_in_fp32=kv_grad_fp32, kv_grad_all_to_all=a2a)
    dkv = [t for t in fm.tsp_layer_terms(shape, d, kv_grad_all_to_all=a2a) if "dK,dV" in t.what]
    assert [t.op for t in dkv] == ["all_to_all" if a2a else "reduce_scatter"]
    assert comm["attn_fwd"] == pytest.approx(expected["fwd"])
    assert comm["attn_bwd"] == pytest.approx(expected["bwd"])
    for r in results:
        for phase in ("fwd", "bwd"):
            assert r[phase]["recv"] == pytest.approx(expected[phase], rel=1e-12), (phase, r)
        scatter = "all_to_all_single" if a2a else "reduce_scatter_tensor"
        # two per head-group step, one per zigzag half
        assert r["bwd"]["calls"][scatter] == 2 * d, r["bwd"]["calls"]
        other = "reduce_scatter_tensor" if a2a else "all_to_all_single"
        assert other not in r["bwd"]["calls"], r["bwd"]["calls"]


def test_all_to_all_sum_rounds_once(pool4, seed):
    """--tsp-kv-grad-all-to-all's reduction on 4 ranks: the bf16 partials summed in fp32 at the
    owner (bitwise one fp32 sum), rounded once; the bf16 ring reduce-scatter of the same
    partials rounds at every hop and is further from the exact sum."""
    results = pool4.run(checks_comm.check_all_to_all_sum_rounds_once, seed)
    for r in results:
        # partials already rounded to bf16 + one rounding: ~1.4x one rounding (docs/precision.md)
        assert r["a2a"] < 1.6 * r["one_rounding"], (seed, r)
        assert r["a2a"] < r["ring"], (seed, r)


@pytest.mark.parametrize("d", [2, 4])
def test_mlp_ring_posts_next_shard_before_matmuls(pool4, d):
    # Post order is read from the CommCounter, which records a transfer when torch.distributed
    # runs it; late completion (tests/late_completion.py) runs it at wait(), so this trace
    # test runs with it off (also under TSP_TEST_LATE_COMPLETION=1).
    trace = pool4.run(checks_comm.trace_layer, "mlp", d, late_completion=False)[0]
    # each step's fc1 GEMM behind the next hop; after the ring, the one fc2 GEMM
    expected = ["isend", "irecv", "mm"] * (d - 1) + ["mm", "mm"]
    assert trace["fwd"] == expected
    # Backward: step 0 posts the next weight shard (W) before its matmuls; step t >= 1 runs
    # its dX matmuls (k_a, covering the accumulator hop A(t-1) still in flight), posts W(t+1),
    # runs the two weight-gradient matmuls onto the arrived accumulator (covering W(t+1)) and
    # posts A(t); the last A is the drain, covered by the one dgrad GEMM:
    # W mm*(k_a+2) | mm*k_a W mm*2 A | ... | mm*k_a mm*2 A mm
    bwd = trace["bwd"]
    k_a = (bwd.count("mm") - 1) // d - 2
    p2p, mm_a, mm_b = ["isend", "irecv"], ["mm"] * k_a, ["mm"] * 2
    expected = p2p + mm_a + mm_b
    for t in range(1, d):
        expected += mm_a + (p2p if t < d - 1 else []) + mm_b + p2p
    expected += ["mm"]  # the one dgrad GEMM, issued while the drain is in flight
    assert bwd == expected


@pytest.mark.parametrize("d", [2, 4])
def test_attention_prefetches_next_shard(pool4, d):
    # Post order is read from the CommCounter, which records a transfer when torch.distributed
    # runs it; late completion (tests/late_completion.py) runs it at wait(), so this trace
    # test runs with it off (also under TSP_TEST_LATE_COMPLETION=1).
    fwd = pool4.run(checks_comm.trace_layer, "attention", d, late_completion=False)[0]["fwd"]
    bcasts = [i for i, e in enumerate(fwd) if e == "broadcast"]
    assert len(bcasts) == d
    first_mm = fwd.index("mm")
    # shard 0 and shard 1 are both in flight before shard 0's first matmul
    assert bcasts[0] < bcasts[1] < first_mm
    # shard r+1's broadcast is issued before shard r's projection matmuls start
    # two all-gathers per head group (the early and the late zigzag halves): group r's first
    gathers = [i for i, e in enumerate(fwd) if e == "all_gather_into_tensor"]
    assert len(gathers) == 2 * d
    assert all(gathers[2 * r + 1] == gathers[2 * r] + 1 for r in range(d)), fwd
    gathers = gathers[::2]
    for r in range(d - 1):
        # shard r+1 is in flight before shard r's K/V gather, and not earlier than one ahead
        assert bcasts[r + 1] < gathers[r]
        if r > 0:
            assert bcasts[r + 1] > gathers[r - 1]
