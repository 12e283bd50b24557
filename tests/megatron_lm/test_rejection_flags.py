"""Every flag of the rejection table against the argument parsers of real Megatron-LM trees.

For each tree (``MEGATRON_LM_PATH`` on this interpreter; ``MEGATRON_LM_PATH_0_19`` on
``$VENV312/bin/python`` when that venv exists; scripts/test_core_0_19.sh also runs this file in the
venv with ``MEGATRON_LM_PATH`` = the core_v0.19.0 tree), a subprocess builds Megatron-LM's own
parser (``add_megatron_arguments`` with the TSP group, as the launcher does) and reports, per row:
whether the flag exists, its dest and choices, and what the launcher's check of the row's mode
(``unsupported_combinations`` / ``tsp_mlp_unsupported_combinations``) says when the row's example is
parsed (rows checked after Megatron's validation: existence and dest only). A row must name a flag
that exists exactly in the trees its ``versions`` list, with the row's dest, offering the values its
condition names; its example must be refused by that row; and Megatron-LM's defaults must pass.

Independently of the table, ``test_launcher_refuses_each_setting_by_name`` runs Megatron-LM's
parser and ``validate_args`` with the launcher's hooks installed (same subprocess) on every
(flag, value) of ``REFUSED``, a list written here: each must be refused naming its flag, so a row
dropped from the table fails here by name.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from megatron_tsp.core import rejections as R
from tests.megatron_lm.common import REPO

_PROBE = r"""
import argparse, importlib.util, json, sys, types
repo, tree = sys.argv[1], sys.argv[2]
sys.path[:0] = [repo, tree]
if importlib.util.find_spec("triton") is None:
    # megatron.training.initialize imports Megatron's batch-invariant Triton kernels at import
    # time; the argument parser does not need them.
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    stub = types.ModuleType(name)
    def _unavailable(*args, **kwargs):
        raise RuntimeError("batch-invariant kernels need triton")
    stub.enable_batch_invariant_mode = stub.disable_batch_invariant_mode = _unavailable
    stub.set_batch_invariant_mode = _unavailable
    stub.is_batch_invariant_mode_enabled = lambda: False
    sys.modules[name] = stub
from megatron.core import package_info
from megatron.training import arguments
from megatron_tsp.core import rejections
from megatron_tsp.megatron_lm.arguments import (add_tsp_arguments, tsp_mlp_unsupported_combinations,
                                                 unsupported_combinations)

def parser():
    return add_tsp_arguments(arguments.add_megatron_arguments(
        argparse.ArgumentParser(allow_abbrev=False)))

# each mode's own flags, and what the launcher checks them with
modes = {rejections.TSP: (["--tensor-sequence-parallel-size", "2"], unsupported_combinations),
         rejections.TSP_MLP: (["--tensor-model-parallel-size", "2", "--sequence-parallel",
                               "--tsp-mlp"], tsp_mlp_unsupported_combinations)}
options = {o: a for a in parser()._actions for o in a.option_strings}
out = {"version": f"{package_info.MAJOR}.{package_info.MINOR}", "rows": {},
       "defaults": {mode: check(parser().parse_args(base))
                    for mode, (base, check) in modes.items()}}
for mode, (base, check) in modes.items():
    for row in rejections.rows(mode):
        action = options.get(row.flag)
        entry = {"exists": action is not None}
        if action is not None:
            entry["dest"] = action.dest
            entry["nargs"] = action.nargs
            entry["choices"] = [getattr(c, "name", str(c)) for c in (action.choices or [])]
            # rows checked after Megatron's validation need its derived values
            if row.stage == rejections.PARSED:
                entry["refusals"] = check(parser().parse_args([*base, *row.argv()]))
        out["rows"][mode + " " + row.flag] = entry
print("PROBE " + json.dumps(out))
"""


def _trees():
    """(label, tree, python): the tree of MEGATRON_LM_PATH on this interpreter (core_v0.16.1 in the
    main CI run, core_v0.19.0 when scripts/test_core_0_19.sh runs this file in the 3.12 venv), and
    MEGATRON_LM_PATH_0_19 on the 3.12 venv's interpreter when that venv exists."""
    trees = [("MEGATRON_LM_PATH", os.environ.get("MEGATRON_LM_PATH"), sys.executable)]
    venv_python = os.path.join(
        os.environ.get("VENV312", os.path.join(REPO, ".venv312")), "bin", "python"
    )
    if os.environ.get("MEGATRON_LM_PATH_0_19") and os.path.isfile(venv_python):
        trees.append(("MEGATRON_LM_PATH_0_19", os.environ["MEGATRON_LM_PATH_0_19"], venv_python))
    return trees


