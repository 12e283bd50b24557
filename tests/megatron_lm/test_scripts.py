"""The A/B launch scripts (scripts/run_ab_local.sh, scripts/slurm/*) with stub torchrun, sbatch,
srun and scontrol on PATH that record their argv: the exact command lines users would run.

The stub torchrun also prints Megatron-like iteration lines and, given ``--tensorboard-dir``,
writes TensorBoard event files there, so the scripts' final comparison runs for real."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from megatron_tsp.megatron_lm import configs
from tests.megatron_lm.common import REPO

_RECORD = r"""#!{python}
import json, os, sys
name = os.path.basename(sys.argv[0])
with open(os.path.join(os.environ["STUB_RECORD_DIR"], "calls.jsonl"), "a") as f:
    f.write(json.dumps({{"cmd": name, "argv": sys.argv[1:],
                         "env": {{k: os.environ.get(k) for k in ("VARIANT", "MASTER_ADDR",
                                                                 "MASTER_PORT")}}}}) + "\n")
if name == "sbatch":
    print("4242")
elif name == "scontrol":
    print("node001\nnode002")
elif name == "torchrun":
    argv = sys.argv[1:]
    losses = [7.0, 6.5, 6.25]
    for it, loss in enumerate(losses, start=1):
        print(f" [t] iteration {{it:8d}}/{{3:8d}} | elapsed time per iteration (ms): 100.0 | "
              f"global batch size: {{2:5d}} | lm loss: {{loss:.6E}} |")
    if "--tensorboard-dir" in argv:
        from megatron_tsp.megatron_lm import event_files as E
        tb = argv[argv.index("--tensorboard-dir") + 1]
        os.makedirs(tb, exist_ok=True)
        E.write_events(os.path.join(tb, "events.out.tfevents.1.stub"),
                       [E.encode_event(step=i, scalars=[("lm loss", l), ("iteration-time", 0.1)])
                        for i, l in enumerate(losses, start=1)])
