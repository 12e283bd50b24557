"""Run an unmodified Megatron-LM training script with TSP available by flag.

    python -m megatron_tsp.megatron_lm.launch path/to/pretrain_gpt.py <megatron args> \\
        --tensor-sequence-parallel-size D

works wherever ``python path/to/pretrain_gpt.py ...`` works: as the command of ``torchrun``
(``torchrun --nproc-per-node 8 -m megatron_tsp.megatron_lm.launch pretrain_gpt.py ...``) and of
``srun`` with one task per GPU (the SLURM rank variables are mapped to RANK / WORLD_SIZE /
LOCAL_RANK when torchrun's are absent; MASTER_ADDR / MASTER_PORT must be exported by the batch
script).

The launcher puts the script's directory first on ``sys.path`` (as ``python script.py`` does, so the
checkout's ``megatron`` package is the one imported), calls ``megatron_tsp.megatron_lm.install()``
and runs the script as ``__main__``. Without ``--tensor-sequence-parallel-size`` the run is stock
Megatron-LM. ``--tsp-dry-run`` validates the command line and builds one rank's model on the meta
device without CUDA.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional

USAGE = (
    "usage: python -m megatron_tsp.megatron_lm.launch path/to/pretrain_gpt.py [megatron args] "
    "[--tensor-sequence-parallel-size D] [--tsp-dry-run]"
)

SLURM_TO_TORCH = (
    ("SLURM_PROCID", "RANK"),
    ("SLURM_NTASKS", "WORLD_SIZE"),
    ("SLURM_LOCALID", "LOCAL_RANK"),
)


def map_slurm_env(environ=os.environ) -> List[str]:
    """Under ``srun`` (one task per GPU) without torchrun, derive torch's rank variables.

    Returns the names set. Nothing is changed when RANK is already set (torchrun) or when not
    under SLURM.
    """
    if "RANK" in environ or "SLURM_PROCID" not in environ:
        return []
    set_names = []
    for slurm, torch_name in SLURM_TO_TORCH:
        if slurm in environ and torch_name not in environ:
            environ[torch_name] = environ[slurm]
            set_names.append(torch_name)
    if "LOCAL_WORLD_SIZE" not in environ and "SLURM_NTASKS_PER_NODE" in environ:
        environ["LOCAL_WORLD_SIZE"] = environ["SLURM_NTASKS_PER_NODE"].split("(")[0]
        set_names.append("LOCAL_WORLD_SIZE")
    if int(environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" not in environ:
        raise SystemExit(
            "megatron_tsp.megatron_lm.launch: running under srun without MASTER_ADDR; "
            "export MASTER_ADDR (e.g. the first host of "
            "`scontrol show hostnames $SLURM_JOB_NODELIST`) and "
            "MASTER_PORT in the batch script"
        )
    environ.setdefault("MASTER_PORT", "6000")
    return set_names


def check_tsp_flags_early(script_args: List[str]) -> None:
    """The TSP flag group parsed alone from the script's arguments (exact spellings only, all
    else ignored) and checked as the parser hook will check it (``TSPArgumentError``)."""
    import argparse

    from megatron_tsp.megatron_lm.arguments import (
        TSPArgumentError,
        add_tsp_arguments,
        check_before_megatron_parse_hooks,
    )

    parser = add_tsp_arguments(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    parser.exit_on_error = False
    try:
        known, _ = parser.parse_known_args(script_args)
    except argparse.ArgumentError as exc:
        raise TSPArgumentError(str(exc)) from None
    check_before_megatron_parse_hooks(known)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") and len(argv) == 1:
        print(USAGE)
        print(__doc__)
        return 0 if argv else 2
    script = argv[0]
    if not script.endswith(".py") or not os.path.isfile(script):
        print(
            f"megatron_tsp.megatron_lm.launch: error: {script!r} is not a Python script\n{USAGE}",
            file=sys.stderr,
        )
        return 2
    script = os.path.abspath(script)
    script_dir = os.path.dirname(script)
    map_slurm_env()
    if script_dir not in sys.path:
        sys.path.insert(0, script_dir)
    preloaded = sys.modules.get("megatron.core")
    if preloaded is not None and not os.path.abspath(preloaded.__file__).startswith(script_dir):
        print(
            "megatron_tsp.megatron_lm.launch: warning: megatron.core was imported from "
            f"{preloaded.__file__} before the checkout {script_dir} was put on sys.path",
            file=sys.stderr,
        )
    sys.argv = [script] + argv[1:]

    from megatron_tsp.megatron_lm.arguments import TSPArgumentError

    # TSP's own flags are checked before the script imports Megatron (its import-time notices
    # would otherwise precede the one-line refusal); Megatron's flags are checked by its parser
    try:
        check_tsp_flags_early(argv[1:])
    except TSPArgumentError as exc:
        print(f"megatron_tsp: error: {exc}", file=sys.stderr)
        return 2
    from megatron_tsp.megatron_lm import install  # imports megatron.core

    install()
    try:
        runpy.run_path(script, run_name="__main__")
    except TSPArgumentError as exc:
        print(f"megatron_tsp: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
