"""MoE (experts folded onto the TSP axis) in Megatron-LM's real ``pretrain_gpt.py`` loop on CPU
through ``cpu_runner``: TSP D=2 with EP=2, and DP2 x TSP2 with EP=4, against stock TP=2 + SP with
the same EP (the local TP+SP block with Megatron's own dense / MoE layers and
sequence-parallel-tagged norms, ``tp_sp_block_spec``), same weights and data, Megatron's own log.

Checkpoints saved under either layout resume under the other. The TSP expert ring
(``--tsp-moe-ring``) against TP=2+SP with expert-TP 2, EP 1, and resuming its checkpoint. Needs
MEGATRON_LM_PATH. About 8 minutes on a loaded 2-core machine (ten 2-rank and two 4-rank runs).
"""

import re

import pytest

from tests.megatron_lm import test_training_loop as loop

pytestmark = loop.pytestmark

# 4 SwiGLU experts, top-2, aux + z losses, a shared expert, dense-then-MoE layers; the default
# (allgather) dispatcher (the DP2 x TSP2 run uses the alltoall one)
MOE = [
    "--num-experts",
    "4",
    "--expert-model-parallel-size",
    "2",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "64",
    "--moe-aux-loss-coeff",
    "1e-2",
    "--moe-z-loss-coeff",
    "1e-3",
    "--moe-layer-freq",
    "[0,1]",
    "--moe-shared-expert-intermediate-size",
    "64",
]


def _logged(log: str, name: str):
    return [float(v) for v in re.findall(rf"\| {name}: ([-+.\dE]+) \|", log)]


def _assert_same_balance(tsp, ref) -> None:
    """The logged load-balancing loss of every iteration equal (fp32 tracker)."""
    balance = _logged(tsp.log, "load_balancing_loss")
    ref_balance = _logged(ref.log, "load_balancing_loss")
    assert len(balance) == len(ref_balance) >= loop.ITERATIONS, (balance, ref_balance)
    for a, b in zip(balance, ref_balance):
        assert a == pytest.approx(b, rel=1e-5), (balance, ref_balance)


def test_tsp2_ep2_matches_tp2_sp_ep2(seed):
    args = loop.STYLES["llama"] + MOE
    tsp = loop._run(2, seed, *args, "--tensor-sequence-parallel-size", "2")
    ref = loop._run(
        2,
        seed,
        *args,
        "--tensor-model-parallel-size",
        "2",
        "--expert-tensor-parallel-size",
        "1",
        *loop.TP_SP_CPU,
    )
    loop._assert_same_curve(tsp, ref, loop.FP32_LOSS_RTOL, loop.FP32_NORM_RTOL)
    # the load-balancing loss is reduced over the tensor-parallel (= TSP) group: the same tokens
    _assert_same_balance(tsp, ref)
    # Megatron logs the z-loss of the logging rank's own tokens (no reduction over the group):
    # present in both logs; TSP rank 0 holds other tokens than TP rank 0 (docs/moe.md)
    assert _logged(tsp.log, "z_loss") and _logged(ref.log, "z_loss")


def test_tsp4_ep2_top1_probs_on_input_matches_tp4_sp_ep2(seed):
    """D = 4 (experts folded, EP = 2) with top-1 routing whose probability scales the expert's
    input (``--moe-apply-probs-on-input``; pre-softmax so top-1's probability is not 1) against
    TP=4+SP with EP = 2: Megatron-LM's own loop, same curve and load-balancing loss."""
    top1 = ["--moe-router-topk", "1", "--moe-apply-probs-on-input", "--moe-router-pre-softmax"]
    args = loop.STYLES["llama"] + MOE + top1  # the later --moe-router-topk wins
    tsp = loop._run(4, seed, *args, "--tensor-sequence-parallel-size", "4")
    ref = loop._run(
        4,
        seed,
        *args,
        "--tensor-model-parallel-size",
        "4",
        "--expert-tensor-parallel-size",
        "1",
        *loop.TP_SP_CPU,
    )
    loop.assert_logged_args(tsp.log, moe_router_topk="1", moe_apply_probs_on_input="True")
    loop._assert_same_curve(tsp, ref, loop.FP32_LOSS_RTOL, loop.FP32_NORM_RTOL)
    _assert_same_balance(tsp, ref)


