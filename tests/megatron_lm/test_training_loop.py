"""Megatron-LM's real ``pretrain_gpt.py`` training loop under TSP vs stock Megatron, on CPU/gloo.

Every run goes through ``megatron_tsp.megatron_lm.cpu_runner`` (CUDA-only calls answered, nothing
else changed) from identical initial weights (``--use-cpu-initialization``, same ``--seed``) and
identical mock data, for several iterations; the loss and grad norm of every iteration are
Megatron's own (``training_log``), compared at full precision. Megatron's default fusion flags
are kept (bias-GeLU / bias-SwiGLU / bias-dropout-add / masked-softmax fusion, gradient-
accumulation fusion through the runner's torch stand-in for apex's kernel); only
``--no-persist-layer-norm`` and ``--no-rope-fusion`` (apex / Transformer Engine kernels) are off.
The stock baseline is TP=D without ``--sequence-parallel`` (Megatron's CPU norm refuses SP;
SP changes no parameter and no value beyond reduction order).

Needs MEGATRON_LM_PATH (CI sets it, see scripts/megatron_lm_sources.sh). Runtime on 2 free cores:
about 5-6 minutes for the file (each 2-rank run ~8 s, each 4-rank run ~15-20 s; the interleaved
test ~40-80 s).
"""

import os
import re
import shutil

import pytest

from megatron_tsp.megatron_lm.cpu_runner import run_training
from tests.megatron_lm.common import megatron_lm_path, relative_difference

CHECKOUT = megatron_lm_path()
pytestmark = pytest.mark.skipif(
    CHECKOUT is None, reason="set MEGATRON_LM_PATH to a Megatron-LM checkout to run these"
)

ITERATIONS = 3
COMMON = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--ffn-hidden-size",
    "256",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    str(ITERATIONS),
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "cosine",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "255",
    "--transformer-impl",
    "local",
    "--use-cpu-initialization",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--no-persist-layer-norm",
]
STYLES = {
    "gpt2": [],  # LayerNorm, learned absolute positions, biases, GeLU, tied embeddings
    "llama": [
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--swiglu",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--no-rope-fusion",
    ],
}
# fp32: TSP and TP differ only in reduction order (measured: <= 6e-7 relative over 3 iterations)
FP32_LOSS_RTOL, FP32_NORM_RTOL = 1e-5, 1e-4
# bf16 (measured 3e-5 loss / 2e-3 grad norm): bf16 has an 8-bit mantissa (eps 7.8e-3)
BF16_LOSS_RTOL, BF16_NORM_RTOL = 1e-3, 2e-2


def _script():
    return os.path.join(CHECKOUT, "pretrain_gpt.py")


def _run(nproc, seed, *args, script=None, check=True):
    return run_training(
        script or _script(),
        COMMON + ["--seed", str(seed % 100000 + 1)] + list(args),
        nproc,
        check=check,
    )


def _rel(a, b):
    return relative_difference(a, b)


def _assert_same_curve(tsp, ref, loss_rtol, norm_rtol):
    assert tsp.iterations == ref.iterations == list(range(1, ITERATIONS + 1)), (
        tsp.iterations,
        ref.iterations,
    )
    worst = {"loss": 0.0, "grad_norm": 0.0}
    for i in range(ITERATIONS):
        worst["loss"] = max(worst["loss"], _rel(tsp.losses[i], ref.losses[i]))
        worst["grad_norm"] = max(worst["grad_norm"], _rel(tsp.grad_norms[i], ref.grad_norms[i]))
    table = "\n".join(
        f"  it {i + 1}: loss {t!r} vs {r!r}; grad norm {tn!r} vs {rn!r}"
        for i, (t, r, tn, rn) in enumerate(
            zip(tsp.losses, ref.losses, tsp.grad_norms, ref.grad_norms)
        )
    )
    print(f"worst relative difference: {worst}\n{table}")
    assert worst["loss"] <= loss_rtol and worst["grad_norm"] <= norm_rtol, (worst, table)
    # training happened: the loss moves between iterations
    assert len(set(ref.losses)) == ITERATIONS
    return worst


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_tsp2_matches_tp2(seed, style):
    # the loss on the vocabulary ring, forced: these 128-token micro-batches are below its
    # crossover, where "auto" keeps Megatron's output layer (gpt2: tied embeddings, llama not)
    ring = ["--tsp-vocab-ring", "always"]
    tsp = _run(2, seed, *STYLES[style], "--tensor-sequence-parallel-size", "2", *ring)
    ref = _run(2, seed, *STYLES[style], "--tensor-model-parallel-size", "2")
    assert "--no-create-attention-mask-in-dataloader" in tsp.log  # the launcher says it did
    # the log names the attention backend the layers run, and why (2 layers on this rank 0)
    assert "[megatron_tsp] attention backend: cpu_flash (default) in 2 TSP attention layers" in (
        tsp.rank_log(0)
    ), tsp.rank_log(0)[-3000:]
    assert "attention backend" not in ref.log  # stock TP: no TSP attention layers
    assert "[megatron_tsp] output layer: TSP vocabulary ring" in tsp.rank_log(0)
    _assert_same_curve(tsp, ref, FP32_LOSS_RTOL, FP32_NORM_RTOL)