"""


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("torchrun", "sbatch", "srun", "scontrol"):
        path = bin_dir / name
        path.write_text(_RECORD.format(python=sys.executable))
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text("raise SystemExit('not run by these tests')\n")
    record = tmp_path / "record"
    record.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TSP_REPO"))}
    for knob in (
        "DATA_PATH",
        "TOKENIZER_ARGS",
        "TOKENIZER_MODEL",
        "VOCAB_FILE",
        "MERGE_FILE",
        "CKPT_DIR",
        "LOAD_DIR",
        "TENSORBOARD_DIR",
        "EXTRA_ARGS",
        "SRUN_ARGS",
        "TORCHRUN_ARGS",
        "DIST_OPT",
        "VARIANTS",
        "NPROC",
        "CONFIG",
        "TSP_SIZE",
        "HAVE_TE",
        "HAVE_APEX",
    ):
        env.pop(knob, None)
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        STUB_RECORD_DIR=str(record),
        MEGATRON_LM_PATH=str(checkout),
        PYTHON=sys.executable,
        CONFIG="tiny-cpu",
        LOG_DIR=str(tmp_path / "logs"),
        HAVE_TE="1",  # the exact lines below are a GPU cluster's (test_box_without_te: none)
    )

    def calls():
        path = record / "calls.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    return env, checkout, calls, tmp_path


def _run(script, env, **extra):
    proc = subprocess.run(
        ["bash", os.path.join(REPO, script)],
        env=dict(env, **extra),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(env["LOG_DIR"]),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _common(cfg, data, tokenizer, dist_opt=True, extra=()):
    return (
        configs.model_args(cfg)
        + configs.training_args(cfg)
        + data
        + ["--no-create-attention-mask-in-dataloader"]
        + tokenizer
        + [
            "--log-interval",
            "1",
            "--log-throughput",
            "--eval-iters",
            "0",
            "--eval-interval",
            "1000000",
        ]
        + (["--use-distributed-optimizer"] if dist_opt else [])
        + list(extra)
    )


PARALLEL = {
    "tsp": ["--tensor-sequence-parallel-size", "2"],
    "tp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "cp": ["--context-parallel-size", "2"],
}


def test_local_ab_with_data_tokenizer_checkpoints_tensorboard(stubs):
    env, checkout, calls, tmp = stubs
    ckpt, tb = tmp / "ckpt", tmp / "tb"
    _run(
        "scripts/run_ab_local.sh",
        env,
        NPROC="2",
        VARIANTS="tsp tp cp",
        DATA_PATH="0.3 /data/a_text_document 0.7 /data/b_text_document",
        TOKENIZER_MODEL="/tok/llama3",
        CKPT_DIR=str(ckpt),
        SAVE_INTERVAL="50",
        TENSORBOARD_DIR=str(tb),
        EXTRA_ARGS="--seed 7",
        TORCHRUN_ARGS="--rdzv-backend c10d",
    )
    cfg = configs.load_config("tiny-cpu")
    data = [
        "--data-path",
        "0.3",
        "/data/a_text_document",
        "0.7",
        "/data/b_text_document",
        "--split",
        "949,50,1",
    ]
    tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/tok/llama3"]
    common = _common(cfg, data, tokenizer, extra=["--seed", "7"])
    recorded = calls()
    assert [c["cmd"] for c in recorded] == ["torchrun"] * 3
    for call, variant in zip(recorded, ("tsp", "tp", "cp")):
        entry = (["-m", "megatron_tsp.megatron_lm.launch"] if variant == "tsp" else []) + [
            f"{checkout}/pretrain_gpt.py"
        ]
        outputs = [
            "--save",
            f"{ckpt}/{variant}",
            "--save-interval",
            "50",
            "--load",
            f"{ckpt}/{variant}",
            "--tensorboard-dir",
            f"{tb}/{variant}",
            "--tensorboard-log-interval",
            "1",
            "--log-timers-to-tensorboard",
            "--log-memory-to-tensorboard",
            "--log-world-size-to-tensorboard",
        ]
        assert call["argv"] == (
            ["--nproc-per-node", "2", "--master-port", "29500", "--rdzv-backend", "c10d"]
            + entry
            + common
            + outputs
            + PARALLEL[variant]
        ), variant
    # the comparison at the end read the TensorBoard directories the stub wrote
    assert (tmp / "logs" / "loss.png").exists()
    assert (tmp / "logs" / "tsp.log").read_text().startswith("[ab] tsp: torchrun ")


def test_local_ab_defaults_and_load_dir(stubs):
    env, checkout, calls, tmp = stubs
    proc = _run(
        "scripts/run_ab_local.sh",
        env,
        NPROC="2",
        DIST_OPT="0",
        LOAD_DIR="/ckpt/tsp2",
        VARIANTS="tp cp",
    )
    cfg = configs.load_config("tiny-cpu")
    tokenizer = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1024"]
    common = _common(cfg, ["--mock-data"], tokenizer, dist_opt=False)
    tp, cp = (c["argv"] for c in calls())
    assert tp == (
        ["--nproc-per-node", "2", "--master-port", "29500", f"{checkout}/pretrain_gpt.py"]
        + common
        + ["--load", "/ckpt/tsp2"]
        + PARALLEL["tp"]
    )
    # without DIST_OPT the cp variant keeps its own --use-distributed-optimizer
    assert cp[-5:] == [
        "--load",
        "/ckpt/tsp2",
        "--context-parallel-size",
        "2",
        "--use-distributed-optimizer",
    ]
    assert "lm loss" in proc.stdout  # the log comparison ran


def test_box_without_transformer_engine(stubs):
    """Without Transformer Engine the stock tp variant (Megatron's default TE layers: NameError
    TESpecProvider) runs Megatron's local layers: with apex as they are, without apex with the
    project's TP+SP spec through the launcher; each says so in one line. cp is refused before
    any variant runs (Megatron's context parallelism needs TEDotProductAttention)."""
    env, checkout, calls, tmp = stubs
    local = ["--transformer-impl", "local"]
    spec = ["--spec", "megatron_tsp.megatron_lm.spec", "tp_sp_block_spec"]
    launcher = ["-m", "megatron_tsp.megatron_lm.launch", f"{checkout}/pretrain_gpt.py"]
    proc = _run(
        "scripts/run_ab_local.sh", env, NPROC="2", VARIANTS="tsp tp", HAVE_TE="0", HAVE_APEX="0"
    )
    tsp, tp = (c["argv"] for c in calls())
    assert tsp[4:7] == launcher and tsp[-2:] == PARALLEL["tsp"]  # TSP: unchanged
    assert tp[4:7] == launcher and tp[-8:] == PARALLEL["tp"] + local + spec
    notices = [x for x in proc.stderr.splitlines() if x.startswith("[ab] tp: no Transformer")]
    assert len(notices) == 1 and "the project's TP+SP spec" in notices[0], proc.stderr
    (tmp / "record" / "calls.jsonl").unlink()
    _run("scripts/run_ab_local.sh", env, NPROC="2", VARIANTS="tp", HAVE_TE="0", HAVE_APEX="1")
    (tp,) = (c["argv"] for c in calls())
    assert tp[4] == f"{checkout}/pretrain_gpt.py" and tp[-5:] == PARALLEL["tp"] + local
    (tmp / "record" / "calls.jsonl").unlink()
    refused = subprocess.run(
        ["bash", os.path.join(REPO, "scripts/run_ab_local.sh")],
        env=dict(env, NPROC="2", VARIANTS="tsp cp", HAVE_TE="0"),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(env["LOG_DIR"]),
    )
    assert refused.returncode == 2 and not calls(), refused.stderr
    assert "cp, which needs Transformer Engine" in refused.stderr


def test_gpt2_bpe_tokenizer_files(stubs):
    env, _, calls, _ = stubs
    _run(
        "scripts/run_ab_local.sh",
        env,
        NPROC="2",
        VARIANTS="tsp",
        VOCAB_FILE="/tok/vocab.json",
        MERGE_FILE="/tok/merges.txt",
        DATA_PATH="/data/web_text_document",
        SPLIT="98,2,0",
    )
    argv = calls()[0]["argv"]
    i = argv.index("--data-path")
    assert argv[i : i + 4] == ["--data-path", "/data/web_text_document", "--split", "98,2,0"]
    i = argv.index("--tokenizer-type")
    assert argv[i : i + 6] == [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        "/tok/vocab.json",
        "--merge-file",
        "/tok/merges.txt",
    ]
    env_bad = dict(env, VOCAB_FILE="/tok/vocab.json")
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "scripts/run_ab_local.sh")],
        env=env_bad,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and "MERGE_FILE" in proc.stderr