def test_dp2_tsp2_ep4_spanning_dp_alltoall_matches_tp2_sp(seed):
    """DP2 x TSP2 on 4 ranks with EP=4: every rank holds one expert, the expert-model-parallel
    group spans both data-parallel replicas; distributed optimizer; the alltoall dispatcher (its
    side stream and host copies answered by the CPU runner)."""
    args = loop.STYLES["llama"] + MOE + ["--expert-model-parallel-size", "4"]
    args += ["--moe-token-dispatcher-type", "alltoall"]
    args += ["--use-distributed-optimizer", "--global-batch-size", "8"]
    tsp = loop._run(4, seed, *args, "--tensor-sequence-parallel-size", "2")
    ref = loop._run(
        4,
        seed,
        *args,
        "--tensor-model-parallel-size",
        "2",
        "--expert-tensor-parallel-size",
        "1",
        *loop.TP_SP_CPU,
    )
    loop._assert_same_curve(tsp, ref, loop.FP32_LOSS_RTOL, loop.FP32_NORM_RTOL)


def test_checkpoints_interchange_with_tp2_sp_ep2(seed, tmp_path):
    """Save under one layout at iteration 2 (of a 4-iteration schedule), resume under the other:
    TP=2+SP+EP=2's checkpoint resumed under TSP D=2 (EP=2), TSP's resumed under TP+SP; iterations
    3 and 4 equal TP+SP's own save -> resume (experts, router and Adam state included)."""
    args = loop.STYLES["llama"] + MOE + ["--train-iters", "4", "--save-interval", "1000"]
    tp_sp = ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
    tp_sp += loop.TP_SP_CPU
    tsp = ["--tensor-sequence-parallel-size", "2"]
    save = ["--exit-interval", "2", "--save"]
    loop._run(2, seed, *args, *tp_sp, *save, str(tmp_path / "tp_sp"))
    resumed = loop._run(2, seed, *args, *tp_sp, "--load", str(tmp_path / "tp_sp"))
    tsp_from_tp_sp = loop._run(2, seed, *args, *tsp, "--load", str(tmp_path / "tp_sp"))
    loop._run(2, seed, *args, *tsp, *save, str(tmp_path / "tsp"))
    tp_sp_from_tsp = loop._run(2, seed, *args, *tp_sp, "--load", str(tmp_path / "tsp"))
    for run in (tsp_from_tp_sp, tp_sp_from_tsp):
        assert run.iterations == resumed.iterations == [3, 4], (run.iterations, resumed.iterations)
        for a, b in zip(run.losses, resumed.losses):
            assert loop._rel(a, b) <= loop.FP32_LOSS_RTOL, (run.losses, resumed.losses)
        for a, b in zip(run.grad_norms, resumed.grad_norms):
            assert loop._rel(a, b) <= loop.FP32_NORM_RTOL, (run.grad_norms, resumed.grad_norms)
        print(
            f"resumed: loss {run.losses} vs {resumed.losses}; "
            f"grad norm {run.grad_norms} vs {resumed.grad_norms}"
        )


