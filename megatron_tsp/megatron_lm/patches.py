"""Every patch megatron_tsp makes to Megatron-LM, megatron-core, torch or Python, in one table.

A *patch* replaces an attribute of a module or class that megatron_tsp does not own (a function
Megatron-LM's scripts look up by name, a CUDA-only torch call answered on CPU, ...). Each one is a
``Patch`` row of ``REGISTRY``: its target, why it exists, which mode applies it, the parameters of
the target it relies on (checked in the supported versions by ``tests/megatron_lm/
test_patches.py``) and the Megatron versions whose source holds it. Code applies a patch only
through ``apply(mode, target, ...)``, which refuses a target the table does not declare, records the
original object and is idempotent; ``remove`` / ``remove_mode`` put the original back (the very
same object). ``--tsp-dry-run`` prints the patches applied in its process (``report_lines``).
Checking every target against the installed packages and the Megatron-LM trees, the
``megatron-tsp check-patches`` CLI and the table ``docs/megatron-lm.md`` shows are
``patch_checks``.

Supported: megatron-core 0.16.x and 0.19.x (``MEGATRON_VERSIONS``), the Megatron-LM trees
core_v0.16.1 and core_v0.19.0, torch 2.13 (``TORCH_VERSIONS``).

Target syntax: ``"module:attr"`` or ``"module:Class.attr"``; ``"sys.modules:name"`` registers a
stand-in module under ``name`` (only when no such module is importable already).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

MEGATRON_VERSIONS = ("0.16", "0.19")  # megatron-core 0.16.x / 0.19.x; trees core_v0.16.1, 0.19.0
TORCH_VERSIONS = ("2.13",)

# Who applies a patch (the ``mode`` of a row).
LAUNCH = "launch"
CPU_SUPPORT = "cpu-support"
CPU_RUNNER = "cpu-runner"
DRY_RUN = "dry-run"
FAKE_RUN = "fake-run"
COUNTER = "counter"
GENERATE = "generate"

MODES = {
    LAUNCH: "megatron_tsp.megatron_lm.hooks.install(): the launcher, the patched pretrain_gpt.py",
    CPU_SUPPORT: "megatron_tsp.megatron_lm.cpu_support.enable_cpu_support(): every CPU run",
    CPU_RUNNER: "megatron_tsp.megatron_lm.cpu_runner.apply_cuda_answers(): pretrain_gpt.py on CPU",
    DRY_RUN: "megatron_tsp.megatron_lm.dry_run: --tsp-dry-run",
    FAKE_RUN: "megatron_tsp.tools.estimator.fake_run: the fake-tensor memory estimator",
    COUNTER: "megatron_tsp.tools.comm_counter.CommCounter: counts communication while active",
    GENERATE: "megatron_tsp.tools.generate: torch_dist checkpoint I/O on CPU",
}

STAND_IN_MODULE = "sys.modules"


@dataclasses.dataclass(frozen=True)
class Patch:
    """One replaced attribute (see the module docstring for ``target``)."""

    mode: str
    target: str
    reason: str
    # Parameters of the target the replacement relies on, in their order (other parameters may
    # sit between or after them); for a stand-in module, the functions it must provide. None:
    # not a function (a class, a C method, a value): existence is checked, not the signature.
    params: Optional[Tuple[str, ...]] = None
    # Megatron versions whose source holds a Megatron target (ignored for torch / Python ones).
    versions: Tuple[str, ...] = MEGATRON_VERSIONS
    # Skipped, not refused, where absent (torch builds without a function, optional modules).
    optional: bool = False

    @property
    def module(self) -> str:
        return self.target.split(":")[0]

    @property
    def attr_path(self) -> Tuple[str, ...]:
        return tuple(self.target.split(":")[1].split("."))

    @property
    def owner_kind(self) -> str:
        """What is patched: megatron-lm, megatron-core, torch or python."""
        name = ".".join(self.attr_path) if self.module == STAND_IN_MODULE else self.module
        if name.startswith(("megatron.training", "megatron.legacy")):
            return "megatron-lm"
        if name.startswith("megatron.core"):
            return "megatron-core"
        if name.startswith("torch"):
            return "torch"
        return "python"


def _p(mode, target, reason, params=None, versions=MEGATRON_VERSIONS, optional=False) -> Patch:
    return Patch(
        mode, target, reason, None if params is None else tuple(params), tuple(versions), optional
    )


_DEVICE = ("device",)
_TRAINING = "megatron.training"
_GPT_MODEL = "megatron.core.models.gpt.gpt_model:GPTModel"
_SCHEDULES = "megatron.core.pipeline_parallel.schedules"

_LAUNCH_PATCHES = [
    _p(
        LAUNCH,
        f"{_TRAINING}.arguments:add_megatron_arguments",
        "adds the tensor-sequence parallel argument group (parse_args calls it by module global)",
        ("parser",),
    ),
    _p(
        LAUNCH,
        f"{_TRAINING}.arguments:validate_args",
        "translates the TSP flags before Megatron's world-size arithmetic, then checks them",
        ("args", "defaults"),
    ),
    _p(
        LAUNCH,
        f"{_TRAINING}.initialize:validate_args",
        "the same, where initialize imports validate_args by name",
        ("args", "defaults"),
        versions=("0.16",),
    ),
    _p(LAUNCH, f"{_TRAINING}.training:pretrain", "--tsp-dry-run replaces the training run"),
    _p(LAUNCH, f"{_TRAINING}:pretrain", "--tsp-dry-run (pretrain_gpt.py imports it from here)"),
    _p(
        LAUNCH,
        f"{_TRAINING}.checkpointing:generate_state_dict",
        "checkpoints store the args of a stock TP=D + SP run",
        ("args",),
    ),
    _p(
        LAUNCH,
        "megatron.core.utils:get_batch_on_this_cp_rank",
        "zigzag permutation of each micro-batch after the TP broadcast (0.19 scripts import it "
        "from here)",
        ("batch",),
    ),
    _p(
        LAUNCH,
        f"{_TRAINING}.utils:get_batch_on_this_cp_rank",
        "zigzag permutation (core_v0.16 scripts import it from here)",
        ("batch",),
        versions=("0.16",),
    ),
    _p(
        LAUNCH,
        f"{_GPT_MODEL}.__init__",
        "resolves the stage-dependent TSP block spec function (core_v0.16 passes --spec as is)",
        ("self", "config", "transformer_layer_spec", "pg_collection", "vp_stage"),
    ),
    _p(
        LAUNCH,
        f"{_GPT_MODEL}.forward",
        "lets TSP attention refuse tokens that skipped the zigzag hook (core/batch_guard.py)",
        ("self", "input_ids"),
    ),
]

_CPU_SUPPORT_PATCHES = [
    _p(CPU_SUPPORT, "torch.cuda:current_device", "megatron-core allocates buffers there", ()),
    _p(CPU_SUPPORT, "torch.cuda:get_rng_state", "the RNG tracker saves 'CUDA' states", _DEVICE),
    _p(CPU_SUPPORT, "torch.cuda:manual_seed", "model_parallel_cuda_manual_seed", ("seed",)),
    _p(
        CPU_SUPPORT,
        "megatron.core.transformer.utils:get_default_causal_mask",
        "local attention builds its causal mask with device='cuda'",
        ("sq",),
    ),
    _p(
        CPU_SUPPORT,
        "megatron.core.fusions.fused_softmax:get_default_causal_mask",
        "the same function, imported by name into the softmax module",
        ("sq",),
    ),
    _p(
        CPU_SUPPORT,
        "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
        "the RNG tracker restores CUDA generator states",
        ("new_state",),
    ),
    _p(
        CPU_SUPPORT,
        "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
        "the RNG tracker reads CUDA generator states",
        (),
        optional=True,
    ),
    _p(
        CPU_SUPPORT,
        "megatron.core.transformer.moe.router:router_gating_linear",
        "the MoE router's gating GEMM reads te_general_gemm, which core 0.16 leaves undefined "
        "without Transformer Engine",
        ("inp", "weight", "bias", "router_dtype"),
    ),
    _p(
        CPU_SUPPORT,
        "megatron.core.models.common.embeddings.rotary_pos_embedding:get_pos_emb_on_this_cp_rank",
        "RoPE under context parallelism indexes its table with a pinned CUDA tensor",
        ("pos_emb", "seq_dim", "cp_group"),
    ),
]

# pretrain_gpt.py on CPU ranks: each CUDA-only call of the loop (the answers themselves are
# cpu_runner.CUDA_ANSWERS).
_MEMORY_REPORT = "memory report (no device memory on CPU: 0)"
_CPU_RUNNER_PATCHES = [
    _p(CPU_RUNNER, "torch.cuda:is_available", "initialize_megatron asserts CUDA first", ()),
    _p(
        CPU_RUNNER,
        "torch.cuda:device_count",
        "with 0 devices Megatron skips initialize_model_parallel and the model-parallel seed",
        (),
    ),
    _p(CPU_RUNNER, "torch.cuda:set_device", "one CPU 'device' per rank", _DEVICE),
    _p(CPU_RUNNER, "torch.cuda:get_device_properties", "architecture checks read .major", _DEVICE),
    _p(CPU_RUNNER, "torch.cuda:get_device_capability", "architecture checks", _DEVICE),
    _p(CPU_RUNNER, "torch.cuda:get_device_name", "printed in start-up reports", _DEVICE),
    _p(
        CPU_RUNNER,
        "torch.accelerator:is_available",
        "the DataLoader pins memory on 'the accelerator' when one is reported; with a CUDA build "
        "of torch and no driver that initialises CUDA and fails",
        (),
        optional=True,
    ),
    _p(CPU_RUNNER, "torch.cuda:Stream", "DDP / optimizer side streams (CPU work is ordered)"),
    _p(CPU_RUNNER, "torch.cuda:Event", "timers and overlap bookkeeping"),
    _p(CPU_RUNNER, "torch.cuda:current_stream", "stream ordering", _DEVICE),
    _p(CPU_RUNNER, "torch.cuda:default_stream", "stream ordering", _DEVICE),
    _p(CPU_RUNNER, "torch.cuda:set_stream", "stream ordering", ("stream",)),
    _p(CPU_RUNNER, "torch.cuda:stream", "`with torch.cuda.stream(s):` blocks", ("stream",)),
    _p(CPU_RUNNER, "torch.cuda:synchronize", "timers, barriers", _DEVICE),
    _p(CPU_RUNNER, "torch.cuda:empty_cache", "memory housekeeping", ()),
    _p(CPU_RUNNER, "torch.cuda:memory_allocated", _MEMORY_REPORT, _DEVICE),
    _p(CPU_RUNNER, "torch.cuda:max_memory_allocated", _MEMORY_REPORT, _DEVICE),
    _p(CPU_RUNNER, "torch.cuda:memory_reserved", _MEMORY_REPORT, _DEVICE),
    _p(CPU_RUNNER, "torch.cuda:max_memory_reserved", _MEMORY_REPORT, _DEVICE),
    _p(CPU_RUNNER, "torch.cuda:reset_peak_memory_stats", _MEMORY_REPORT, _DEVICE),
    _p(CPU_RUNNER, "torch.cuda:memory_stats", _MEMORY_REPORT, _DEVICE),
    _p(CPU_RUNNER, "torch.cuda:device_memory_used", _MEMORY_REPORT, _DEVICE, optional=True),
    _p(CPU_RUNNER, "torch.cuda:mem_get_info", _MEMORY_REPORT, _DEVICE),
    _p(
        CPU_RUNNER,
        "torch.cuda:set_rng_state",
        "checkpoints save and restore the 'CUDA' RNG state",
        ("new_state",),
    ),
    _p(CPU_RUNNER, "torch.cuda.nvtx:range_push", "profiling ranges", ("msg",), optional=True),
    _p(CPU_RUNNER, "torch.cuda.nvtx:range_pop", "profiling ranges", (), optional=True),
    _p(
        CPU_RUNNER,
        "megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",
        "the alltoall MoE dispatcher copies its split sizes to the host, where a CUDA tensor "
        "becomes a numpy array; a CPU tensor is returned as it is, which all_to_all_single "
        "refuses as split sizes",
        ("tensor", "as_numpy", "record_stream"),
    ),
    _p(
        CPU_RUNNER,
        "megatron.core.datasets.utils:compile_helpers",
        "rank 0 runs `make` for the dataset index helpers; the compiled .so must be there",
        (),
    ),
    _p(
        CPU_RUNNER,
        "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.is_kernel_available",
        "the fused softmax CUDA kernels are imported when fp16/bf16 shapes qualify; without them "
        "Megatron's own torch softmax runs",
        ("self",),
    ),
    _p(
        CPU_RUNNER,
        "megatron.legacy.fused_kernels:load",
        "compiles CUDA softmax kernels; Megatron falls back to torch softmax without them",
        ("args",),
        versions=("0.16",),
        optional=True,
    ),
    _p(
        CPU_RUNNER,
        "multiprocessing.spawn:get_preparation_data",
        "the checkpoint writer's 'spawn' Manager child would re-run pretrain_gpt.py without these "
        "answers; children import the runner module instead",
        ("name",),
    ),
    _p(
        CPU_RUNNER,
        f"{_TRAINING}.initialize:_warmup_jit_function",
        "its torch.rand draws depend on TP/SP and would shift --use-cpu-initialization weights",
    ),
    _p(
        CPU_RUNNER,
        f"{_SCHEDULES}:deallocate_output_tensor",
        "the interleaved schedule pseudo-frees a stage output while its overlapped isend may still "
        "be running; gloo (unlike NCCL) does not keep the storage alive, so the allocator could "
        "reuse it mid-send: the storage is held until the next step's schedule starts",
        ("out", "deallocate_pipeline_outputs"),
    ),
    _p(
        CPU_RUNNER,
        f"{_SCHEDULES}:forward_backward_pipelining_with_interleaving",
        "marks the steps whose pseudo-freed outputs are held (see deallocate_output_tensor)",
        (),
    ),
    _p(
        CPU_RUNNER,
        f"{_TRAINING}.training:training_log",
        "records the full-precision loss and grad norm per iteration (TSP_CPU_RUNNER_RECORD)",
        ("loss_dict", "iteration", "skipped_iter", "grad_norm"),
    ),
    _p(
        CPU_RUNNER,
        f"{STAND_IN_MODULE}:fused_weight_gradient_mlp_cuda",
        "apex's gradient-accumulation-fusion kernels (imported by tensor_parallel.layers): a torch "
        "stand-in accumulating in fp32",
        ("wgrad_gemm_accum_fp32", "wgrad_gemm_accum_fp16"),
    ),
    _p(
        CPU_RUNNER,
        f"{STAND_IN_MODULE}:megatron.core.transformer.custom_layers.batch_invariant_kernels",
        "training.initialize imports these Triton kernels at import time; without triton a "
        "stand-in refuses --batch-invariant-mode",
        (
            "enable_batch_invariant_mode",
            "set_batch_invariant_mode",
            "disable_batch_invariant_mode",
            "is_batch_invariant_mode_enabled",
        ),
        optional=True,
    ),
]

_DRY_RUN_PATCHES = [
    _p(
        DRY_RUN,
        f"{_TRAINING}.arguments:get_device_arch_version",
        "validate_args asks the GPU architecture; the dry run reports TSP_DRY_RUN_ARCH (during "
        "validation only)",
        (),
    ),
    _p(DRY_RUN, "torch.cuda:current_device", "the model is built on the meta device", ()),
    _p(
        DRY_RUN,
        "torch:Tensor.cuda",
        "tied embeddings across stages call weight.data.cuda(); a meta tensor stays put",
    ),
]

_FAKE_RUN_PATCHES = [
    _p(
        FAKE_RUN,
        "megatron.core.models.common.embeddings.rotary_pos_embedding:get_pos_emb_on_this_cp_rank",
        "builds its index on CUDA; the CPU version selects the same two chunks",
        ("pos_emb", "seq_dim", "cp_group"),
    ),
    _p(
        FAKE_RUN,
        "megatron.core.distributed.param_and_grad_buffer:_coalescing_manager",
        "FakeTensorMode cannot dispatch torch's coalescing manager; the bucket collectives run "
        "one by one (same buffers, same bytes)",
        ("group",),
    ),
    _p(
        FAKE_RUN,
        "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork",
        "fork compares RNG states with .item(), which a fake tensor cannot answer (dropout is 0; "
        "patched on the tracker instance)",
        ("self", "name"),
    ),
    _p(
        FAKE_RUN,
        "megatron.core.transformer.moe.token_dispatcher:MoEAllGatherTokenDispatcher."
        "dispatch_postprocess",
        "counts the local experts' token copies and permutes by the routing map's values; "
        "shape-only tensors take the uniform-routing counts (tools/estimator/uniform_routing.py)",
        ("self", "hidden_states", "probs"),
    ),
    _p(
        FAKE_RUN,
        "megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher.preprocess",
        "all-to-all split sizes from the routing map's values; shape-only tensors take the "
        "uniform-routing splits as host tensors",
        ("self", "routing_map"),
    ),
    _p(
        FAKE_RUN,
        "megatron.core.transformer.moe.token_dispatcher:permute",
        "masked_select by the routing map has a value-dependent size; shape-only tensors select "
        "the known T*k rows",
        ("tokens", "routing_map", "probs", "num_out_tokens"),
    ),
]

# CommCounter: the torch.distributed entry points (op -> the parameter holding the payload) and
# the names megatron-core binds at import time.
COUNTED_OPS = {
    "all_reduce": "tensor",
    "all_gather": "tensor_list",
    "all_gather_into_tensor": "output_tensor",
    "_all_gather_base": "output_tensor",
    "all_gather_single": "output_tensor",
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",
    "_reduce_scatter_base": "input",
    "reduce_scatter_single": "input",
    "all_to_all": "input_tensor_list",
    "all_to_all_single": "input",
    "broadcast": "tensor",
    "reduce": "tensor",
    "send": "tensor",
    "isend": "tensor",
    "recv": "tensor",
    "irecv": "tensor",
}
_NEW_IN_TORCH_2_13 = ("all_gather_single", "reduce_scatter_single")
_P2P_OP_CHECKS = ("isend", "irecv", "send", "recv")
MEGATRON_BOUND_COLLECTIVES = {
    "dist_all_gather_func": ("output_tensor", "input_tensor", "group"),
    "dist_reduce_scatter_func": ("output", "input", "op", "group"),
}
_COUNTER_PATCHES = (
    [
        _p(
            COUNTER,
            f"torch.distributed:{op}",
            "counted (payload and group read by name)",
            (payload, "group"),
            optional=op in _NEW_IN_TORCH_2_13,
        )
        for op, payload in COUNTED_OPS.items()
    ]
    + [
        _p(
            COUNTER,
            f"torch.distributed.distributed_c10d:{op}",
            "P2POp validates its op against these globals: counted under both names",
            ("tensor", "group"),
        )
        for op in _P2P_OP_CHECKS
    ]
    + [
        _p(
            COUNTER,
            "torch.distributed.distributed_c10d:" + op,
            "the same global identity for the collectives",
            (payload, "group"),
        )
        for op, payload in COUNTED_OPS.items()
        if op not in _P2P_OP_CHECKS and op not in _NEW_IN_TORCH_2_13
    ]
    + [
        _p(
            COUNTER,
            "torch.distributed:batch_isend_irecv",
            "counts each P2POp of the batch",
            ("p2p_op_list",),
        )
    ]
    + [
        _p(
            COUNTER,
            f"megatron.core.tensor_parallel.{module}:{name}",
            "megatron-core binds this collective by name at import",
            params,
        )
        for module in ("mappings", "layers")
        for name, params in MEGATRON_BOUND_COLLECTIVES.items()
    ]
)

_GENERATE_PATCHES = [
    _p(
        GENERATE,
        "torch.cuda:synchronize",
        "torch_dist's reader and writer synchronize the CUDA stream; nothing to wait for on CPU",
        _DEVICE,
    ),
]

REGISTRY: Tuple[Patch, ...] = tuple(
    _LAUNCH_PATCHES
    + _CPU_SUPPORT_PATCHES
    + _CPU_RUNNER_PATCHES
    + _DRY_RUN_PATCHES
    + _FAKE_RUN_PATCHES
    + _COUNTER_PATCHES
    + _GENERATE_PATCHES
)


class UndeclaredPatchError(LookupError):
    """A patch was applied that ``REGISTRY`` does not declare."""


class PatchTargetMissing(AttributeError):
    """A declared target is absent where the registry says it exists."""


def find(mode: str, target: str) -> Patch:
    for patch in REGISTRY:
        if patch.mode == mode and patch.target == target:
            return patch
    raise UndeclaredPatchError(
        f"{mode} patches {target}, which megatron_tsp/megatron_lm/patches.py does not declare: "
        "add a row (target, reason, parameters, versions) to REGISTRY"
    )


def of_mode(mode: str) -> List[Patch]:
    return [p for p in REGISTRY if p.mode == mode]


def megatron_version() -> Optional[str]:
    """``"0.16"`` / ``"0.19"``: the imported megatron-core's major.minor (None without it)."""
    try:
        info = importlib.import_module("megatron.core.package_info")
    except ImportError:
        return None
    return f"{info.MAJOR}.{info.MINOR}"


