"""TSP layers read linear_qkv / linear_proj / linear_fc1 / linear_fc2 weights without calling those
modules; they must still fire the modules' forward pre-hooks first (Megatron DDP's
``--overlap-param-gather`` waits for the weights' all-gather there). The real training loop with
the flag is in test_training_loop.py."""

import math

import pytest

from tests.megatron_lm import checks_hooks


@pytest.mark.parametrize("kind", ["mlp", "attention"])
@pytest.mark.parametrize("d,bias", [(2, True), (4, False)])
def test_pre_hooks_fire_before_weights_are_read(pool4, seed, kind, d, bias):
    results = pool4.run(checks_hooks.check_pre_hooks_gate_weight_reads, d, seed, kind, bias)
    for rank, r in enumerate(results):
        assert r["fired"] == list(checks_hooks.READ_BY_TSP[kind]) * 2, (rank, r)
        assert math.isfinite(r["err"]) and r["err"] < 1e-12, (rank, r)
        assert math.isfinite(r["err2"]) and r["err2"] < 1e-12, (rank, r)


@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_input_rewriting_hook_is_an_error(pool4, kind):
    for message in pool4.run(checks_hooks.check_input_rewriting_hook_is_refused, 2, kind):
        assert message is not None and "returned replacement inputs" in message