def test_tsp2_moe_ring_matches_tp2_sp_etp2_and_resumes_its_checkpoint(seed, tmp_path):
    """The TSP expert ring (--tsp-moe-ring: every expert sharded over the 2 TSP ranks, EP 1) vs
    TP=2+SP with --expert-tensor-parallel-size 2 --expert-model-parallel-size 1 (Megatron's
    allgather dispatcher), same MoE flags, 4 iterations: loss and grad norm per iteration. Both
    save at iterations 2 and 4; each resumes the other's iteration-2 checkpoint (the tracker file
    pointed at it) and iterations 3-4 equal the uninterrupted TP+SP run's (four runs)."""
    moe = [
        a if a != "2" or i != MOE.index("--expert-model-parallel-size") + 1 else "1"
        for i, a in enumerate(MOE)
    ]
    args = loop.STYLES["llama"] + moe + ["--train-iters", "4"]
    tp_sp = ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"]
    tp_sp += loop.TP_SP_CPU
    ring = ["--tensor-sequence-parallel-size", "2", "--tsp-moe-ring"]
    ckpt, ring_ckpt = tmp_path / "tp_sp", tmp_path / "ring"
    ref = loop._run(2, seed, *args, *tp_sp, "--save-interval", "2", "--save", str(ckpt))
    tsp = loop._run(2, seed, *args, *ring, "--save-interval", "2", "--save", str(ring_ckpt))
    assert "[megatron_tsp] MoE schedule: TSP expert ring in 1 MoE layer" in tsp.log, tsp.log[-3000:]
    assert tsp.iterations == ref.iterations == [1, 2, 3, 4], (tsp.iterations, ref.iterations)
    assert len(set(ref.losses)) == 4  # training happened
    for a, b in zip(tsp.losses, ref.losses):
        assert loop._rel(a, b) <= loop.FP32_LOSS_RTOL, (tsp.losses, ref.losses)
    for a, b in zip(tsp.grad_norms, ref.grad_norms):
        assert loop._rel(a, b) <= loop.FP32_NORM_RTOL, (tsp.grad_norms, ref.grad_norms)
    balance, ref_balance = (
        _logged(tsp.log, "load_balancing_loss"),
        _logged(ref.log, "load_balancing_loss"),
    )
    assert len(balance) == len(ref_balance) >= 4, (balance, ref_balance)
    for a, b in zip(balance, ref_balance):
        assert a == pytest.approx(b, rel=1e-5), (balance, ref_balance)

    def resume(saved, flags):
        """``flags``' run from the iteration-2 checkpoint in ``saved``: iterations 3-4 equal the
        uninterrupted TP+SP run's."""
        (saved / "latest_checkpointed_iteration.txt").write_text("2")
        run = loop._run(2, seed, *args, *flags, "--load", str(saved))
        assert run.iterations == [3, 4], run.iterations
        for a, b in zip(run.losses, ref.losses[2:]):
            assert loop._rel(a, b) <= loop.FP32_LOSS_RTOL, (run.losses, ref.losses)
        for a, b in zip(run.grad_norms, ref.grad_norms[2:]):
            assert loop._rel(a, b) <= loop.FP32_NORM_RTOL, (run.grad_norms, ref.grad_norms)
        return run

    resumed = resume(ckpt, ring)
    tp_sp_resumed = resume(ring_ckpt, tp_sp)
    print(
        f"ring vs TP+SP ETP=2: loss {tsp.losses} vs {ref.losses}; grad norm {tsp.grad_norms} vs "
        f"{ref.grad_norms}; resumed from TP+SP's iteration 2: loss {resumed.losses}, grad norm "
        f"{resumed.grad_norms}; TP+SP resumed from the ring's iteration 2: loss "
        f"{tp_sp_resumed.losses}, grad norm {tp_sp_resumed.grad_norms}"
    )


def test_tsp2_cp2_moe_ring_matches_tp2_sp_etp2(seed):
    """The TSP expert ring under TSP=2 x CP=2 on 4 ranks (experts sharded over the 2 TSP ranks,
    replicated over CP; tokens stay on their sequence rank) vs TP=2+SP with ETP=2, EP=1 on 2
    ranks, same MoE flags and data, 3 iterations: CP changes only the layout, so loss, grad norm
    and the logged load-balancing loss follow the same curve."""
    moe = [
        a if a != "2" or i != MOE.index("--expert-model-parallel-size") + 1 else "1"
        for i, a in enumerate(MOE)
    ]
    args = loop.STYLES["llama"] + moe
    ring = ["--tensor-sequence-parallel-size", "2", "--tsp-moe-ring"]
    ring += ["--context-parallel-size", "2"]
    tsp = loop._run(4, seed, *args, *ring)
    tp_sp = ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"]
    ref = loop._run(2, seed, *args, *tp_sp, *loop.TP_SP_CPU)
    assert "data-parallel size: 1, context-parallel size: 2" in tsp.log, tsp.log[-3000:]
    assert "[megatron_tsp] MoE schedule: TSP expert ring in 1 MoE layer" in tsp.log
    loop._assert_same_curve(tsp, ref, loop.FP32_LOSS_RTOL, loop.FP32_NORM_RTOL)
    balance = _logged(tsp.log, "load_balancing_loss")
    ref_balance = _logged(ref.log, "load_balancing_loss")
    assert len(balance) == len(ref_balance) >= 3, (balance, ref_balance)
    for a, b in zip(balance, ref_balance):
        assert a == pytest.approx(b, rel=1e-5), (balance, ref_balance)
    print(
        f"ring x CP vs TP+SP ETP=2: loss {tsp.losses} vs {ref.losses}; grad norm "
        f"{tsp.grad_norms} vs {ref.grad_norms}; load balancing {balance} vs {ref_balance}"
    )
