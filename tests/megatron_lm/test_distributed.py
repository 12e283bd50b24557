"""Batch wiring, spec selection, loss normalization and checkpoint interop on 2 gloo ranks.

One spawned pool of 2 CPU ranks runs every check (process start-up dominates the cost).
"""

import pytest

from tests.megatron_lm import checks


@pytest.fixture(scope="module")
def pool2():
    from tests.harness import RankPool

    pool = RankPool(2)
    yield pool
    pool.close()


def test_batch_hook_zigzags_after_broadcast(pool2, seed):
    results = pool2.run(checks.check_batch_hook, seed)
    assert all(r == {"ok": True} for r in results)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_spec_hook_builds_tsp_model_with_megatron_loss(pool2, seed, style):
    results = pool2.run(checks.check_spec_hook_and_loss, seed, style)
    assert results[0]["tokens"] == results[1]["tokens"] > 0
    assert max(r["loss_rel_err"] for r in results) < 1e-5, results


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_dist_checkpoint_tp_sp_and_tsp_both_ways(pool2, seed, style, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    results = pool2.run(checks.check_dist_checkpoint_interop, root, seed, style)
    assert results[0]["keys"] > 10
    for direction in ("tp_sp->tsp", "tsp->tp_sp"):
        assert max(r[direction] for r in results) < 1e-5, results
