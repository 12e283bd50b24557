"""Shared helpers for the Megatron-LM integration tests."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from typing import List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Megatron-LM's defaults (core_v0.16.1 and core_v0.19.0 agree) for the arguments the TSP hooks
# read besides the rejection table's flags; the CI tests of the argument code run without a
# Megatron-LM checkout, so they build the namespace from these.
MEGATRON_DEFAULTS = dict(
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    context_parallel_size=1,
    expert_model_parallel_size=1,
    sequence_parallel=False,
    transformer_impl="transformer_engine",
    spec=None,
    group_query_attention=False,
    num_query_groups=1,
    num_attention_heads=None,
    hidden_size=None,
    ffn_hidden_size=None,
    seq_length=None,
    padded_vocab_size=None,
    world_size=1,
    softmax_type="vanilla",
    cuda_graph_impl="none",
    position_embedding_type="learned_absolute",
    # packed documents: accepted under TSP (the batch hook reads them), except with PP > 1
    reset_attention_mask=False,
    reset_position_ids=False,
)


class _Backend:
    """Stands in for Megatron's ``AttnBackend`` enum members (only ``.name`` is read)."""

    def __init__(self, name):
        self.name = name


def megatron_parser() -> argparse.ArgumentParser:
    """A real argparse parser holding the TSP group, the flags of the rejection table (their real
    Megatron-LM names and dests: tests/megatron_lm/test_rejection_flags.py checks them against
    the Megatron-LM trees) and the other Megatron flags the hooks read."""
    from megatron_tsp.core import rejections
    from megatron_tsp.megatron_lm.arguments import add_tsp_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    for dest, default in MEGATRON_DEFAULTS.items():
        flag = "--" + dest.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true")
        elif dest == "spec":
            parser.add_argument(flag, nargs="*", default=None)
        elif isinstance(default, str):
            parser.add_argument(flag, default=default)
        else:
            parser.add_argument(flag, type=int, default=default)
    seen = {a.dest for a in parser._actions}
    for row in rejections.TABLE:
        # the TSP group's own flags come from add_tsp_arguments; a labelled row reads a value
        # Megatron derives (the padded vocabulary), not a flag of its own
        if row.dest in seen or row.flag == rejections.TSP_FLAG or row.label:
            continue
        seen.add(row.dest)
        if row.dest == "attention_backend":
            parser.add_argument(row.flag, dest=row.dest, type=_Backend, default=_Backend("auto"))
        elif not row.example:
            parser.add_argument(row.flag, dest=row.dest, action="store_true")
        elif len(row.example) > 1:
            parser.add_argument(row.flag, dest=row.dest, nargs="+", type=int, default=None)
        elif row.example[0].isdigit():
            parser.add_argument(row.flag, dest=row.dest, type=int, default=None)
        else:
            parser.add_argument(row.flag, dest=row.dest, default=None)
    parser.add_argument(
        "--no-create-attention-mask-in-dataloader",
        action="store_false",
        dest="create_attention_mask_in_dataloader",
    )
    return add_tsp_arguments(parser)


def megatron_lm_path() -> Optional[str]:
    """The Megatron-LM tree in ``MEGATRON_LM_PATH``, or None (the tests that need it skip).

    In CI (``CI=true``, where ``.ci/run`` unpacks the trees) a missing tree is an error, never a
    skip."""
    path = os.environ.get("MEGATRON_LM_PATH")
    if path and os.path.isfile(os.path.join(path, "pretrain_gpt.py")):
        return path
    if os.environ.get("CI") == "true":
        raise RuntimeError(
            f"CI=true but MEGATRON_LM_PATH={path!r} holds no pretrain_gpt.py: "
            "run scripts/megatron_lm_sources.sh (as .ci/run does)"
        )
    return None


def megatron_lm_tree(version: str) -> Optional[str]:
    """The Megatron-LM tree of ``version`` ("0.16" / "0.19") among ``MEGATRON_LM_PATH`` and
    ``MEGATRON_LM_PATH_0_19`` (read as source only: any interpreter), or None (the test skips).
    In CI (``CI=true``) a missing tree is an error, never a skip."""
    from megatron_tsp.megatron_lm.patch_checks import tree_version

    paths = [os.environ.get(name) for name in ("MEGATRON_LM_PATH", "MEGATRON_LM_PATH_0_19")]
    for path in paths:
        if (
            path
            and os.path.isfile(os.path.join(path, "pretrain_gpt.py"))
            and tree_version(path) == version
        ):
            return path
    if os.environ.get("CI") == "true":
        raise RuntimeError(
            f"CI=true but neither MEGATRON_LM_PATH nor MEGATRON_LM_PATH_0_19 "
            f"({paths}) is a core_v{version} tree: run "
            "scripts/megatron_lm_sources.sh (as .ci/run does)"
        )
    return None


def relative_difference(actual: float, reference: float) -> float:
    """|a - r| / |r|; infinite when either side is NaN or Inf, so ``max`` over iterations can
    never skip a diverged run (Python's ``max`` ignores a NaN that is not first)."""
    if not (math.isfinite(actual) and math.isfinite(reference)):
        return math.inf
    return abs(actual - reference) / max(abs(reference), 1e-12)


def run_launcher(args: List[str], timeout: float = 300, env_extra: Optional[dict] = None):
    """``python -m megatron_tsp.megatron_lm.launch <args>`` in a subprocess (CPU, no CUDA)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "megatron_tsp.megatron_lm.launch", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
