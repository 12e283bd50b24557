"""Against a real Megatron-LM checkout (``MEGATRON_LM_PATH``): the real pretrain_gpt.py command line
through Megatron's argument code, ``--tsp-dry-run`` end to end, the patch, and the model built by
Megatron's own builder checked against the stock model for one forward on CPU.

Skipped unless MEGATRON_LM_PATH points at a checkout (tested: core_v0.16.1 on Python 3.11 and
core_v0.19.0 on Python 3.12 with megatron-core 0.19.2; see docs/megatron-lm.md).
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from megatron_tsp.megatron_lm import configs
from tests.megatron_lm.common import REPO, megatron_lm_path, run_launcher

CHECKOUT = megatron_lm_path()
pytestmark = pytest.mark.skipif(
    CHECKOUT is None, reason="set MEGATRON_LM_PATH to a Megatron-LM checkout to run these"
)


def _script():
    return os.path.join(CHECKOUT, "pretrain_gpt.py")


def _config_args(name, variant="tsp"):
    cfg = configs.load_config(name)
    return cfg, configs.to_megatron_args(cfg, variant) + [
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
    ]


def _expected_params_per_rank(cfg, padded_vocab):
    """Parameters on one TSP rank (PP=1), from the shapes of Megatron's TP=D layers."""
    m = cfg["model"]
    d = cfg["parallel"]["tensor_sequence_parallel_size"]
    h, f, heads, groups = (
        m["hidden_size"],
        m["ffn_hidden_size"],
        m["num_attention_heads"],
        m["num_query_groups"],
    )
    head_dim = h // heads
    bias = not m.get("disable_bias_linear", False)
    qkv_out = (heads + 2 * groups) * head_dim
    fc1_out = f * (2 if m["swiglu"] else 1)
    norm = h * (2 if m["normalization"] == "LayerNorm" else 1)
    layer = (qkv_out * h + h * h + fc1_out * h + f * h) // d + 2 * norm
    if bias:
        layer += (qkv_out + fc1_out) // d + 2 * h  # column biases sharded, row biases replicated
    total = m["num_layers"] * layer + norm + padded_vocab // d * h
    if m.get("untie_embeddings_and_output_weights", False):
        total += padded_vocab // d * h
    if m["position_embedding_type"] == "learned_absolute":
        total += m["max_position_embeddings"] * h
    return total


_GROUP_PROBE = """
import argparse, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from megatron_tsp.megatron_lm import install
install()
install()  # the launcher and a patched pretrain_gpt.py both install: must stay one wrapper
import megatron.core.utils as core_utils
hooked = core_utils.get_batch_on_this_cp_rank
wrapped_once = (hasattr(hooked, "__wrapped_by_tsp__")
                and not hasattr(hooked.__wrapped_by_tsp__, "__wrapped_by_tsp__"))
from megatron.training import arguments
parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
titles = [g.title for g in parser._action_groups]
ours = [g for g in parser._action_groups if g.title == "tensor-sequence parallel"]
print(titles.count("tensor-sequence parallel"), len(titles))
print(" ".join(a.option_strings[0] for a in ours[0]._group_actions))
args = parser.parse_args(["--tensor-sequence-parallel-size", "4"])
print(args.tensor_sequence_parallel_size, args.tensor_model_parallel_size)
print("batch hook wrapped once:", wrapped_once)
"""


def test_help_lists_the_tsp_group():
    # The group is added by Megatron's own add_megatron_arguments (wrapped), next to its groups.
    probe = subprocess.run(
        [sys.executable, "-c", _GROUP_PROBE, REPO, CHECKOUT],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    counts, flags, parsed, hook = probe.stdout.strip().splitlines()[-4:]
    assert hook == "batch hook wrapped once: True"
    ours, groups = (int(x) for x in counts.split())
    assert ours == 1 and groups > 20
    assert flags.split() == [
        "--tensor-sequence-parallel-size",
        "--tsp-mlp",
        "--tsp-kv-grad-reduce-in-fp32",
        "--tsp-kv-grad-all-to-all",
        "--tsp-activation-sums-in-fp32",
        "--tsp-vocab-ring",
        "--tsp-moe-ring",
        "--tsp-dry-run",
        "--tsp-dry-run-world-size",
        "--tsp-dry-run-rank",
    ]
    assert parsed.split() == ["4", "1"]  # translation happens in validate_args, not at parse
    proc = run_launcher([_script(), "--help"])
    if proc.returncode != 0:
        # core_v0.19.0's own --help crashes (a '%' in one of Megatron's help strings); it must
        # crash the same way without the TSP hooks for this to be acceptable.
        stock = subprocess.run(
            [sys.executable, _script(), "--help"],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=CHECKOUT,
            env=dict(os.environ, PYTHONPATH=CHECKOUT),
        )
        assert stock.returncode != 0, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1] == stock.stderr.strip().splitlines()[-1]
        pytest.skip(f"this checkout's own --help fails: {stock.stderr.strip().splitlines()[-1]}")
    assert "tensor-sequence parallel:" in proc.stdout
    assert "--tensor-sequence-parallel-size D" in proc.stdout
    assert "--tensor-model-parallel-size" in proc.stdout  # Megatron's own groups are there too


