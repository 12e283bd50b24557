"""At long sequence lengths under TSP no S x S attention mask is built, broadcast or permuted.

Megatron-LM builds one per sample in the data loader by default (at 128k: 17 GB as bool, 69 GB
as the float tril it starts from); TSP attention never reads it. The launcher turns it off
(``--no-create-attention-mask-in-dataloader``) and the batch hook leaves masks alone. Measured on
Megatron-LM's own data path (pretrain_gpt's dataset provider and ``get_batch``, 2 gloo ranks,
see long_mask_check.py): a 128k micro-batch for a tiny-width model must grow peak memory by O(S)
bytes, also with packed documents (``--reset-attention-mask --reset-position-ids``: the batch hook
reads them from the position ids). A stock run at 8k with the default mask is the control that
shows the measurement sees an S x S allocation.
"""

import json
import os

import pytest

from megatron_tsp.megatron_lm.cpu_runner import run_training
from tests.megatron_lm.common import megatron_lm_path

CHECKOUT = megatron_lm_path()
pytestmark = pytest.mark.skipif(
    CHECKOUT is None, reason="set MEGATRON_LM_PATH to a Megatron-LM checkout to run these"
)
CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "long_mask_check.py")


def _args(seq):
    return [
        "--num-layers",
        "1",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "2",
        "--ffn-hidden-size",
        "32",
        "--seq-length",
        str(seq),
        "--max-position-embeddings",
        str(seq),
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "2",
        "--train-iters",
        "1",
        "--lr",
        "1e-4",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "255",
        "--transformer-impl",
        "local",
        "--no-persist-layer-norm",
    ]


def _results(run):
    lines = [
        line.split("LONG_MASK_RESULT ", 1)[1]
        for line in run.log.splitlines()
        if "LONG_MASK_RESULT " in line
    ]
    assert len(lines) == 2, run.log[-4000:]
    return sorted((json.loads(x) for x in lines), key=lambda r: r["rank"])


def test_128k_batch_allocates_o_of_s():
    seq = 131072
    run = run_training(
        CHECK,
        _args(seq) + ["--tensor-sequence-parallel-size", "2"],
        2,
        env={"MEGATRON_LM_PATH": CHECKOUT, "PYTHONPATH": CHECKOUT},
    )
    assert "--no-create-attention-mask-in-dataloader" in run.log  # the launcher says so
    for r in _results(run):
        assert r["create_attention_mask_in_dataloader"] is False
        assert r["attention_mask_shape"] is None
        assert r["tokens_shape"] == [1, seq]
        # zigzag: chunk 0 then chunk 2D-1 = 3 (chunks of S/4)
        assert r["positions_head"] == [0, 1, 2, 3]
        # O(S): a few [1, S] int64 / float tensors (1 MiB each) and their numpy sources;
        # one S x S bool mask would be 16 GiB
        assert r["growth_bytes"] < 64 * seq * 8, r


def test_128k_packed_documents_allocate_o_of_s():
    """``--reset-attention-mask --reset-position-ids`` at 128k under TSP: Megatron's mock data
    ends a document every 1-4096 tokens; the batch hook reads the documents from the position-id
    restarts (no S x S mask is built, broadcast, permuted or derived) and hands TSP attention
    their starts, a [samples, 1 + documents] CPU tensor."""
    seq = 131072
    run = run_training(
        CHECK,
        _args(seq)
        + ["--reset-attention-mask", "--reset-position-ids"]
        + ["--tensor-sequence-parallel-size", "2"],
        2,
        env={"MEGATRON_LM_PATH": CHECKOUT, "PYTHONPATH": CHECKOUT},
    )
    assert "--no-create-attention-mask-in-dataloader" in run.log
    assert "read from the position-id restarts (--reset-position-ids)" in run.log, run.log[-3000:]
    results = _results(run)
    for r in results:
        assert r["create_attention_mask_in_dataloader"] is False
        assert r["tokens_shape"] == [1, seq]
        assert r["attention_mask_type"] == "DocumentMaskTensor", r
        # many documents, one per position-id restart
        assert r["documents_seq_length"] == seq and r["documents_per_sample"][0] > 8, r
        assert r["documents_per_sample"] == [r["position_restarts"]], r
        assert r["attention_mask_shape"] == [1, 1 + r["position_restarts"]], r
        assert r["growth_bytes"] < 64 * seq * 8, r
    assert results[0]["documents_per_sample"] == results[1]["documents_per_sample"]


def test_control_stock_mask_is_seen_by_the_measurement():
    seq = 8192
    run = run_training(
        CHECK,
        _args(seq) + ["--tensor-model-parallel-size", "2"],
        2,
        env={"MEGATRON_LM_PATH": CHECKOUT, "PYTHONPATH": CHECKOUT},
        stock=True,
    )
    for r in _results(run):
        assert r["create_attention_mask_in_dataloader"] is True
        assert r["attention_mask_shape"] == [1, 1, seq, seq]
        # at least the bool S x S mask, alive in the batch: seen by the resident size (the peak
        # alone can miss it when start-up already set a higher high-water mark)
        assert max(r["growth_bytes"], r["rss_growth_bytes"]) >= seq * seq, r