# ------------------------------------------------------------------------------------------------
# applying and removing


@dataclasses.dataclass
class _Applied:
    patch: Patch
    owner: object
    attr: str
    original: object
    owned: bool  # the attribute sat in the owner's own __dict__ (else: inherited, deleted again)
    replacement: object


_ACTIVE: Dict[Tuple[str, str], _Applied] = {}
_HISTORY: List[Patch] = []  # applied in this process, in order (the dry run prints them)
_MISSING = object()


def resolve(target: str):
    """``(owner, attr)`` for ``"module:attr"`` / ``"module:Class.attr"`` (ImportError or
    AttributeError when absent)."""
    module_name, path = target.split(":")
    owner = importlib.import_module(module_name)
    *parents, attr = path.split(".")
    for name in parents:
        owner = getattr(owner, name)
    return owner, attr


def _expected_here(patch: Patch) -> bool:
    """Does the registry say this target exists in the running versions?"""
    if patch.optional:
        return False
    if patch.owner_kind == "megatron-lm" and not _megatron_lm_importable():
        return False  # megatron-core alone (no Megatron-LM checkout): nothing to patch there
    if patch.owner_kind in ("megatron-lm", "megatron-core"):
        version = megatron_version()
        return version is None or version in patch.versions
    return True


def _megatron_lm_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def apply(
    mode: str, target: str, replacement=_MISSING, *, make: Optional[Callable] = None, owner=None
):
    """Replace the declared ``target`` by ``replacement`` (or ``make(original)``); returns the
    original. ``owner``: patch this object instead of the target's (an instance of the target's
    class). Applying an applied patch again changes nothing. A target absent where the registry
    allows it (optional, or another Megatron version) is skipped: returns None."""
    patch = find(mode, target)
    key = (mode, target)
    if key in _ACTIVE:
        return _ACTIVE[key].original
    if patch.module == STAND_IN_MODULE:
        return _apply_stand_in(patch, replacement, make)
    try:
        resolved_owner, attr = resolve(target)
        owner = resolved_owner if owner is None else owner
        original = getattr(owner, attr)
    except (ImportError, AttributeError) as exc:
        if not _expected_here(patch):
            return None
        raise PatchTargetMissing(f"{target} is missing ({mode}: {patch.reason})") from exc
    if _is_our_replacement(original, patch):
        return None
    value = make(original) if make is not None else replacement
    owned = attr in vars(owner)
    setattr(owner, attr, value)
    _mark(value, key)
    _ACTIVE[key] = _Applied(patch, owner, attr, original, owned, value)
    _HISTORY.append(patch)
    return original


