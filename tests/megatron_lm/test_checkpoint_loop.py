"""Checkpoints through Megatron-LM's real ``pretrain_gpt.py`` loop (CPU/gloo, cpu_runner).

Stock TP=2's own save -> resume is the reference: ``--train-iters 4 --exit-interval 2 --save``
(Megatron saves at iteration 2 and exits; the LR schedule is the 4-iteration one), then
``--train-iters 4 --load`` runs iterations 3 and 4 with the restored weights, Adam moments, LR
scheduler, RNG and data position. Then, from the same initial weights and data:

* TSP D=2 saves at iteration 2; stock TP=2 loads that checkpoint with ``--use-checkpoint-args
  --use-mp-args-from-checkpoint-args`` (the stored args must be a stock run's: no TSP spec) and
  continues; stock TP=2 + SP (Megatron's local layers with the SP-capable norm) loads it too;
* TSP D=2 loads stock TP=2's checkpoint and continues;
* TSP D=2 x CP=2 (4 ranks) saves at iteration 2 and stock TP=2 continues from it; TSP x CP
  loads stock TP=2's checkpoint and continues.

Iterations 3 and 4 (loss and grad norm) must equal the stock resume up to fp32 reduction order
(TSP and TP sum in different orders; measured below 1e-6 relative). The stock resume itself is
checked against an uninterrupted 4-iteration run (equal bit for bit on this path).

Needs MEGATRON_LM_PATH (CI: scripts/megatron_lm_sources.sh). Eight 2-rank and two 4-rank runs:
about 3 minutes on 2 free cores.
"""

from __future__ import annotations

import os
import random
import re

import pytest
import torch

from megatron_tsp.megatron_lm.cpu_runner import run_training
from tests.megatron_lm.common import REPO, megatron_lm_path, relative_difference

CHECKOUT = megatron_lm_path()
pytestmark = pytest.mark.skipif(
    CHECKOUT is None, reason="set MEGATRON_LM_PATH to a Megatron-LM checkout to run these"
)

SEED = random.randrange(1, 100000)
MODEL = [
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
    "--vocab-size",
    "255",
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
]
TRAINING = [
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "4",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "1",
    "--weight-decay",
    "0.1",
    "--clip-grad",
    "1.0",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
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
    "--save-interval",
    "1000",
]
TP = ["--tensor-model-parallel-size", "2"]
TSP = ["--tensor-sequence-parallel-size", "2"]
TSP_CP = TSP + ["--context-parallel-size", "2"]
# Stock TP=2 + SP on CPU: Megatron's local layers, the norm that accepts sequence parallelism
# (Megatron's CPU norm asserts it is off). A block spec object, as core_v0.16's --spec expects.
TP_SP = TP + ["--sequence-parallel", "--spec", "tests.megatron_lm.local_sp_spec", "block_spec"]
# fp32: iterations after a cross-layout load differ from the stock resume only by the reduction
# order of the runs before the save (measured <= 2e-7 loss, <= 1e-6 grad norm)
LOSS_RTOL, NORM_RTOL = 1e-5, 1e-4


