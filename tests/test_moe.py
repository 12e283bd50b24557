"""Mixture-of-Experts under TSP, experts folded onto the TSP axis (``tests/checks_moe.py``):
megatron-core's MoELayer behind TSP attention equals the single-process stock model and stock
Megatron TP=D+SP with the same expert-model-parallel size, fp64: loss, logged aux losses, every
gradient (experts perturbed per global id)."""

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