def test_tsp2_without_the_vocab_ring_matches_tp2(seed):
    """``--tsp-vocab-ring never``: Megatron's output layer and vocab-parallel cross-entropy under
    TSP (the log says so), the same curve as TP=2; the default's log names the crossover."""
    args = STYLES["llama"] + ["--tensor-sequence-parallel-size", "2", "--tsp-vocab-ring", "never"]
    tsp = _run(2, seed, *args)
    ref = _run(2, seed, *STYLES["llama"], "--tensor-model-parallel-size", "2")
    assert "[megatron_tsp] output layer: Megatron's" in tsp.rank_log(0), tsp.rank_log(0)[-3000:]
    _assert_same_curve(tsp, ref, FP32_LOSS_RTOL, FP32_NORM_RTOL)
    auto = _run(2, seed, *STYLES["llama"], "--tensor-sequence-parallel-size", "2")
    assert "for micro-batches of >= " in auto.rank_log(0) and "auto)" in auto.rank_log(0)
    _assert_same_curve(auto, ref, FP32_LOSS_RTOL, FP32_NORM_RTOL)


def test_tsp4_matches_tp4(seed):
    args = STYLES["llama"] + ["--num-query-groups", "4"]
    tsp = _run(4, seed, *args, "--tensor-sequence-parallel-size", "4")
    ref = _run(4, seed, *args, "--tensor-model-parallel-size", "4")
    _assert_same_curve(tsp, ref, FP32_LOSS_RTOL, FP32_NORM_RTOL)


# Megatron-LM flags TSP reads, off their defaults (issue 38): a head dimension decoupled from
# hidden / heads (32, not 64 / 4 = 16) and Llama-3 RoPE scaling with factor 4 (base 5e5, so the
# scaling reaches the head dimension's lower frequencies)
OPTIONS_OFF_DEFAULT = [
    "--kv-channels",
    "32",
    "--use-rope-scaling",
    "--rope-scaling-factor",
    "4",
    "--rotary-base",
    "500000",
]


def assert_logged_args(log: str, **values: str) -> None:
    """Megatron's argument dump (``name ..... value``) shows each option at its value."""
    for name, value in values.items():
        found = re.search(rf"\b{name} \.+ (\S+)", log)
        assert found and found.group(1) == value, (name, value, found and found.group(1))


