"""The README's main job, shrunk: TSP and TP+SP train side by side and agree."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_losses_agree_and_fall():
    cmd = [
        sys.executable,
        "-m",
        "megatron_tsp.tools.demo",
        "--world-size",
        "2",
        "--tsp",
        "2",
        "--steps",
        "4",
        "--seq-length",
        "64",
        "--hidden-size",
        "32",
        "--ffn-hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--num-query-groups",
        "2",
        "--micro-batch-size",
        "2",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 4
    assert "AGREE" in out
    losses = [float(line.split("loss TSP")[1].split()[0]) for line in steps]
    assert losses[-1] < losses[0]
    for op in ("broadcast", "irecv", "all_gather_into_tensor", "reduce_scatter_tensor"):
        assert op in out


def test_demo_rejects_bad_layout():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_tsp.tools.demo", "--world-size", "3", "--tsp", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "world size 3 is not divisible" in proc.stderr
