"""Every patch megatron_tsp makes to Megatron-LM, megatron-core, torch or Python, in one table.

A *patch* replaces an attribute of a module or class that megatron_tsp does not own (a function
Megatron-LM's scripts look up by name, a CUDA-only torch call answered on CPU, ...). Each one is a
``Patch`` row of ``REGISTRY``: its target, why it exists, which mode applies it, the parameters of
the target it relies on (checked in the supported versions by ``tests/megatron_lm/
test_patches.py``) and the Megatron versions whose source holds it. Code applies a patch only
through ``apply(mode, target, ...)``, which refuses a target the table does not declare, records the
original object and is idempotent; ``remove`` / ``remove_mode`` put the original back (the very
same object). ``--tsp-dry-run`` prints the patches applied in its process (``report_lines``) and
checks every target (``check_everywhere``; also ``megatron-tsp check-patches``), and
``docs/megatron-lm.md`` shows the table (``markdown_table``; a test keeps the page current).

Supported: megatron-core 0.16.x and 0.19.x (``MEGATRON_VERSIONS``), the Megatron-LM trees
core_v0.16.1 and core_v0.19.0, torch 2.13 (``TORCH_VERSIONS``).

Target syntax: ``"module:attr"`` or ``"module:Class.attr"``; ``"sys.modules:name"`` registers a
stand-in module under ``name`` (only when no such module is importable already).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
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


def _unpatched(value):
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
# checking the declared targets against the installed packages


def parameter_names(fn) -> Optional[Tuple[str, ...]]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def signature_problem(patch: Patch, names: Optional[Sequence[str]]) -> Optional[str]:
    """Why ``names`` (the target's parameters) do not hold ``patch.params`` in order, or None."""
    if patch.params is None:
        return None
    if names is None:
        return f"{patch.target}: no signature to check {patch.params} against"
    remaining = iter(names)
    if all(any(n == want for n in remaining) for want in patch.params):
        return None
    return (
        f"{patch.target} ({patch.mode}): expected parameters {list(patch.params)} in this "
        f"order, found {list(names)}"
    )


def check_installed(patches: Sequence[Patch] = REGISTRY) -> List[str]:
    """Problems of ``patches`` against what is importable here (megatron-core, torch; the
    Megatron-LM targets are checked against the trees' source by the tests). Empty: all fine."""
    version = megatron_version()
    problems = []
    for patch in patches:
        if patch.owner_kind == "megatron-lm" or patch.module == STAND_IN_MODULE:
            continue
        present_expected = patch.owner_kind != "megatron-core" or version in patch.versions
        try:
            owner, attr = resolve(patch.target)
            target = _unpatched(getattr(owner, attr))
        except (ImportError, AttributeError):
            if present_expected and not patch.optional:
                problems.append(
                    f"{patch.target} ({patch.mode}): missing in the installed "
                    f"{patch.owner_kind} (megatron-core {version})"
                )
            continue
        if not present_expected:
            problems.append(
                f"{patch.target} ({patch.mode}): exists in megatron-core {version}, "
                f"registry says only {patch.versions}"
            )
        if patch.params is not None:
            problem = signature_problem(patch, parameter_names(target))
            if problem:
                problems.append(problem)
    return problems


# ------------------------------------------------------------------------------------------------
# checking the declared targets against a Megatron-LM tree's source (no import: ``ast``)


def _module_file(tree: str, module: str) -> Optional[str]:
    import os

    base = os.path.join(tree, *module.split("."))
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _bindings(statements, found: dict) -> dict:
    """Top-level names of a module (inside ``if`` / ``try`` / ``with`` blocks too): first
    binding wins, a ``def`` or ``class`` over an assignment."""
    import ast

    for node in statements:
        names = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [(node.name, node)]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [((a.asname or a.name).split(".")[0], (node, a)) for a in node.names]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [(t.id, node) for t in targets if isinstance(t, ast.Name)]
        for name, value in names:
            is_def = isinstance(value, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            if name not in found or (
                is_def
                and not isinstance(
                    found[name], (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
                )
            ):
                found[name] = value
        for block in ("body", "orelse", "finalbody"):
            if isinstance(node, (ast.If, ast.Try, ast.With)) and getattr(node, block, None):
                _bindings(getattr(node, block), found)
        for handler in getattr(node, "handlers", []) if isinstance(node, ast.Try) else []:
            _bindings(handler.body, found)
    return found


def _source_definition(tree: str, module: str, path: Sequence[str], depth: int = 0):
    """``("def", FunctionDef)``, ``("class", ClassDef)``, ``("value", None)`` or
    ``("external", module)`` for ``module:path`` in the tree's source; None when absent."""
    import ast

    filename = _module_file(tree, module)
    if filename is None or depth > 8:
        return None
    with open(filename) as f:
        bound = _bindings(ast.parse(f.read()).body, {}).get(path[0])
    if isinstance(bound, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return ("def", bound) if len(path) == 1 else None
    if isinstance(bound, ast.ClassDef):
        if len(path) == 1:
            return ("class", bound)
        members = _bindings(bound.body, {})
        member = members.get(path[1])
        if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return ("def", member)
        return None if member is None else ("value", None)
    if isinstance(bound, tuple):  # an import
        node, alias = bound
        if isinstance(node, ast.Import):
            return ("external", alias.name)
        source = node.module or ""
        if node.level:
            package = module if filename.endswith("__init__.py") else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            source = f"{package}.{source}" if source else package
        if _module_file(tree, source) is None:
            submodule = f"{source}.{alias.name}"
            if _module_file(tree, submodule) is not None:
                return ("value", None)  # a module
            return ("external", source)
        return _source_definition(tree, source, (alias.name, *path[1:]), depth + 1)
    return None if bound is None else ("value", None)


def _def_parameters(node) -> Tuple[str, ...]:
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args]
    names += [a.vararg.arg] if a.vararg else []
    names += [x.arg for x in a.kwonlyargs]
    names += [a.kwarg.arg] if a.kwarg else []
    return tuple(names)


def tree_version(tree: str) -> Optional[str]:
    """``"0.16"`` / ``"0.19"`` from a Megatron-LM tree's ``megatron/core/package_info.py``."""
    import os
    import re

    try:
        with open(os.path.join(tree, "megatron", "core", "package_info.py")) as f:
            text = f.read()
    except OSError:
        return None
    major = re.search(r"^MAJOR\s*=\s*(\d+)", text, re.M)
    minor = re.search(r"^MINOR\s*=\s*(\d+)", text, re.M)
    return f"{major.group(1)}.{minor.group(1)}" if major and minor else None


def check_tree(tree: str, patches: Sequence[Patch] = REGISTRY) -> List[str]:
    """Problems of the Megatron targets of ``patches`` against a Megatron-LM tree's source
    (``megatron/training``, ``megatron/core``): each exists exactly in the versions its row lists,
    with the parameters it relies on. Empty: all fine."""
    version = tree_version(tree)
    if version is None:
        return [f"{tree}: no megatron/core/package_info.py (not a Megatron-LM tree)"]
    problems = []
    for patch in patches:
        if patch.owner_kind not in ("megatron-lm", "megatron-core"):
            continue
        label = f"{patch.target} ({patch.mode}, core_v{version} tree)"
        if patch.module == STAND_IN_MODULE:
            name = ".".join(patch.attr_path)
            found = ("module", None) if _module_file(tree, name) else None
        else:
            found = _source_definition(tree, patch.module, patch.attr_path)
        expected = version in patch.versions
        if found is None:
            if expected and not patch.optional:
                problems.append(f"{label}: missing")
            continue
        if not expected:
            problems.append(f"{label}: present, the registry says only {patch.versions}")
            continue
        kind, node = found
        if patch.params is None:
            continue
        if kind == "module":
            missing = [n for n in patch.params if _source_definition(tree, name, (n,)) is None]
            if missing:
                problems.append(f"{label}: the module lacks {missing}")
        elif kind == "def":
            problem = signature_problem(patch, _def_parameters(node))
            if problem:
                problems.append(f"{problem} (core_v{version} tree)")
        elif kind == "class":
            problems.append(f"{label}: a class; expected a function with {patch.params}")
        # "value" / "external": bound to an object defined elsewhere (torch): checked installed
    return problems


def imported_megatron_lm_tree() -> Optional[str]:
    """The Megatron-LM checkout whose ``megatron.training`` this process imports (None: none)."""
    import os

    package = _imported_from("megatron.training")  # <tree>/megatron/training
    tree = os.path.dirname(os.path.dirname(package)) if package else None
    return tree if tree and tree_version(tree) else None


def _imported_from(module: str) -> Optional[str]:
    """The folder ``module`` is imported from (None: not importable); imports only its parents."""
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec(module)
    except ImportError:
        return None
    if spec is None or not spec.origin:
        return None
    return os.path.dirname(os.path.abspath(spec.origin))


def check_everywhere(trees: Sequence[str] = ()) -> Tuple[List[str], List[str]]:
    """``(checked, problems)``: every declared target against the installed megatron-core and
    torch and against the source of each Megatron-LM tree in ``trees``; ``checked`` names where."""
    import importlib.metadata

    core_folder = _imported_from("megatron.core") or "not importable"
    checked = [
        f"megatron-core {megatron_version()} ({core_folder}) and torch "
        f"{importlib.metadata.version('torch')} (as imported here)"
    ]
    problems = check_installed()
    for tree in trees:
        checked.append(f"Megatron-LM tree {tree} (core_v{tree_version(tree)})")
        problems += check_tree(tree)
    return checked, problems


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``megatron-tsp check-patches``: does every patch target exist, with the parameters it
    relies on, in this installation (and the given Megatron-LM checkouts)? Exit 1 if not."""
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="megatron-tsp check-patches", description=main.__doc__)
    parser.add_argument(
        "--megatron-lm",
        action="append",
        default=[],
        metavar="TREE",
        help="a Megatron-LM checkout to check by source (repeatable; default: the checkout whose "
        "megatron.training this interpreter imports, if any)",
    )
    args = parser.parse_args(argv)
    trees = [os.path.abspath(t) for t in args.megatron_lm]
    if not trees and imported_megatron_lm_tree():
        trees = [imported_megatron_lm_tree()]
    checked, problems = check_everywhere(trees)
    print(f"{len(REGISTRY)} declared patch targets, checked in:")
    print("\n".join(f"  {where}" for where in checked))
    if not trees:
        print("  (no Megatron-LM tree: pass --megatron-lm PATH to check its targets too)")
    if problems:
        print(f"{len(problems)} problem(s):")
        print("\n".join(f"  {problem}" for problem in problems))
        return 1
    print("all present, with the parameters they rely on")
    return 0


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


DOC_BEGIN = "<!-- patches table: generated by megatron_tsp.megatron_lm.patches.markdown_table() -->"
DOC_END = "<!-- end of patches table -->"


def _versions_text(p: Patch) -> str:
    if p.owner_kind in ("torch", "python"):
        return "torch " + ", ".join(TORCH_VERSIONS) if p.owner_kind == "torch" else "-"
    text = ", ".join(p.versions)
    return text + (" (optional)" if p.optional else "")


def markdown_table() -> str:
    """The registry as a Markdown table (what ``docs/megatron-lm.md`` shows)."""
    lines = ["| applied by | target | relies on | versions | why |", "|---|---|---|---|---|"]
    for p in REGISTRY:
        params = "-" if p.params is None else "(" + ", ".join(p.params) + ")"
        reason = p.reason.replace("|", "\\|")
        lines.append(f"| {p.mode} | `{p.target}` | {params} | {_versions_text(p)} | {reason} |")
    return "\n".join(lines)


def doc_block() -> str:
    return f"{DOC_BEGIN}\n{markdown_table()}\n{DOC_END}"
