"""Batch wiring, spec selection, loss normalization and checkpoint interop on 2 gloo ranks.

One spawned pool of 2 CPU ranks runs every check (process start-up dominates the cost).
"""

import json
import os
import subprocess
import sys

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


def test_batch_hook_zigzags_after_broadcast_d4(pool4, seed):
    results = pool4.run(checks.check_batch_hook, seed)
    assert len(results) == 4 and all(r == {"ok": True} for r in results)


def test_batch_hook_reads_packed_documents(pool2, seed):
    results = pool2.run(checks.check_batch_hook_documents, seed)
    assert all(r == {"ok": True} for r in results)


def test_batch_hook_reads_packed_documents_d4(pool4, seed):
    results = pool4.run(checks.check_batch_hook_documents, seed)
    assert len(results) == 4 and all(r == {"ok": True} for r in results)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_spec_hook_builds_tsp_model_with_megatron_loss(pool2, seed, style):
    results = pool2.run(checks.check_spec_hook_and_loss, seed, style)  # loss asserted in-rank
    assert results[0]["tokens"] == results[1]["tokens"] > 0


@pytest.mark.parametrize("d", [2, 4])
def test_dist_checkpoint_tp_sp_and_tsp_both_ways(seed, tmp_path, d):
    """Megatron dist_checkpointing (torch_dist) save under TP=D+SP, load under TSP-D and back
    (also with one K/V head: fewer than D), D = 2 and 4.

    Runs in its own 2 non-daemon ranks (ckpt_roundtrip.py): Megatron's writer starts a
    multiprocessing Manager and forks writer processes.
    """
    pytest.importorskip(
        "psutil", reason="megatron-core's torch_dist checkpoint writer needs psutil"
    )
    script = os.path.join(os.path.dirname(__file__), "ckpt_roundtrip.py")
    proc = subprocess.run(
        [sys.executable, script, str(tmp_path), str(seed), str(d)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.load(open(tmp_path / "results.json"))
    for style in ("gpt2", "llama", "llama-mqa"):  # llama-mqa: fewer K/V heads than D
        assert len(results[style]) == d
        for rank_result in results[style]:
            assert rank_result["keys"] > 10
            for direction in ("tp_sp->tsp", "tsp->tp_sp"):
                assert rank_result[direction] <= 1e-5, results  # also asserted in-rank
    for name in ("tp_sp_to_tsp_gpt2", "tsp_to_tp_sp_llama"):
        assert (tmp_path / "ckpt" / name / "metadata.json").is_file()