@functools.lru_cache(maxsize=None)
def _probes(tree, python):
    """One subprocess per tree (importing Megatron-LM dominates): the table probe, then the
    launcher probe (``_LAUNCH_PROBE``, after ``install()``). Returns both reports."""
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    env.pop("PYTHONPATH", None)
    request = {"model": MODEL, "modes": MODES, "cases": [[m, argv] for m, argv, _ in REFUSED]}
    proc = subprocess.run(
        [python, "-c", _PROBE + _LAUNCH_PROBE, REPO, tree, json.dumps(request)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = {}
    for tag in ("PROBE", "LAUNCH"):
        line = [x for x in proc.stdout.splitlines() if x.startswith(tag + " ")][-1]
        reports[tag] = json.loads(line[len(tag) + 1 :])
    return reports


def _probe(tree, python):
    return _probes(tree, python)["PROBE"]


@pytest.mark.parametrize("label,tree,python", _trees(), ids=[t[0] for t in _trees()])
def test_table_flags_match_megatron_lm_parser(label, tree, python):
    if not tree or not os.path.isfile(os.path.join(tree, "pretrain_gpt.py")):
        pytest.skip(f"set {label} to a Megatron-LM tree")
    probe = _probe(tree, python)
    version = probe["version"]
    assert version in R.MEGATRON_LM_VERSIONS, version
    for mode, refusals in probe["defaults"].items():
        assert refusals == [], f"Megatron-LM's defaults are refused ({mode}): {refusals}"
    problems = []
    for mode, row in [(mode, row) for mode in (R.TSP, R.TSP_MLP) for row in R.rows(mode)]:
        entry = probe["rows"][mode + " " + row.flag]
        if entry["exists"] != (version in row.versions):
            problems.append(
                f"{row.flag}: exists in core_v{version}: {entry['exists']}, "
                f"table says versions={row.versions}"
            )
            continue
        if not entry["exists"]:
            continue
        if entry["dest"] != row.dest and row.label is None:  # a label: a derived value
            problems.append(f"{row.flag}: dest {entry['dest']!r}, table says {row.dest!r}")
        missing = set(row.condition.values) - set(entry["choices"])
        if missing:
            problems.append(f"{row.flag}: choices {entry['choices']} lack {sorted(missing)}")
        if not row.example and entry["nargs"] != 0:
            problems.append(f"{row.flag} takes a value (nargs={entry['nargs']}): give an example")
        if "refusals" in entry and not any(p.startswith(row.flag) for p in entry["refusals"]):
            problems.append(
                f"{mode}: {row.flag} {' '.join(row.example)} parsed by "
                f"core_v{version} is not refused: {entry['refusals']}"
            )
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------------
# The launcher refuses each setting by name, from a list written here (not from the table).

# (mode, flag and refused value(s) [+ what the value needs], Megatron-LM trees defining the flag
# (None: both)); the message must name the first flag and the mode
REFUSED = [
    ("tsp", ["--tensor-model-parallel-size", "4"], None),
    ("tsp", ["--cp-comm-type", "a2a"], None),
    ("tsp", ["--hierarchical-context-parallel-sizes", "2", "2"], None),
    ("tsp", ["--hybrid-context-parallel"], None),
    ("tsp", ["--tensor-parallel-num-weight-shards", "2"], ("0.19",)),
    ("tsp", ["--tp-comm-overlap"], None),
    ("tsp", ["--delay-wgrad-compute"], None),
    ("tsp", ["--use-megatron-fsdp"], None),
    ("tsp", ["--use-torch-fsdp2"], None),
    ("tsp", ["--cuda-graph-impl", "local"], None),
    ("tsp", ["--cuda-graph-impl", "transformer_engine"], None),
    ("tsp", ["--enable-cuda-graph"], None),
    ("tsp", ["--external-cuda-graph"], None),
    # MoE (experts folded onto the TSP ranks; "tsp-moe" below is the accepted control)
    ("tsp", ["--expert-tensor-parallel-size", "2", "--num-experts", "4"], None),
    # the expert ring ("tsp-moe-ring" below is its accepted control): ETP = D, EP = 1 only
    ("tsp", ["--expert-tensor-parallel-size", "1", "--tsp-moe-ring", "--num-experts", "4"], None),
    ("tsp", ["--expert-model-parallel-size", "2", "--tsp-moe-ring", "--num-experts", "4"], None),
    ("tsp", ["--moe-grouped-gemm", "--num-experts", "4"], None),
    ("tsp", ["--moe-expert-capacity-factor", "1.0", "--num-experts", "4"], None),
    ("tsp", ["--moe-router-load-balancing-type", "sinkhorn", "--num-experts", "4"], None),
    ("tsp", ["--moe-input-jitter-eps", "0.01", "--num-experts", "4"], None),
    ("tsp", ["--moe-token-dispatcher-type", "flex", "--num-experts", "4"], None),
    ("tsp", ["--moe-enable-deepep", "--num-experts", "4"], None),
    ("tsp", ["--moe-shared-expert-overlap", "--num-experts", "4"], None),
    ("tsp", ["--moe-use-upcycling", "--num-experts", "4"], None),
    ("tsp", ["--multi-latent-attention"], None),
    ("tsp", ["--qk-layernorm"], None),
    ("tsp", ["--qk-l2-norm"], None),
    ("tsp", ["--attention-output-gate"], None),
    ("tsp", ["--softmax-type", "off-by-one"], None),
    ("tsp", ["--softmax-type", "learnable"], None),
    ("tsp", ["--window-size", "64,0"], None),
    ("tsp", ["--qk-clip"], None),
    ("tsp", ["--log-max-attention-logit"], None),
    ("tsp", ["--experimental-attention-variant", "dsa"], None),
    ("tsp", ["--position-embedding-type", "mrope"], None),
    ("tsp", ["--attention-backend", "flash"], None),
    ("tsp", ["--attention-backend", "local"], None),
    ("tsp", ["--transformer-impl", "inference_optimized"], None),
    ("tsp", ["--mtp-num-layers", "1"], None),
    ("tsp", ["--heterogeneous-layers-config-path", "layers.json"], None),
    ("tsp", ["--heterogeneous-layers-config-encoded-json", "{}"], None),
    ("tsp", ["--use-legacy-models"], ("0.16",)),
    ("tsp", ["--yaml-cfg", "run.yaml"], None),
    ("tsp", ["--fp8-format", "hybrid"], None),
    ("tsp", ["--fp4-format", "e2m1"], None),
    ("tsp", ["--sft"], None),
    ("tsp", ["--dataloader-inter-document-masking"], ("0.19",)),
    # packed documents are accepted (the "tsp-packed" control below) except where later pipeline
    # stages get no tokens or position ids to read them from
    ("tsp", ["--reset-attention-mask", "--pipeline-model-parallel-size", "2"], None),
    # shapes each rank holds 1/D of (D=2), refused after Megatron's own validation
    ("tsp", ["--num-attention-heads", "5", "--kv-channels", "16"], None),
    # (fewer K/V heads than D is accepted: a group count neither a multiple nor a divisor of 2)
    (
        "tsp",
        [
            "--num-query-groups",
            "3",
            "--group-query-attention",
            "--num-attention-heads",
            "6",
            "--kv-channels",
            "16",
        ],
        None,
    ),
    ("tsp", ["--ffn-hidden-size", "255"], None),
    # the hybrid (TP+SP attention with the TSP MLP ring)
    ("tsp-mlp", ["--tensor-sequence-parallel-size", "2"], None),
    ("tsp-mlp", ["--context-parallel-size", "2"], None),
    ("tsp-mlp", ["--num-experts", "4"], None),
    ("tsp-mlp", ["--tp-comm-overlap"], None),
    ("tsp-mlp", ["--multi-latent-attention"], None),
    ("tsp-mlp", ["--fp8-format", "hybrid"], None),
    ("tsp-mlp", ["--yaml-cfg", "run.yaml"], None),
    ("tsp-mlp", ["--use-torch-fsdp2"], None),
    ("tsp-mlp", ["--enable-cuda-graph"], None),
    ("tsp-mlp", ["--attention-backend", "flash"], None),
    ("tsp-mlp", ["--transformer-impl", "inference_optimized"], None),
    ("tsp-mlp", ["--ffn-hidden-size", "255"], None),
    # a TSP-attention option: the hybrid keeps Megatron's attention
    ("tsp-mlp", ["--tsp-kv-grad-reduce-in-fp32"], None),
]
# A tiny model that both modes accept (checked: the control case must pass validation).
MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 "
    "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 2 "
    "--train-iters 1 --lr 1e-3 --transformer-impl local --no-gradient-accumulation-fusion "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --tsp-dry-run"
).split()
MODES = {
    "tsp": ["--tensor-sequence-parallel-size", "2"],
    "tsp-mlp": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tsp-mlp"],
    # MoE under TSP is accepted (experts over EP=2, the launcher sets expert-TP to 1)
    "tsp-moe": [
        "--tensor-sequence-parallel-size",
        "2",
        "--num-experts",
        "4",
        "--expert-model-parallel-size",
        "2",
        "--moe-router-topk",
        "2",
        "--moe-aux-loss-coeff",
        "1e-2",
        "--moe-z-loss-coeff",
        "1e-3",
        "--moe-shared-expert-intermediate-size",
        "64",
        "--moe-layer-freq",
        "[0,1]",
        "--moe-token-dispatcher-type",
        "alltoall",
    ],
    # packed documents under TSP, through Megatron's own parse_args and validate_args: the
    # dataloader's S x S mask stays off, the batch hook reads the documents
    "tsp-packed": [
        "--tensor-sequence-parallel-size",
        "2",
        "--reset-attention-mask",
        "--reset-position-ids",
        "--eod-mask-loss",
    ],
    # the TSP expert ring: the launcher leaves expert-TP at D (EP 1); any dispatcher type
    "tsp-moe-ring": [
        "--tensor-sequence-parallel-size",
        "2",
        "--tsp-moe-ring",
        "--num-experts",
        "4",
        "--moe-router-topk",
        "2",
        "--moe-shared-expert-intermediate-size",
        "64",
        "--moe-token-dispatcher-type",
        "alltoall",
    ],
}

# Runs after _PROBE, in the same process (its imports and sys.path); the request is argv[3].
_LAUNCH_PROBE = r"""
import contextlib, io
request = json.loads(sys.argv[3])
from megatron_tsp.megatron_lm import TSPArgumentError, install
install()  # what the launcher does before running the script

def parser():  # Megatron-LM's parser, with the TSP group the launcher's hook adds to it
    return arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))

options = {o for a in parser()._actions for o in a.option_strings}

def launch(argv):
    # Megatron's own parse_args (it reads sys.argv and may act on what it parsed, e.g. load a
    # --yaml-cfg file) and then validate_args, as pretrain_gpt.py calls them (the TSP checks run
    # inside validate_args); --tsp-dry-run keeps CUDA out of the validation.
    sys.argv = ["pretrain_gpt.py"] + list(argv)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = arguments.parse_args()
            args.rank, args.world_size = 0, 2  # Megatron's parse_args: from the environment
            arguments.validate_args(args, {})
    except TSPArgumentError as exc:
        return {"refused": str(exc)}
    except BaseException as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"accepted": True}

modes = request["modes"]
out = {"version": f"{package_info.MAJOR}.{package_info.MINOR}",
       "controls": {mode: launch(request["model"] + base) for mode, base in modes.items()},
       "cases": []}
for mode, extra in request["cases"]:
    if extra[0] not in options:
        out["cases"].append({"absent": True})
    else:
        out["cases"].append(launch(request["model"] + modes[mode] + extra))
print("LAUNCH " + json.dumps(out))
"""


@pytest.mark.parametrize("label,tree,python", _trees(), ids=[t[0] for t in _trees()])
def test_launcher_refuses_each_setting_by_name(label, tree, python):
    """Megatron-LM's own parser and ``validate_args`` with the launcher's hooks installed, one
    process: every (flag, value) of ``REFUSED`` is refused with a ``TSPArgumentError`` whose message
    names the flag and the mode; the same command line without it is accepted."""
    if not tree or not os.path.isfile(os.path.join(tree, "pretrain_gpt.py")):
        pytest.skip(f"set {label} to a Megatron-LM tree")
    probe = _probes(tree, python)["LAUNCH"]
    version = probe["version"]
    for mode, result in probe["controls"].items():
        assert result == {"accepted": True}, f"{mode}: the control command line fails: {result}"
    problems = []
    for (mode, argv, versions), result in zip(REFUSED, probe["cases"]):
        flag, shown = argv[0], f"{mode}: {' '.join(argv)}"
        if versions is not None and version not in versions:
            if not result.get("absent"):
                problems.append(f"{shown}: expected absent from core_v{version}")
            continue
        if result.get("absent"):
            problems.append(f"{shown}: not a flag of core_v{version}")
        elif "refused" not in result:
            problems.append(f"{shown}: not refused by the launcher (core_v{version}): {result}")
        elif flag not in result["refused"] or R.MODE_FLAGS[mode] not in result["refused"]:
            problems.append(f"{shown}: refused without naming {flag}: {result['refused']}")
    assert not problems, "\n".join(problems)
