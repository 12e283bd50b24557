"""Where waits sit (``tests/wait_order.py``): no kernel reading a receive buffer, or writing a send
buffer, of an asynchronous transfer of ``core/comm.py`` is queued before that transfer's
``wait()``, checked from the host's issue order for every layer with transfers at D = 2 and 4,
forward and backward (inference: the prefill). The queue-order tests (``test_overlap.py``) check
where posts sit; late completion (``test_late_completion.py``) sees a misplaced wait only where
the read happens to return the poison. The recorder's own reports and a planted ring that waits
one step late show it can fail."""

from __future__ import annotations

import pytest

from tests import checks_wait_order

LAYERS = "tests.checks_layers"
# Whole-model checks: the attention's weight-gradient reduce lands in the owner's buffer, which
# autograd hands over as the parameter's .grad without an op; the check reads it only through
# gloo (gather_full_state), which the recorder does not see.
MODEL_UNREAD = ("reduce",)


def _run(pool, module, name, *args, unread_ok=(), **kwargs):
    """The check on every rank with the wait order recorded: (results, transfers per rank).
    Every received buffer must be read by some op after its wait (the recorder sees the
    consumers), except transfers of the ``unread_ok`` calls."""
    out = pool.run(
        checks_wait_order.under_wait_order, module, name, *args, late_completion=False, **kwargs
    )
    for rank, r in enumerate(out):
        unread = [what for fn, what in r["unread"] if fn not in unread_ok]
        assert unread == [], (rank, unread)
    counts = {r["transfers"] for r in out}
    assert len(counts) == 1, counts
    return [r["result"] for r in out], counts.pop()


# --------------------------------------------------------------------------------------------
# the recorder itself


def test_recorder_reports_misplaced_waits(pool4):
    for rank, r in enumerate(pool4.run(checks_wait_order.check_recorder_reports)):
        assert "1 violation(s)" in r["read_recv"], r["read_recv"]
        assert (
            "reads (4,) in the recv buffer 1 (8,) of ring_exchange 'early_read'" in (r["read_recv"])
        ), r["read_recv"]
        assert "tests/checks_wait_order.py" in r["read_recv"], r["read_recv"]
        assert "read_recv_early" in r["read_recv"], r["read_recv"]
        assert (
            "writes (2,) in the send buffer 0 (8,) of ring_exchange 'early_write'"
            in (r["write_send"])
        ), r["write_send"]
        if rank == 0:  # the reduce's root: its buffer is also written by the transfer
            assert "aten.add_.Tensor" in r["reduce_root"], r["reduce_root"]
            assert "in the inout buffer 0 (4,) of reduce" in r["reduce_root"], r["reduce_root"]
        else:  # elsewhere the buffer is only sent: reading it is allowed
            assert r["reduce_root"] == "", r["reduce_root"]
        assert "batch_isend_irecv at" in r["post_busy"], r["post_busy"]
        assert "in the recv buffer 1 (8,) of ring_exchange 'first'" in r["post_busy"], r[
            "post_busy"
        ]
        assert "broadcast 'broadcast'" in r["never_waited"], r["never_waited"]
        assert "(never_waited): never waited" in r["never_waited"], r["never_waited"]
        clean = r["clean"]
        assert clean["transfers"] == 2, clean
        assert len(clean["unread"]) == (0 if rank == 1 else 1), clean  # rank 1 sends


def test_planted_late_ring_wait_is_caught(pool4, seed):
    """The weight ring's forward waiting each hop after the GEMMs that read its shard."""
    for d in (2, 4):
        for rank, message in enumerate(
            pool4.run(checks_wait_order.check_planted_late_wait, d, seed, late_completion=False)
        ):
            assert "in the recv buffer 1" in message and "'mlp.weights'" in message, message
            assert "aten.addmm" in message or "aten.mm" in message, message


# --------------------------------------------------------------------------------------------
# every layer with transfers, D = 2 and 4


@pytest.mark.parametrize("d", [2, 4])
def test_attention_wait_order(pool4, seed, d):
    """Saved backward (GQA, RoPE) and recompute (MHA, biases): weight broadcasts, K/V gathers,
    dK/dV reduce-scatters, weight-gradient reduces."""
    common = dict(seq=16, batch=2)
    _, n = _run(
        pool4, LAYERS, "check_attention", d, seed, "float64", heads=8, groups=4, bias=False,
        rope=True, hidden=64, attention_backward="saved", **common,
    )  # fmt: skip
    assert n == 9 * d
    _, n = _run(
        pool4, LAYERS, "check_attention", d, seed, "float64", heads=4, groups=4, bias=True,
        rope=False, hidden=32, attention_backward="recompute", **common,
    )  # fmt: skip
    assert n == 9 * d


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("recompute", [False, True])
def test_mlp_wait_order(pool4, seed, d, recompute):
    """The weight ring and the gradient-accumulator ring behind it (fc1 kept or recomputed)."""
    _, n = _run(
        pool4, LAYERS, "check_mlp", d, seed, "float64", gated=True, bias=True, seq=16, batch=2,
        hidden=16, ffn=32, activation="silu", recompute_activation=recompute,
    )  # fmt: skip
    assert n == 3 * (d - 1)


@pytest.mark.parametrize("d,style", [(2, "llama"), (4, "gpt2")])
def test_gpt_vocab_ring_wait_order(pool4, seed, d, style):
    """A whole GPT (two layers) with its loss on the vocabulary ring."""
    _, n = _run(
        pool4, "tests.checks_gpt", "check_gpt_vs_single", d, seed, style, rtol=1e-10,
        vocab_ring=True, unread_ok=MODEL_UNREAD,
    )  # fmt: skip
    assert n == 2 * 9 * d + 2 * 3 * (d - 1) + 3 * (d - 1)  # attention, MLP rings, vocab ring


@pytest.mark.parametrize("d", [2, 4])
def test_moe_expert_ring_wait_order(pool4, seed, d):
    """The TSP expert ring (``tsp_moe_ring``) in a GPT with a MoE layer."""
    _, n = _run(pool4, "tests.checks_moe", "check_moe_ring", d, seed, "moe", unread_ok=MODEL_UNREAD)
    assert n == 2 * 9 * d + 2 * 3 * (d - 1)  # two layers: attention, the experts' one ring


@pytest.mark.parametrize("d,style", [(2, "llama"), (4, "gpt2")])
def test_hybrid_wait_order(pool4, seed, d, style):
    """``--tsp-mlp``: TP+SP attention, the TSP MLP ring (two layers)."""
    results, n = _run(pool4, "tests.checks_hybrid", "check_hybrid_vs_single", d, seed, style)
    assert max(v for r in results for v in r.values()) <= 1e-10, results[0]
    assert n == 2 * 3 * (d - 1)


@pytest.mark.parametrize("d", [2, 4])
def test_inference_prefill_wait_order(pool4, seed, d):
    """TSP prefill (weight broadcasts one head group ahead), then TP decode."""
    results, n = _run(pool4, "tests.checks_inference", "check_generation", d, seed, "llama")
    assert max(max(r.values()) for r in results) <= 1e-12, results[0]
    assert n > 0


@pytest.mark.parametrize("backward", ["saved", "recompute"])
def test_tsp_cp_attention_wait_order(pool4, seed, backward):
    """TSP2 x CP2: K/V gathers and dK/dV reduce-scatters over the D*C group."""
    _, n = _run(
        pool4, "tests.checks_tsp_cp", "check_attention_cp", 2, 2, seed, groups=4,
        attention_backward=backward,
    )  # fmt: skip
    assert n > 0