def test_tsp4_matches_tp4_fewer_kv_heads_than_d(seed):
    """Two K/V heads at D=4 (megatron-core's TP layout, each K/V head shared by two ranks), with
    ``--kv-channels`` and Llama-3 RoPE scaling off their defaults: Megatron-LM's own loop, same
    curve as TP=4."""
    args = STYLES["llama"] + ["--num-query-groups", "2"] + OPTIONS_OFF_DEFAULT
    tsp = _run(4, seed, *args, "--tensor-sequence-parallel-size", "4")
    ref = _run(4, seed, *args, "--tensor-model-parallel-size", "4")
    assert_logged_args(tsp.log, kv_channels="32", rope_scaling_factor="4.0", rotary_base="500000")
    assert "in 2 TSP attention layers" in tsp.rank_log(0), tsp.rank_log(0)[-3000:]
    _assert_same_curve(tsp, ref, FP32_LOSS_RTOL, FP32_NORM_RTOL)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_tsp2_cp2_matches_tp2(seed, style):
    """TSP=2 x CP=2 on 4 ranks (the K/V gathered over the tensor-and-context group, Megatron's
    own CP batch split composed with the TSP zigzag, Megatron's CP-sliced RoPE table) vs TP=2 x
    CP=1 on 2 ranks, same data: CP changes only the layout."""
    args = STYLES[style]
    tsp = _run(
        4, seed, *args, "--tensor-sequence-parallel-size", "2", "--context-parallel-size", "2"
    )
    ref = _run(2, seed, *args, "--tensor-model-parallel-size", "2")
    # the 4 ranks are one TSP x CP replica, not two data-parallel TSP=2 replicas
    assert "data-parallel size: 1, context-parallel size: 2" in tsp.log, tsp.log[-3000:]
    _assert_same_curve(tsp, ref, FP32_LOSS_RTOL, FP32_NORM_RTOL)


def test_tsp4_cp2_matches_tp4(seed):
    """TSP=4 x CP=2 on 8 ranks vs TP=4 on 4: the layout with D >= 4 and D != C, where chunk
    arithmetic that confuses the TSP and CP ranks (invisible at D = C = 2) changes the curve."""
    args = STYLES["llama"]
    tsp = _run(
        8, seed, *args, "--tensor-sequence-parallel-size", "4", "--context-parallel-size", "2"
    )
    ref = _run(4, seed, *args, "--tensor-model-parallel-size", "4")
    assert "data-parallel size: 1, context-parallel size: 2" in tsp.log, tsp.log[-3000:]
    _assert_same_curve(tsp, ref, FP32_LOSS_RTOL, FP32_NORM_RTOL)


def test_bf16_distributed_optimizer_overlap_recompute(seed):
    """bf16 + distributed optimizer + overlap-grad-reduce + gradient-accumulation fusion (the
    runner's fp32-accumulating stand-in) + full recompute."""
    args = STYLES["gpt2"] + [
        "--bf16",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ]
    ring = ["--tsp-vocab-ring", "always"]  # the vocabulary ring in bf16 with main_grad
    tsp = _run(2, seed, *args, "--tensor-sequence-parallel-size", "2", *ring)
    ref = _run(2, seed, *args, "--tensor-model-parallel-size", "2")
    _assert_same_curve(tsp, ref, BF16_LOSS_RTOL, BF16_NORM_RTOL)


def test_dp2_tsp2_distributed_optimizer_and_overlap_param_gather(seed):
    """DP=2 x TSP=2, distributed optimizer, overlapped grad reduce with small buckets; and the
    same with --overlap-param-gather, which must give bit-identical iterations (TSP fires the
    param-gather waits of the modules whose weights it reads)."""
    args = STYLES["llama"] + [
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--ddp-bucket-size",
        "4000",
        "--global-batch-size",
        "8",
    ]
    ref = _run(4, seed, *args, "--tensor-model-parallel-size", "2")
    # the vocabulary ring too: it fires the output layer's param-gather wait
    tsp_args = ["--tensor-sequence-parallel-size", "2", "--tsp-vocab-ring", "always"]
    tsp = _run(4, seed, *args, *tsp_args)
    _assert_same_curve(tsp, ref, FP32_LOSS_RTOL, FP32_NORM_RTOL)
    gathered = _run(4, seed, *args, *tsp_args, "--overlap-param-gather")
    assert gathered.losses == tsp.losses and gathered.grad_norms == tsp.grad_norms, (
        gathered.losses,
        tsp.losses,
        gathered.grad_norms,
        tsp.grad_norms,
    )


def test_pp2_tsp2(seed):
    args = STYLES["llama"] + [
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers",
        "4",
        "--global-batch-size",
        "8",
    ]
    ring = ["--tsp-vocab-ring", "always"]  # on the last stage only
    tsp = _run(4, seed, *args, "--tensor-sequence-parallel-size", "2", *ring)
    ref = _run(4, seed, *args, "--tensor-model-parallel-size", "2")
    _assert_same_curve(tsp, ref, FP32_LOSS_RTOL, FP32_NORM_RTOL)