@pytest.mark.parametrize("name", ["paper-7b-128k", "llama3-8b-128k"])
def test_dry_run_end_to_end(name):
    cfg, args = _config_args(name)
    proc = run_launcher(
        [
            _script(),
            *args,
            "--tsp-dry-run",
            "--tsp-dry-run-world-size",
            "16",
            "--tsp-dry-run-rank",
            "9",
        ]
    )
    out = proc.stdout
    assert proc.returncode == 0, (out[-3000:], proc.stderr[-3000:])
    assert "world size        : 16 = TSP 8 x PP 1 x DP 2" in out
    assert "TSP groups        : [0, 1, 2, 3, 4, 5, 6, 7]  [8, 9, 10, 11, 12, 13, 14, 15]" in out
    assert "rank 9            : tp_rank=1 pp_rank=0 dp_rank=1" in out
    assert "TSPSelfAttention" in out and "TSPMLP" in out
    # the attention backend the layers chose for the GPU they will run on, and their mode
    pattern = r"attention_kernel=\w+ \(attention_backward=(saved|recompute), selected_by=default\)"
    assert re.search(pattern, out), out[-2000:]
    want_norm = cfg["model"]["normalization"]
    # SequenceParallelLayerNorm / SequenceParallelRMSNorm
    assert re.search(rf"final_layernorm=\S+\.\w*{want_norm}\b", out), out[-2000:]
    padded = int(re.search(r"padded vocab\s+: (\d+)", out).group(1))
    # "auto": the vocabulary ring where it receives fewer bytes than Megatron's output layer
    # (7B's 32k vocabulary at 128k tokens: the ring; Llama-3's 128k vocabulary: Megatron's)
    from megatron_tsp.core import output_head

    head = re.search(r"output layer\s+: (.*)", out).group(1)
    tokens, crossover = (int(n) for n in re.search(r"of (\d+) tokens.* from (\d+)", head).groups())
    assert crossover == output_head.crossover_tokens(padded, cfg["model"]["hidden_size"], 2, 4)
    assert head.startswith("TSP vocabulary ring" if tokens >= crossover else "Megatron's"), head
    assert head.endswith("(--tsp-vocab-ring auto)") and tokens == cfg["model"]["seq_length"]
    assert padded % (128 * 8) == 0 and padded >= cfg["model"]["vocab_size"]
    params = int(re.search(r"params on rank 9\s*: ([\d,]+)", out).group(1).replace(",", ""))
    assert params == _expected_params_per_rank(cfg, padded)
    s = cfg["model"]["seq_length"]
    c = s // 16
    assert f"TSP rank 1: chunks 1 and 14 -> tokens [{c}, {2 * c}), [{14 * c}, {15 * c})" in out
    assert "CUDA initialized  : no" in out
    # the declared patches: what this run replaced, each line with its target and reason
    from megatron_tsp.megatron_lm import dry_run, patch_checks, patches
    from megatron_tsp.tools import patch_table

    patch_table.all_patches()  # every applier's rows declared in this process

    listed = re.search(r"patches\s+: (\d+) applied", out)
    assert listed and int(listed.group(1)) >= 10, out[-3000:]
    for state, mode, target in (
        ("active ", patches.LAUNCH, "megatron.training.arguments:validate_args"),
        ("active ", patches.CPU_SUPPORT, "torch.cuda:current_device"),
        ("removed", patches.DRY_RUN, "megatron.training.arguments:get_device_arch_version"),
        ("removed", patches.DRY_RUN, "torch.cuda:current_device"),
    ):
        line = f"{state} {mode:<11} {target}: {patches.find(mode, target).reason}"
        assert line in out, (line, out[-3000:])
    # every target a launch patches, checked in the imported megatron-core and the script's
    # checkout
    declared = len([p for p in patch_table.all_patches() if p.mode in dry_run.LAUNCH_MODES])
    line = f"patch targets     : all {declared} declared targets of a launch present"
    assert line in out, out[-3000:]
    tree = os.path.dirname(os.path.abspath(_script()))
    version = patch_checks.tree_version(tree)
    assert f"checked in Megatron-LM tree {tree} (core_v{version})" in out, out[-3000:]


