"""Mixture-of-Experts under TSP, experts folded onto the TSP axis (``tests/checks_moe.py``):
megatron-core's MoELayer behind TSP attention equals the single-process stock model and stock
Megatron TP=D+SP with the same expert-model-parallel size, fp64: loss, logged aux losses, every
gradient (experts perturbed per global id). The TSP expert ring (``tsp_moe_ring``: experts
sharded 1/D, ETP=D, EP=1) against both references, with empty experts, and its counted bytes."""

import pytest

from tests import checks_moe

# (D, EP): experts over the whole TSP group, and (D=4) over half of it (each expert on 2 ranks)
LAYOUTS = [(2, 2), (4, 4), (4, 2)]


@pytest.mark.parametrize("case", list(checks_moe.CASES))
@pytest.mark.parametrize("d,ep", LAYOUTS, ids=[f"D{d}-EP{ep}" for d, ep in LAYOUTS])
def test_moe_matches_single_process_fp64(pool4, seed, d, ep, case):
    errors = pool4.run(checks_moe.check_moe_vs_single, d, ep, seed, case)
    print(f"worst relative errors: {checks_moe.worst(errors)}")


@pytest.mark.parametrize("case", list(checks_moe.CASES))
@pytest.mark.parametrize("d,ep", LAYOUTS, ids=[f"D{d}-EP{ep}" for d, ep in LAYOUTS])
def test_moe_equals_megatron_tp_sp(pool4, seed, d, ep, case):
    errors = pool4.run(checks_moe.check_moe_vs_tp_sp, d, ep, seed, case)
    print(f"worst relative errors: {checks_moe.worst(errors)}")


@pytest.mark.parametrize("d,ep", [(2, 2), (4, 2)], ids=["D2-EP2", "D4-EP2"])
def test_moe_traffic_equals_tp_sp(pool4, seed, d, ep):
    counts = pool4.run(checks_moe.check_moe_traffic_equals_tp_sp, d, ep, seed)
    print(f"rank 0 MoE-layer collectives: {counts[0]}")


@pytest.mark.parametrize("case", list(checks_moe.CASES))
@pytest.mark.parametrize("d", [2, 4], ids=["D2", "D4"])
def test_moe_ring_matches_single_and_tp_sp_fp64(pool4, seed, d, case):
    """The TSP expert ring (every expert sharded 1/D, ETP=D, EP=1, tokens stay) equals the
    single-process model and Megatron TP=D+SP with ETP=D, EP=1 (allgather dispatcher)."""
    errors = pool4.run(checks_moe.check_moe_ring, d, seed, case)
    for ref in ("single", "tp_sp"):
        print(f"vs {ref}: worst relative errors: {checks_moe.worst([e[ref] for e in errors])}")


@pytest.mark.parametrize("case", sorted(checks_moe.CASES))
def test_moe_ring_under_tsp_x_cp_matches_single_fp64(pool4, seed, case):
    """The TSP expert ring under TSP2 x CP2 (4 sequence ranks; experts sharded over the 2 TSP
    ranks, replicated over CP) equals the single-process stock model in fp64: loss, logged aux
    losses, every gradient."""
    errors = pool4.run(checks_moe.check_moe_ring_cp, 2, 2, seed, case)
    print(f"ring x CP ({case}) worst errors: {checks_moe.worst(errors)}")


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("d", [2, 4], ids=["D2", "D4"])
def test_moe_ring_traffic_formula(pool4, seed, d, dtype):
    """Per MoE layer and rank the ring sends E x (D-1) expert shards forward, the same plus the
    gradient accumulator (fp32 in bf16) backward, and no token collectives (docs/moe.md)."""
    counts = pool4.run(checks_moe.check_moe_ring_traffic, d, seed, dtype)
    print(f"rank 0 expert-ring collectives: {counts[0]}")


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "fc1-bias"])
def test_moe_ring_zero_tokens(pool4, seed, with_bias):
    """Experts without tokens on a rank, and a rank without tokens, still take every ring step."""
    errors = pool4.run(checks_moe.check_expert_ring_zero_tokens, 4, seed, with_bias)
    print(f"worst relative errors: {checks_moe.worst(errors)}")


def test_moe_ring_activation_kernel(pool4, seed):
    """The expert ring's activation backward through TSP's Triton kernel (the CUDA default, the
    MLP's ``activation_backward``), run in Triton's interpreter on fp32 experts, zero-token
    experts and ranks included: equal to the same experts in fp32 torch ops."""
    errors = pool4.run(checks_moe.check_expert_ring_zero_tokens, 4, seed, True, True)
    print(f"worst relative errors: {checks_moe.worst(errors)}")