# The TP+SP baseline on CPU: Megatron's local layers with sequence-parallel-tagged torch norms
# (Megatron's own norms refuse --sequence-parallel without apex / TE).
TP_SP_CPU = ["--sequence-parallel", "--spec", "megatron_tsp.megatron_lm.spec", "tp_sp_block_spec"]


def test_interleaved_pp2_tsp2_matches_tp2_sp(seed):
    """Interleaved (virtual) pipeline stages: PP=2 with a layout of 2 virtual stages per rank,
    uneven (rank 0: embedding + 2 layers, then 1 layer; rank 1: 1 layer, then only the final norm
    and the loss), so the TSP block spec is resolved per (pp rank, vp stage) and the interleaved
    schedule overlaps its sends with TSP's own communication."""
    args = STYLES["llama"] + [
        "--pipeline-model-parallel-size",
        "2",
        "--pipeline-model-parallel-layout",
        "Ett|t|t|L",
        "--num-layers",
        "4",
        "--global-batch-size",
        "8",
    ]
    tsp = _run(4, seed, *args, "--tensor-sequence-parallel-size", "2")
    ref = _run(4, seed, *args, "--tensor-model-parallel-size", "2", *TP_SP_CPU)
    _assert_same_curve(tsp, ref, FP32_LOSS_RTOL, FP32_NORM_RTOL)


def test_script_that_bypasses_the_batch_hook_is_refused(tmp_path, seed):
    """A copy of pretrain_gpt.py whose get_batch no longer calls get_batch_on_this_cp_rank:
    TSP attention must refuse the natural-order micro-batch, naming the hook."""
    source = open(_script()).read()
    call = "batch = get_batch_on_this_cp_rank(batch"
    assert call in source, "pretrain_gpt.get_batch changed: update this test"
    bypassed = source.replace(call, "batch = (lambda b, *a, **k: b)(batch", 1)
    (tmp_path / "pretrain_gpt.py").write_text(bypassed)
    for name in ("gpt_builders.py", "model_provider.py"):
        if os.path.exists(os.path.join(CHECKOUT, name)):
            shutil.copy(os.path.join(CHECKOUT, name), tmp_path / name)
    os.symlink(os.path.join(CHECKOUT, "megatron"), tmp_path / "megatron")
    run = _run(
        2,
        seed,
        "--tensor-sequence-parallel-size",
        "2",
        script=str(tmp_path / "pretrain_gpt.py"),
        check=False,
    )
    assert run.returncode != 0 and not run.losses, run.log[-3000:]
    assert "UnpermutedBatchError" in run.log, run.log[-3000:]
    assert "did not pass through get_batch_on_this_tsp_rank" in run.log


def test_ranks_forked_from_the_zygote_equal_fresh_processes(seed, monkeypatch):
    """``cpu_runner`` forks ranks from a process that has imported Megatron-LM once
    (``rank_zygote``); a fresh process per rank (``TSP_CPU_RUNNER_FORK=0``) gives the same loss
    and grad norm to the bit, and the same log lines after start-up. A rank that fails is
    reported with its exit code and log through the zygote too."""
    from megatron_tsp.megatron_lm import rank_zygote

    started = []
    original_start = rank_zygote.Zygote.start

    def counting_start(self, *args, **kwargs):
        started.append(self)
        return original_start(self, *args, **kwargs)

    monkeypatch.setattr(rank_zygote.Zygote, "start", counting_start)
    args = STYLES["llama"] + ["--tensor-sequence-parallel-size", "2"]
    forked = _run(2, seed, *args)
    assert len(started) == 2, "the ranks were not forked from a zygote"
    monkeypatch.setenv(rank_zygote.FORK_ENV, "0")
    fresh = _run(2, seed, *args)
    assert len(started) == 2
    assert forked.losses == fresh.losses and forked.grad_norms == fresh.grad_norms
    monkeypatch.delenv(rank_zygote.FORK_ENV)
    failed = _run(2, seed, *args, "--num-attention-heads", "3", check=False)
    assert len(started) == 4
    assert failed.returncode != 0 and failed.failed_rank is not None
    log = failed.rank_log(failed.failed_rank)
    assert "assert args.hidden_size % args.num_attention_heads == 0" in log, log[-3000:]
