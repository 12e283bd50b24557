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
"""

from __future__ import annotations

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


def _probe(tree, python):
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [python, "-c", _PROBE, REPO, tree], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("PROBE ")][-1]
    return json.loads(line[len("PROBE ") :])


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