@pytest.mark.parametrize("d", [2, 4])
def test_expert_ring_queue_order(pool4, d):
    """The expert ring's hops and GEMMs in issue order (``weight_ring``'s schedule, every expert
    per step): forward, each step's GEMMs behind the next weight hop. Backward: step t's dX work
    (covering the accumulator hop in flight), the next weight hop, the weight-gradient GEMMs onto
    the arrived accumulator, its hop; the last shard's dX GEMMs are held back and issued between
    the drain's post and its wait, so the drain has work behind it. (Post order is read from the
    CommCounter; late completion would run transfers at wait(), so it is off here.)"""
    e = 3
    trace = pool4.run(checks_moe.trace_expert_ring, d, e, late_completion=False)[0]
    p2p = ["isend", "irecv"]
    assert trace["fwd"] == (p2p + ["mm"] * 2 * e) * (d - 1) + ["mm"] * 2 * e
    d_act, d_x, wgrad = ["mm"] * e, ["mm"] * e, ["mm"] * 2 * e
    # per expert: d(activation) = dY W2, then its dX GEMM
    with_dx = ["mm", "mm"] * e
    expected = p2p + with_dx + wgrad
    for t in range(1, d):
        expected += (with_dx if t < d - 1 else d_act) + (p2p if t < d - 1 else []) + wgrad + p2p
    expected += d_x  # the last shard's dX, issued while the drain is in flight
    assert trace["bwd"] == expected


# One option at a time (checks_moe.OPTION_CASES), both schedules: (D, EP, ring); the ring has
# EP=1, ETP=D.
OPTION_RUNS = [(2, 2, False), (4, 2, False), (2, 1, True), (4, 1, True)]
EMPTY_RUNS = [(4, 4, False), (4, 2, False), (4, 1, True)]


def _run_ids(runs):
    return [f"ring-D{d}" if ring else f"folded-D{d}-EP{ep}" for d, ep, ring in runs]


def _print_option_errors(results):
    for ref in ("single", "tp_sp"):
        print(f"vs {ref}: worst relative errors: {checks_moe.worst([r[ref] for r in results])}")


@pytest.mark.parametrize("d,ep,ring", OPTION_RUNS, ids=_run_ids(OPTION_RUNS))
def test_moe_apply_probs_on_input_matches_single_and_tp_sp_fp64(pool4, seed, d, ep, ring):
    """Top-1 with ``moe_apply_probs_on_input`` (the router probability scales the experts' input,
    not their output): loss, logged aux losses and every gradient (the router's included) equal
    the single-process stock model and Megatron TP=D+SP with the same expert layout, fp64."""
    results = pool4.run(checks_moe.check_moe_option, d, ep, seed, "probs_on_input", ring)
    _print_option_errors(results)


@pytest.mark.parametrize("d,ep,ring", EMPTY_RUNS, ids=_run_ids(EMPTY_RUNS))
def test_moe_empty_experts_match_single_and_tp_sp_fp64(pool4, seed, d, ep, ring):
    """A model whose routers leave experts without tokens on a rank (8 tokens, top-1, one expert
    starved by its router weights: ``checks_moe.OPTION_CASES``), both schedules: fp64 parity
    with both references, and the tokens each rank's experts received (counted by hooks) show
    that it happened: the starved expert got none on any rank, and (ring) every rank left an
    expert empty."""
    results = pool4.run(checks_moe.check_moe_option, d, ep, seed, "empty_experts", ring)
    _print_option_errors(results)
    starved = checks_moe.OPTION_CASES["empty_experts"]["starve"]
    for run in results[0]["tokens"]:
        per_rank = [r["tokens"][run] for r in results]  # [rank][MoE layer] {expert: tokens}
        for layer in range(len(per_rank[0])):
            seen = [counts[layer] for counts in per_rank]
            print(f"{run}, MoE layer {layer}: tokens per expert per rank {seen}")
            assert any(c.get(starved) == 0 for c in seen), (run, layer, seen, f"seed={seed}")
            assert all(c.get(starved, 0) == 0 for c in seen), (run, layer, seen, f"seed={seed}")
            assert sum(sum(c.values()) for c in seen) > 0, (run, layer, seen, f"seed={seed}")
            if ring:
                assert all(0 in c.values() for c in seen), (run, layer, seen, f"seed={seed}")