def _mark(value, key) -> None:
    try:
        value.__tsp_patch__ = key
    except (AttributeError, TypeError):  # a value that takes no attributes (never needed)
        pass


def _is_our_replacement(value, patch: Patch) -> bool:
    """``value`` is what an active patch of the same mode installed for an attribute of the same
    name (a module imported it by name after we patched the module it comes from)."""
    key = getattr(value, "__tsp_patch__", None)
    if not isinstance(key, tuple) or key not in _ACTIVE:
        return False
    return key[0] == patch.mode and _attr_name(key[1]) == _attr_name(patch.target)


def unpatched(value):
    """The object under our active patches (each one's original is the one applied before)."""
    while getattr(value, "__tsp_patch__", None) in _ACTIVE:
        value = _ACTIVE[value.__tsp_patch__].original
    return value


def _attr_name(target: str) -> str:
    return target.split(":")[1].split(".")[-1]


def _apply_stand_in(patch: Patch, replacement, make):
    """Register a stand-in module under its name unless a module of that name is imported."""
    name = ".".join(patch.attr_path)
    if name in sys.modules:
        return None
    module = make(None) if make is not None else replacement
    sys.modules[name] = module
    _ACTIVE[(patch.mode, patch.target)] = _Applied(
        patch, sys.modules, name, _MISSING, False, module
    )
    _HISTORY.append(patch)
    return None


