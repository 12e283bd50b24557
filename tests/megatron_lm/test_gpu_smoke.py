"""GPU smoke test: a few steps of the real pretrain_gpt.py --mock-data under TSP and TP+SP.

Needs CUDA with at least 2 GPUs and MEGATRON_LM_PATH; skipped otherwise. Both runs use the same
model, data, seed and fp32 (tiny-cpu config); the lm loss at iteration 1 (same initial weights,
same batch) must agree to fp32 reduction-order precision.
"""

import os
import subprocess
import sys

import pytest
import torch

from megatron_tsp.megatron_lm import compare, configs
from megatron_tsp.megatron_lm.cpu_runner import free_port
from tests.megatron_lm.common import REPO, megatron_lm_path

CHECKOUT = megatron_lm_path()
pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs CUDA with at least 2 GPUs",
    ),
    pytest.mark.skipif(CHECKOUT is None, reason="set MEGATRON_LM_PATH to a Megatron-LM checkout"),
]


def _run(variant, log_path):
    cfg = configs.load_config("tiny-cpu", {"training.train_iters": 3})
    args = configs.to_megatron_args(cfg, variant) + [
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--log-interval",
        "1",
        "--log-throughput",
        "--eval-iters",
        "0",
        "--eval-interval",
        "1000",
    ]
    script = os.path.join(CHECKOUT, "pretrain_gpt.py")
    entry = ["-m", "megatron_tsp.megatron_lm.launch", script] if variant == "tsp" else [script]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        *entry,
        *args,
    ]
    env = dict(
        os.environ,
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        CUDA_DEVICE_MAX_CONNECTIONS="1",
    )
    with open(log_path, "w") as log:
        proc = subprocess.run(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900, cwd=CHECKOUT
        )
    assert proc.returncode == 0, open(log_path).read()[-4000:]
    return compare.parse_log(str(log_path), variant)


def test_tsp_and_tp_sp_give_the_same_first_loss(tmp_path):
    tsp = _run("tsp", tmp_path / "tsp.log")
    tp = _run("tp", tmp_path / "tp.log")
    assert tsp.iterations[:3] == tp.iterations[:3] == [1, 2, 3]
    assert abs(tsp.loss[0] - tp.loss[0]) <= 1e-4 * abs(tp.loss[0]), (tsp.loss, tp.loss)
    print(compare.table([tsp, tp]))
