"""Megatron-LM's real ``pretrain_gpt.py`` loop on CPU ranks (``cpu_runner``): ``--tsp-mlp`` at
D=2 trains exactly like TP=2 + SP over several iterations (same losses and grad norms).

Skipped unless a Megatron-LM checkout is given: ``MEGATRON_LM_PATH`` (run with this interpreter)
or ``MEGATRON_LM_PATH_0_19`` (run with ``$VENV312/bin/python``); ``scripts/megatron_lm_sources.sh``
unpacks both. ~2.5 min on 2 cores (two 2-rank runs of 4 iterations).
"""

import os

import pytest

from megatron_tsp.megatron_lm import configs
from tests.megatron_lm.common import REPO


def _checkouts():
    out = []
    path = os.environ.get("MEGATRON_LM_PATH")
    if path and os.path.isfile(os.path.join(path, "pretrain_gpt.py")):
        out.append(pytest.param(path, None, id="env-python"))
    path = os.environ.get("MEGATRON_LM_PATH_0_19")
    venv = os.environ.get("VENV312")
    if path and venv and os.path.isfile(os.path.join(path, "pretrain_gpt.py")):
        out.append(pytest.param(path, os.path.join(venv, "bin", "python"), id="0.19"))
    return out or [
        pytest.param(
            None,
            None,
            marks=pytest.mark.skip(
                reason="set MEGATRON_LM_PATH (or MEGATRON_LM_PATH_0_19 and VENV312) to a checkout"
            ),
        )
    ]


# Short run, no evaluation, every iteration logged, in-process data loading.
LOOP_ARGS = [
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--train-iters",
    "4",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
    "--log-interval",
    "1",
    "--num-workers",
    "0",
]
# Megatron's torch norms refuse --sequence-parallel without apex / TE: the TP+SP baseline runs
# Megatron's local layers with sequence-parallel-tagged torch norms (only the norm class differs).
TP_SP_CPU_SPEC = ["--spec", "megatron_tsp.megatron_lm.spec", "tp_sp_block_spec"]


@pytest.mark.parametrize("checkout,python", _checkouts())
def test_tsp_mlp_d2_equals_tp2_in_pretrain_gpt(checkout, python):
    from megatron_tsp.megatron_lm.cpu_runner import run_training

    cfg = configs.load_config("tiny-cpu")
    common = configs.model_args(cfg) + configs.training_args(cfg) + LOOP_ARGS
    script = os.path.join(checkout, "pretrain_gpt.py")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    tp = run_training(
        script,
        common + configs.parallel_args(cfg, "tp", 2) + TP_SP_CPU_SPEC,
        2,
        env=env,
        python=python,
    )
    hybrid = run_training(
        script, common + configs.parallel_args(cfg, "tsp_mlp", 2), 2, env=env, python=python
    )
    assert "--tsp-mlp: TP+SP attention + TSP MLP ring" in hybrid.log
    assert "tsp_mlp_block_spec" not in tp.log
    print(f"TP=2+SP losses {tp.losses} grad norms {tp.grad_norms}")
    print(f"--tsp-mlp D=2 losses {hybrid.losses} grad norms {hybrid.grad_norms}")
    assert len(tp.losses) == len(hybrid.losses) == 4
    # fp32; the two differ only in the MLP's summation order (ring vs reduce-scatter)
    assert hybrid.losses == pytest.approx(tp.losses, rel=1e-5)
    assert hybrid.grad_norms == pytest.approx(tp.grad_norms, rel=1e-4)
    assert len(set(tp.losses)) > 1  # it trained