def remove(mode: str, target: str) -> None:
    """Put the original back (no-op when not applied)."""
    applied = _ACTIVE.pop((mode, target), None)
    if applied is None:
        return
    if applied.owner is sys.modules:
        if sys.modules.get(applied.attr) is applied.replacement:
            del sys.modules[applied.attr]
        return
    if applied.owned:
        setattr(applied.owner, applied.attr, applied.original)
    elif applied.attr in vars(applied.owner):
        delattr(applied.owner, applied.attr)


def remove_mode(mode: str) -> None:
    """Remove every active patch of ``mode``, the latest first."""
    for key in reversed([k for k in _ACTIVE if k[0] == mode]):
        remove(*key)


@contextlib.contextmanager
def applied(mode: str, target: str, replacement=_MISSING, *, make=None, owner=None) -> Iterator:
    """``apply`` for the ``with`` block (removed on exit only if this block applied it)."""
    was_active = (mode, target) in _ACTIVE
    original = apply(mode, target, replacement, make=make, owner=owner)
    try:
        yield original
    finally:
        if not was_active:
            remove(mode, target)


def is_active(mode: str, target: str) -> bool:
    return (mode, target) in _ACTIVE


def original(mode: str, target: str):
    return _ACTIVE[(mode, target)].original


def active() -> List[Patch]:
    return [a.patch for a in _ACTIVE.values()]


def applied_in_this_process() -> List[Patch]:
    seen, out = set(), []
    for patch in _HISTORY:
        if (patch.mode, patch.target) not in seen:
            seen.add((patch.mode, patch.target))
            out.append(patch)
    return out


# ------------------------------------------------------------------------------------------------
# printing


def report_lines(patches: Optional[Sequence[Patch]] = None) -> List[str]:
    """One line per patch: state, mode, target and reason (``--tsp-dry-run`` prints these)."""
    patches = applied_in_this_process() if patches is None else patches
    lines = []
    for p in patches:
        state = "active " if is_active(p.mode, p.target) else "removed"
        lines.append(f"{state} {p.mode:<11} {p.target}: {p.reason}")
    return lines