def test_dry_run_prints_the_moe_layout():
    """MoE under TSP through pretrain_gpt.py's own argument path and builder: the launcher sets
    expert-TP to 1, the dense-then-MoE pattern builds megatron-core's MoELayer in layer 2 only,
    and the dry run prints the schedule, this rank's experts and the expert groups."""
    model = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 "
        "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 1 "
        "--global-batch-size 2 --train-iters 1 --lr 1e-3 --transformer-impl local "
        "--no-gradient-accumulation-fusion --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 1024 --swiglu --disable-bias-linear --normalization RMSNorm "
        "--tensor-sequence-parallel-size 2 --num-experts 4 --expert-model-parallel-size 2 "
        "--moe-router-topk 2 --moe-ffn-hidden-size 64 --moe-aux-loss-coeff 1e-2"
    ).split()
    proc = run_launcher(
        [_script(), *model, "--moe-layer-freq", "[0,1]", "--tsp-dry-run"]
        + ["--tsp-dry-run-world-size", "4", "--tsp-dry-run-rank", "3"]
    )
    out = proc.stdout
    assert proc.returncode == 0, (out[-3000:], proc.stderr[-3000:])
    for line in (
        "MoE               : 4 experts, top-2, allgather dispatcher; experts folded onto the TSP "
        "axis (megatron-core MoELayer behind TSP attention; --tsp-moe-ring would shard every "
        "expert over the TSP ranks instead)",
        "experts           : 2 per rank (EP 2, expert-TP 1); rank 3 holds experts [2, 3]",
        "EP groups         : [0, 1]  [2, 3]",
        "expert-TP groups  : [0]  [1]  [2]  [3]",
        "expert-DP groups  : [0, 2]  [1, 3]",
        "MoE layers        : [2] on this stage",
    ):
        assert line in out, (line, out[-3000:])


def test_dry_run_prints_the_moe_ring_layout():
    """--tsp-moe-ring: the launcher leaves expert-TP at D = 2 (EP 1), the ring's MoE layer is
    built in layer 2, and the dry run names the schedule: every rank holds half of every
    expert."""
    model = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 "
        "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 1 "
        "--global-batch-size 2 --train-iters 1 --lr 1e-3 --transformer-impl local "
        "--no-gradient-accumulation-fusion --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 1024 --swiglu --disable-bias-linear --normalization RMSNorm "
        "--tensor-sequence-parallel-size 2 --tsp-moe-ring --num-experts 4 "
        "--moe-router-topk 2 --moe-ffn-hidden-size 64 --moe-aux-loss-coeff 1e-2"
    ).split()
    proc = run_launcher(
        [_script(), *model, "--moe-layer-freq", "[0,1]", "--tsp-dry-run"]
        + ["--tsp-dry-run-world-size", "2", "--tsp-dry-run-rank", "1"]
    )
    out = proc.stdout
    assert proc.returncode == 0, (out[-3000:], proc.stderr[-3000:])
    for line in (
        "MoE               : 4 experts, top-2, TSP expert ring (--tsp-moe-ring: every expert "
        "sharded 1/D per rank, its weight shards on the TSP P2P ring; tokens stay, no "
        "dispatcher communication)",
        "experts           : 4 per rank (EP 1, expert-TP 2); rank 1 holds 1/2 of experts "
        "[0, 1, 2, 3]",
        "EP groups         : [0]  [1]",
        "expert-TP groups  : [0, 1]",
        "MoE layers        : [2] on this stage",
    ):
        assert line in out, (line, out[-3000:])