def _run(args, stock=False, nproc=2):
    env = {"PYTHONPATH": REPO}
    return run_training(
        os.path.join(CHECKOUT, "pretrain_gpt.py"),
        MODEL + TRAINING + ["--seed", str(SEED)] + list(args),
        nproc,
        env=env,
        stock=stock,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    save = ["--exit-interval", "2"]
    out = {"root": root}
    out["tp_save"] = _run(TP + save + ["--save", str(root / "tp")], stock=True)
    out["tp_resume"] = _run(TP + ["--load", str(root / "tp")], stock=True)
    out["uninterrupted"] = _run(TP, stock=True)
    out["tsp_save"] = _run(TSP + save + ["--save", str(root / "tsp")])
    out["tp_from_tsp"] = _run(
        TP
        + [
            "--load",
            str(root / "tsp"),
            "--use-checkpoint-args",
            "--use-mp-args-from-checkpoint-args",
        ],
        stock=True,
    )
    out["tpsp_from_tsp"] = _run(TP_SP + ["--load", str(root / "tsp")], stock=True)
    out["tsp_from_tp"] = _run(TSP + ["--load", str(root / "tp")])
    # TSP x CP (4 ranks: weights over the TSP pair, tokens over all four) against stock TP=2
    out["tsp_cp_save"] = _run(TSP_CP + save + ["--save", str(root / "tsp_cp")], nproc=4)
    out["tp_from_tsp_cp"] = _run(TP + ["--load", str(root / "tsp_cp")], stock=True)
    out["tsp_cp_from_tp"] = _run(TSP_CP + ["--load", str(root / "tp")], nproc=4)
    return out


def _rel(a, b):
    return relative_difference(a, b)


def _same(run, ref, iterations, loss_rtol=LOSS_RTOL, norm_rtol=NORM_RTOL):
    assert run.iterations == ref.iterations == iterations, (run.iterations, ref.iterations)
    worst_loss = max(_rel(a, b) for a, b in zip(run.losses, ref.losses))
    worst_norm = max(_rel(a, b) for a, b in zip(run.grad_norms, ref.grad_norms))
    detail = (
        f"seed {SEED}: loss {run.losses} vs {ref.losses}; grad norm {run.grad_norms} vs "
        f"{ref.grad_norms}; worst relative {worst_loss:.2e} / {worst_norm:.2e}"
    )
    print(detail)
    assert worst_loss <= loss_rtol and worst_norm <= norm_rtol, detail


def test_stock_resume_equals_uninterrupted_run(runs):
    saved, resumed, whole = runs["tp_save"], runs["tp_resume"], runs["uninterrupted"]
    assert saved.iterations == [1, 2] and resumed.iterations == [3, 4]
    assert whole.iterations == [1, 2, 3, 4]
    # bit for bit: same arithmetic, and the checkpoint restores everything the step depends on
    assert saved.losses + resumed.losses == whole.losses, (
        SEED,
        saved.losses,
        resumed.losses,
        whole.losses,
    )
    assert saved.grad_norms + resumed.grad_norms == whole.grad_norms


def test_tsp_before_the_save_matches_tp(runs):
    _same(runs["tsp_save"], runs["tp_save"], [1, 2])


def test_tsp_checkpoint_resumes_under_stock_tp(runs):
    _same(runs["tp_from_tsp"], runs["tp_resume"], [3, 4])


def test_tsp_checkpoint_resumes_under_stock_tp_sp(runs):
    _same(runs["tpsp_from_tsp"], runs["tp_resume"], [3, 4])


def test_tp_checkpoint_resumes_under_tsp(runs):
    _same(runs["tsp_from_tp"], runs["tp_resume"], [3, 4])


def test_tsp_cp_before_the_save_matches_tp(runs):
    _same(runs["tsp_cp_save"], runs["tp_save"], [1, 2])


def test_tsp_cp_checkpoint_resumes_under_stock_tp(runs):
    """Saved by TSP=2 x CP=2 on 4 ranks, resumed by stock TP=2 (CP=1) on 2: CP changes only the
    token layout, so the checkpoint is TP=2's."""
    _same(runs["tp_from_tsp_cp"], runs["tp_resume"], [3, 4])


def test_tp_checkpoint_resumes_under_tsp_cp(runs):
    _same(runs["tsp_cp_from_tp"], runs["tp_resume"], [3, 4])


def test_use_checkpoint_args_does_not_carry_the_tsp_spec(runs):
    # What the TSP run stored: a stock TP=2 + SP run's arguments.
    common = runs["root"] / "tsp" / "iter_0000002" / "common.pt"
    stored = torch.load(common, weights_only=False)["args"]
    assert stored.spec is None and stored.tensor_model_parallel_size == 2
    assert stored.sequence_parallel is True
    assert not [
        k for k in vars(stored) if k.startswith("tsp_") or k == "tensor_sequence_parallel_size"
    ]
    # The stock run that loaded it with --use-checkpoint-args built Megatron's own layers.
    log = runs["tp_from_tsp"].log
    assert re.search(r"\bspec \.+ None$", log, re.M), "the stock run's --spec is not None"
    assert "megatron_tsp.megatron_lm.spec" not in log and "TSPSelfAttention" not in log


_TE_LOAD_PROBE = r"""
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0,
                        world_size=1)
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject
from megatron.core.dist_checkpointing.validation import StrictHandling
ckpt = sys.argv[1]
tensors = dist_checkpointing.load_tensors_metadata(ckpt)
model = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
# What a Transformer Engine TP+SP model requests on top of the parameters: one _extra_state
# object (FP8 metadata) per TE module and layer, keyed as Megatron keys them.
layers = 2
extra = {}
for module in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
               "mlp.linear_fc2"):
    for i in range(layers):
        key = f"decoder.layers.{module}._extra_state"
        extra[f"{key}/{i}"] = ShardedObject(key, None, (layers,), (i,), replica_id=0)
out = {"params": sorted(model)}
for strict in ("assume_ok_unexpected", "raise_unexpected", "log_unexpected"):
    try:
        loaded = dist_checkpointing.load(dict(model, **extra), ckpt,
                                         strict=StrictHandling(strict))
        out[strict] = {"params": sorted(k for k in loaded if k in model),
                       "extra": {k: repr(loaded.get(k, "absent")) for k in sorted(extra)}}
    except BaseException as exc:  # torch's CheckpointException derives from BaseException
        out[strict] = "error: " + type(exc).__name__ + ": " + str(exc)[-3000:]
print("PROBE " + json.dumps(out))
dist.destroy_process_group()
"""


def test_tsp_checkpoint_in_a_transformer_engine_request(runs):
    """A TE TP+SP run requests ``_extra_state`` objects the TSP checkpoint does not have.

    Transformer Engine is not installed here, so its request is emulated on the TSP checkpoint of
    the real loop: every parameter plus one ``_extra_state`` ShardedObject per TE module and layer
    (keyed as Megatron keys them). Measured on megatron-core's torch_dist loader: with the default
    strictness and the stricter ``raise_unexpected`` alike the load succeeds, every parameter is
    loaded and the absent ``_extra_state`` objects come back as ``None`` (which TE's
    ``set_extra_state`` skips: fresh FP8 metadata)."""
    import json
    import subprocess
    import sys

    from megatron_tsp.megatron_lm.cpu_runner import free_port

    ckpt = runs["root"] / "tsp" / "iter_0000002"
    proc = subprocess.run(
        [sys.executable, "-c", _TE_LOAD_PROBE, str(ckpt), str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=CHECKOUT + os.pathsep + REPO),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads([x for x in proc.stdout.splitlines() if x.startswith("PROBE ")][-1][6:])
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in result["params"]
    for strict in ("assume_ok_unexpected", "raise_unexpected", "log_unexpected"):
        assert isinstance(result[strict], dict), (strict, result[strict])
        assert result[strict]["params"] == result["params"], strict
        assert len(result[strict]["extra"]) == 8
        assert set(result[strict]["extra"].values()) == {"None"}, result[strict]["extra"]
