"""``install()``: hook TSP into an unmodified Megatron-LM checkout.

What is wrapped, and why, is the launch patches' table: ``_HOOKS`` below (argument parsing and
validation, ``pretrain`` for ``--tsp-dry-run``, checkpoint args, the model's forward),
``batch._BATCH_HOOKS`` (the zigzag permutation of each micro-batch) and ``spec``'s model hook
(the stage-dependent TSP block spec); each is looked up where the scripts look it up, at install
time, applied and removed through ``patches`` (idempotent). The validation wrapper translates the
TSP flags *before* Megatron's world-size arithmetic, then checks the derived values; under
``--tsp-mlp`` it selects the hybrid block spec only and the batch hook stays a pass-through.

``install()`` must run before the training script imports those names (the launcher does that;
the patches in ``patches/`` put it at the top of ``pretrain_gpt.py``).
"""

from __future__ import annotations

import functools
import importlib
import sys

from megatron_tsp.core import batch_guard
from megatron_tsp.megatron_lm import arguments as tsp_args
from megatron_tsp.megatron_lm import batch as tsp_batch
from megatron_tsp.megatron_lm import checkpoint_args, patches
from megatron_tsp.megatron_lm import spec as tsp_spec

_INSTALLED = False

DRY_RUN_FLAG = "--tsp-dry-run"


def _log(message: str) -> None:
    import os

    if os.environ.get("RANK", "0") == "0":
        print(f"[megatron_tsp] {message}", flush=True)


def _wrap_add_megatron_arguments(original):
    @functools.wraps(original)
    def add_megatron_arguments(parser, *args, **kwargs):
        parser = original(parser, *args, **kwargs)
        parser = tsp_args.add_tsp_arguments(parser)
        _check_right_after_parsing(parser)
        return parser

    return add_megatron_arguments


def _check_right_after_parsing(parser) -> None:
    """Refuse, straight after parsing, what Megatron's ``parse_args`` acts on before
    ``validate_args`` (where the TSP translation and the other checks run): ``--yaml-cfg``
    replaces the whole namespace by the YAML file's, TSP flags included, and never calls
    ``validate_args``. ``parse_args`` goes through ``parse_known_args``, so wrapping that one
    method of this parser covers both."""
    if getattr(parser, "_tsp_checked_after_parsing", False):
        return
    parse_known_args = parser.parse_known_args

    @functools.wraps(parse_known_args)
    def checked(*args, **kwargs):
        namespace, rest = parse_known_args(*args, **kwargs)
        tsp_args.check_before_megatron_parse_hooks(namespace)
        return namespace, rest

    parser.parse_known_args = checked
    parser._tsp_checked_after_parsing = True


def _describe_translation(args) -> str:
    d = tsp_args.tsp_size(args)
    pp = args.pipeline_model_parallel_size
    dp = getattr(args, "data_parallel_size", None)
    cp = getattr(args, "context_parallel_size", 1) or 1
    text = (
        f"{tsp_args.TSP_FLAG} {d} -> tensor_model_parallel_size={args.tensor_model_parallel_size}, "
        f"sequence_parallel={args.sequence_parallel}, spec={' '.join(args.spec)}; "
        f"world={args.world_size} = TSP {d} x PP {pp}{f' x CP {cp}' if cp > 1 else ''} x DP {dp}"
    )
    if getattr(args, "tsp_disabled_dataloader_mask", False):
        text += (
            "; --no-create-attention-mask-in-dataloader (TSP attention does not read the "
            "S x S mask; none is built, broadcast or permuted)"
        )
    replaced = getattr(args, "tsp_replaced_spec", None)
    if replaced:
        text += f"; the user --spec {' '.join(replaced)} is replaced by the TSP block spec"
    return text


def _describe_tsp_mlp_translation(args) -> str:
    text = (
        f"{tsp_args.TSP_MLP_FLAG}: TP+SP attention + TSP MLP ring over the "
        f"tensor_model_parallel_size={args.tensor_model_parallel_size} group, "
        f"sequence_parallel={args.sequence_parallel}, spec={' '.join(args.spec)}; no batch "
        "permutation"
    )
    replaced = getattr(args, "tsp_replaced_spec", None)
    if replaced:
        text += f"; the user --spec {' '.join(replaced)} is replaced by the hybrid block spec"
    return text