def test_dry_run_tsp_x_cp_prints_both_groups_and_the_chunk_map():
    """--tensor-sequence-parallel-size 2 --context-parallel-size 2 on 8 ranks: the weight
    (TSP) groups, the sequence (tensor-and-context) groups, and the 2DC-chunk zigzag per
    sequence rank q = cp_rank * D + tsp_rank."""
    _, args = _config_args("tiny-cpu")
    proc = run_launcher(
        [
            _script(),
            *args,
            "--context-parallel-size",
            "2",
            "--tsp-dry-run",
            "--tsp-dry-run-world-size",
            "8",
            "--tsp-dry-run-rank",
            "5",
        ]
    )
    out = proc.stdout
    assert proc.returncode == 0, (out[-3000:], proc.stderr[-3000:])
    assert "world size        : 8 = TSP 2 x PP 1 x CP 2 x DP 2" in out
    assert "world=8 = TSP 2 x PP 1 x CP 2 x DP 2" in out  # the launcher's one-line summary
    assert "TSP groups        : [0, 1]  [2, 3]  [4, 5]  [6, 7]" in out
    assert "CP groups         : [0, 2]  [1, 3]  [4, 6]  [5, 7]" in out
    assert "sequence groups   : [0, 1, 2, 3]  [4, 5, 6, 7] (TSP x CP" in out
    seq = int(re.search(r"zigzag\s+: seq_length (\d+) = 8 chunks", out).group(1))
    c = seq // 8
    assert (
        f"seq rank 2 (TSP 0, CP 1): chunks 2 and 5 -> tokens [{2 * c}, {3 * c}), "
        f"[{5 * c}, {6 * c})" in out
    ), out[-3000:]


def test_dry_run_rejects_unsupported_flags_by_name():
    _, args = _config_args("tiny-cpu")
    proc = run_launcher(
        [_script(), *args, "--cp-comm-type", "a2a", "--tp-comm-overlap", "--tsp-dry-run"]
    )
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    err = proc.stderr
    assert "megatron_tsp: error:" in err
    assert "--cp-comm-type=a2a" in err and "--tp-comm-overlap" in err
    assert "--tensor-sequence-parallel-size=2" in err


def test_dry_run_rejects_bad_shapes_after_megatron_validation():
    _, args = _config_args("tiny-cpu")
    proc = run_launcher(
        [
            _script(),
            *args,
            "--seq-length",
            "126",
            "--max-position-embeddings",
            "128",
            "--tsp-dry-run",
        ]
    )
    assert proc.returncode == 2
    assert (
        "--seq-length=126 must be divisible by 2 x tensor-sequence-parallel size = 4" in proc.stderr
    )


def test_patched_checkout_runs_the_dry_run(tmp_path):
    for name in ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py"):
        if os.path.exists(os.path.join(CHECKOUT, name)):
            shutil.copy(os.path.join(CHECKOUT, name), tmp_path / name)
    apply = [sys.executable, os.path.join(REPO, "patches", "apply.py"), str(tmp_path)]
    assert subprocess.run(apply + ["--check"], capture_output=True).returncode == 1
    proc = subprocess.run(apply, capture_output=True, text=True)
    assert proc.returncode == 0 and "verified" in proc.stdout, proc.stderr
    _, args = _config_args("tiny-cpu")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in [REPO, CHECKOUT, os.environ.get("PYTHONPATH")] if p),
        CUDA_DEVICE_MAX_CONNECTIONS="1",
    )
    env.pop("WORLD_SIZE", None)
    run = subprocess.run(
        [sys.executable, str(tmp_path / "pretrain_gpt.py"), *args, "--tsp-dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(tmp_path),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "TSP 2 x PP 1 x DP 1" in run.stdout and "TSPSelfAttention" in run.stdout


def test_megatron_builder_tsp_model_matches_stock_forward(tmp_path, seed):
    out = tmp_path / "builder.json"
    script = os.path.join(os.path.dirname(__file__), "mlm_builder_check.py")
    proc = subprocess.run(
        [sys.executable, script, CHECKOUT, str(out), str(seed)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank_result in json.load(open(out)):
        for style in ("gpt2", "llama"):
            r = rank_result[style]
            assert r["tokens"][0] == r["tokens"][1] > 0
            assert r["rel"] < 1e-5, rank_result