def test_slurm_submit_and_job_steps(stubs):
    env, checkout, calls, tmp = stubs
    logs = tmp / "logs"
    _run(
        "scripts/slurm/ab_submit.sh",
        env,
        NODES="2",
        GPUS_PER_NODE="2",
        PARTITION="gpu",
        ACCOUNT="acct",
        TIME="00:10:00",
        SBATCH_EXTRA="--qos high",
    )
    sbatch = calls()
    assert [c["cmd"] for c in sbatch] == ["sbatch", "sbatch"]
    for call, variant in zip(sbatch, ("tsp", "tp")):
        assert call["argv"] == [
            "--parsable",
            "--nodes",
            "2",
            "--ntasks-per-node",
            "2",
            "--gpus-per-node",
            "2",
            "--partition",
            "gpu",
            "--account",
            "acct",
            "--time",
            "00:10:00",
            "--qos",
            "high",
            "--job-name",
            f"tsp-ab-{variant}",
            "--output",
            f"{logs}/{variant}.log",
            f"--export=ALL,VARIANT={variant}",
            f"{REPO}/scripts/slurm/train.sbatch",
        ]
        assert call["env"]["VARIANT"] == variant

    # the job itself, as SLURM would start it on the first node
    job = dict(
        env,
        TSP_REPO=REPO,
        VARIANT="tsp",
        SLURM_JOB_NODELIST="node[001-002]",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES="2",
        GPUS_PER_NODE="2",
        SRUN_ARGS="--container-image=megatron.sqsh --gpu-bind=closest",
        TORCHRUN_ARGS="--max-restarts 0",
        CKPT_DIR="/ckpt",
        SAVE_INTERVAL="100",
    )
    cfg = configs.load_config("tiny-cpu")
    common = _common(
        cfg, ["--mock-data"], ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1024"]
    )
    tail = (
        ["-m", "megatron_tsp.megatron_lm.launch", f"{checkout}/pretrain_gpt.py"]
        + common
        + ["--save", "/ckpt/tsp", "--save-interval", "100", "--load", "/ckpt/tsp"]
        + PARALLEL["tsp"]
    )
    _run("scripts/slurm/train.sbatch", job, LAUNCH_MODE="srun")
    srun = [c for c in calls() if c["cmd"] == "srun"][-1]
    argv = srun["argv"]
    assert argv[:6] == [
        "--ntasks-per-node=2",
        "--kill-on-bad-exit=1",
        "--container-image=megatron.sqsh",
        "--gpu-bind=closest",
        "bash",
        "-c",
    ]
    assert "export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID" in argv[6]
    assert argv[7:] == ["_", sys.executable] + tail
    assert srun["env"]["MASTER_ADDR"] == "node001" and srun["env"]["MASTER_PORT"] == "24242"

    _run("scripts/slurm/train.sbatch", job, LAUNCH_MODE="torchrun")
    argv = [c for c in calls() if c["cmd"] == "srun"][-1]["argv"]
    assert argv == (
        [
            "--ntasks-per-node=1",
            "--kill-on-bad-exit=1",
            "--container-image=megatron.sqsh",
            "--gpu-bind=closest",
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "node001:24242",
            "--rdzv-id",
            "4242",
            "--max-restarts",
            "0",
        ]
        + tail
    )