def _wrap_validate_args(original):
    @functools.wraps(original)
    def validate_args(args, *rest, **kwargs):
        if not getattr(args, "tsp_dry_run", False):
            return _validate(original, args, rest, kwargs)
        from megatron_tsp.megatron_lm import dry_run

        dry_run.prepare_args(args)
        with dry_run.no_cuda_in_validation():
            return _validate(original, args, rest, kwargs)

    return validate_args


def _validate(original, args, rest, kwargs):
    """Megatron's ``validate_args`` with the TSP translation before and the checks after."""
    d = tsp_args.tsp_size(args)
    # TP+SP attention + TSP MLP keeps Megatron's own layout and batches: only the spec changes.
    hybrid = tsp_args.tsp_mlp_requested(args)
    if d is None and not hybrid:
        tsp_batch.activate(None)
        return original(args, *rest, **kwargs)
    tsp_args.translate_args(args)
    result = original(args, *rest, **kwargs)
    tsp_args.check_validated_args(args)
    tsp_batch.activate(None if hybrid else d, None if hybrid else tsp_batch.document_rule(args))
    tsp_spec.install_gpt_model_hook()
    _log(_describe_tsp_mlp_translation(args) if hybrid else _describe_translation(args))
    return result


def _wrap_pretrain(original):
    @functools.wraps(original)
    def pretrain(*args, **kwargs):
        if DRY_RUN_FLAG in sys.argv[1:]:
            from megatron_tsp.megatron_lm import dry_run

            return dry_run.dry_run_from_pretrain(args, kwargs)
        return original(*args, **kwargs)

    return pretrain


_TRAINING = "megatron.training"


def _launch(target, reason, params=None, versions=patches.MEGATRON_VERSIONS) -> patches.Patch:
    return patches.row(patches.LAUNCH, target, reason, params, versions)


# each launch patch of this module and the wrapper it installs (skipped where this Megatron-LM
# has no such target)
_HOOKS = {
    _launch(
        f"{_TRAINING}.arguments:add_megatron_arguments",
        "adds the tensor-sequence parallel argument group (parse_args calls it by module global)",
        ("parser",),
    ): _wrap_add_megatron_arguments,
    _launch(
        f"{_TRAINING}.arguments:validate_args",
        "translates the TSP flags before Megatron's world-size arithmetic, then checks them",
        ("args", "defaults"),
    ): _wrap_validate_args,
    _launch(
        f"{_TRAINING}.initialize:validate_args",
        "the same, where initialize imports validate_args by name",
        ("args", "defaults"),
        versions=("0.16",),
    ): _wrap_validate_args,
    _launch(
        f"{_TRAINING}.training:pretrain", "--tsp-dry-run replaces the training run"
    ): _wrap_pretrain,
    _launch(
        f"{_TRAINING}:pretrain", "--tsp-dry-run (pretrain_gpt.py imports it from here)"
    ): _wrap_pretrain,
    _launch(
        f"{_TRAINING}.checkpointing:generate_state_dict",
        "checkpoints store the args of a stock TP=D + SP run",
        ("args",),
    ): checkpoint_args.wrap_generate_state_dict,
    _launch(
        f"{tsp_spec.GPT_MODEL}.forward",
        "lets TSP attention refuse tokens that skipped the zigzag hook (core/batch_guard.py)",
        ("self", "input_ids"),
    ): batch_guard.guard_model_forward,
}
patches.declare(_HOOKS)


def install() -> None:
    """Hook TSP into Megatron-LM's argument parsing, validation, batch path and model building.

    Requires ``megatron.training`` (a Megatron-LM checkout on ``sys.path``). Idempotent. Without
    ``--tensor-sequence-parallel-size`` on the command line every hook is a pass-through.
    """
    global _INSTALLED
    try:
        importlib.import_module("megatron.training.arguments")
    except ImportError as exc:
        raise ImportError(
            "megatron_tsp.install() needs megatron.training, which ships with a Megatron-LM "
            "checkout (not with the megatron-core wheel): put the checkout on PYTHONPATH or run "
            "from its root"
        ) from exc
    for patch, make_wrapper in _HOOKS.items():
        patches.apply(patch.mode, patch.target, make=make_wrapper)
    tsp_batch.install_batch_hook()
    tsp_spec.install_gpt_model_hook()
    batch_guard.enforce(tsp_batch.active_size() is not None)
    _INSTALLED = True


def uninstall() -> None:
    """Undo ``install()`` (for tests and for processes that run several scripts)."""
    global _INSTALLED
    tsp_batch.activate(None)
    batch_guard.enforce(False)
    patches.remove_mode(patches.LAUNCH)
    _INSTALLED = False


def is_installed() -> bool:
    return _INSTALLED