# A near-tie in the router's top-k is decided by rounding: a run that routes one token to another
# expert than the fp64 model does has an error set by that token (measured: 1.4x or 0.5x TP+SP's
# in one seed), a coin both schedules toss equally. Seeds where a pair's runs route differently
# from the fp64 model are set aside (counted, printed) until MOE_BF16_SEEDS seeds route alike.
MOE_BF16_SEEDS = 4
MOE_BF16_MAX_DRAWS = 8
MOE_BF16_MAX_FLIPS = 3  # tokens per run; a routing bug changes far more


@pytest.mark.parametrize("d", [4])
def test_moe_bf16_no_less_accurate_than_tp_sp(pool4, seed, d):
    """bf16, both schedules (experts folded onto the TSP axis, EP=D; the TSP expert ring,
    ETP=D) against Megatron TP=D+SP with the same expert layout, each against the fp64
    single-process model on the same bf16-representable weights: over ``MOE_BF16_SEEDS`` seeds
    whose bf16 runs route every token as the fp64 model does, TSP's median gradient error and its
    mean error over the expert weights within 5% of TP+SP's (per seed 0.45-0.89x; docs/moe.md).
    Every run routes at most ``MOE_BF16_MAX_FLIPS`` tokens differently from the fp64 model."""
    import statistics

    pairs = {"folded": ("tp_sp_ep", "tsp_ep"), "ring": ("tp_sp_etp", "tsp_ring")}
    ratios = {k: ([], []) for k in pairs}
    set_aside = {k: [] for k in pairs}
    for i in range(MOE_BF16_MAX_DRAWS):
        if all(len(r[0]) >= MOE_BF16_SEEDS for r in ratios.values()):
            break
        r = pool4.run(checks_moe.moe_bf16_errors_vs_fp64, d, seed + i)[0]
        flips = {k: v["flips"] for k, v in r.items()}
        assert max(flips.values()) <= MOE_BF16_MAX_FLIPS, (flips, f"seed={seed + i}")
        for k, (base, tsp) in pairs.items():
            if flips[base] or flips[tsp]:
                set_aside[k].append((seed + i, flips[base], flips[tsp]))
                continue
            a, b = r[base]["per_param"], r[tsp]["per_param"]
            ratios[k][0].append(statistics.median(b.values()) / statistics.median(a.values()))
            ratios[k][1].append(statistics.mean(b[n] / a[n] for n in a if ".experts." in n))
    for k, (median, experts) in ratios.items():
        print(
            f"{k}: median gradient error ratio {median}, expert weights {experts}; set aside "
            f"(seed, TP+SP flips, TSP flips): {set_aside[k]}"
        )
        assert len(median) >= MOE_BF16_SEEDS, (k, set_aside[k], f"seed={seed}")
        assert statistics.mean(median) <= 1.05, (k, median, f"seed={seed}")
        assert statistics.mean(experts) <= 1.05, (k, experts, f"seed={seed}")


# the alltoall dispatcher: experts over the whole TSP group, over half of it, and one per rank
ALLTOALL = [(2, 2, "moe"), (4, 2, "shared"), (4, 4, "dense_then_moe")]


@pytest.mark.parametrize("d,ep,case", ALLTOALL, ids=[f"D{d}-EP{e}-{c}" for d, e, c in ALLTOALL])
def test_moe_alltoall_dispatcher_matches_single_and_tp_sp(pool4, seed, d, ep, case):
    """megatron-core's alltoall dispatcher behind TSP attention (its CUDA side stream and
    host copies answered as the CPU runner does) equals the single-process stock model and
    Megatron TP=D+SP with the same EP and dispatcher in fp64."""
    errors = pool4.run(checks_moe.check_moe_alltoall, d, ep, seed, case)
    for ref in ("single", "tp_sp"):
        print(f"vs {ref}: worst relative errors: {checks_moe.worst([e[ref] for e in errors])}")


@pytest.mark.parametrize("d,ep", [(2, 2), (4, 2), (4, 4)], ids=["D2-EP2", "D4-EP2", "D4-EP4"])
def test_moe_alltoall_traffic_equals_formula_on_its_routing(pool4, seed, d, ep):
    """Bytes each rank receives from the alltoall dispatcher (counted, exact for uneven
    all-to-alls) equal ``estimator.moe.alltoall_received`` on the run's own routing; printed
    next to the uniform-routing expectation."""
    results = pool4.run(checks_moe.check_moe_alltoall_traffic, d, ep, seed)
    for rank, r in enumerate(results):
        total = sum(v for ops in r["counted"].values() for v in ops.values())
        print(
            f"rank {rank}: {total:.0f} B received, uniform expectation "
            f"{r['uniform_expectation']:.0f} B ({total / r['uniform_expectation']:.2f}x)"
        )
