"""Run Megatron-LM's own training script (``pretrain_gpt.py``) on CPU ranks over gloo.

A test tool, also useful to users who want to see a TSP run next to a stock one on a laptop::

    python -m megatron_tsp.megatron_lm.cpu_runner --nproc 2 [--summary] [--stock] -- \\
        path/to/pretrain_gpt.py <megatron args> [--tensor-sequence-parallel-size 2]

(``megatron-tsp cpu-run ...`` is the same command.) It starts ``--nproc`` local processes with
torchrun's environment variables and ``--distributed-backend gloo`` appended; each runs the script
through ``megatron_tsp.megatron_lm.launch`` (``--stock``: plain ``runpy``, no TSP hooks) after
``apply_cuda_answers()``. Nothing else is changed: the script, Megatron's arguments, its data
path, model builder, optimizer, DDP, schedules and logging are the checkout's own (the interleaved
schedule only has its pseudo-freed outputs held longer, see below).

Every CUDA-only call the loop makes is answered in one place, ``CUDA_ANSWERS`` (below), each
entry saying why it is needed. Four answers are not plain replacements:

* ``device='cuda'`` tensors, ``Tensor.cuda()`` and ``.to('cuda')`` are redirected to the CPU by a
  ``TorchFunctionMode`` (``CudaToCpuMode``) kept active for the whole run;
* Megatron's jit warm-up draws random tensors whose shapes depend on TP and SP. On CPU they come
  from the generator that ``--use-cpu-initialization`` then uses for the weights, so the warm-up
  runs under ``torch.random.fork_rng`` (otherwise TP=2 and TSP=2 would start from different
  weights: the warm-up's draws are not part of training);
* apex's ``fused_weight_gradient_mlp_cuda`` (gradient-accumulation fusion, on by default in
  Megatron) is replaced by a torch module with the same two functions: ``main_grad +=
  grad_output^T @ input`` computed in fp32 from the (bf16/fp16/fp32) operands, as the CUDA kernel
  accumulates in fp32;
* interleaved pipeline stages: the schedule pseudo-frees a stage output while its overlapped send
  may still run; NCCL keeps a sent storage alive until the transfer is done, gloo does not, so
  the runner holds those storages until the next step (see ``_HELD_STAGE_OUTPUTS``).

Nothing here is applied on import: only the worker processes call ``apply_cuda_answers()``.
``TORCHDYNAMO_DISABLE=1`` is set in the workers (Megatron's jit fusions would otherwise be
compiled by dynamo on CPU, slowly).

The rank that logs (the last one, as Megatron's ``print_rank_last``) also writes one JSON line per
iteration with the full-precision ``lm loss`` and grad norm, read back by ``run_training``.

Ranks are forked from a process that has imported Megatron-LM and answered the CUDA calls once
(``rank_zygote``: a two-rank start-up goes from about 7 s to 2.5 s on a quiet core);
``TSP_CPU_RUNNER_FORK=0`` starts a fresh interpreter per rank instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import types
from typing import Callable, List, Optional, Sequence, Tuple

from megatron_tsp.megatron_lm import patches, rank_zygote

RECORD_ENV = "TSP_CPU_RUNNER_RECORD"
# a file a rank writes its CLOCK_MONOTONIC time to when it fails: ranks that fail because a peer
# died exit a few ms after it, often before the launcher looks, and the earliest failure is the
# one whose log says why
FAILED_AT_ENV = "TSP_CPU_RUNNER_FAILED_AT"
# the environment run_training sets per rank or per run (the rest is shared by every rank)
PER_RUN_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    RECORD_ENV,
    FAILED_AT_ENV,
    # the tools' hidden-warning tally (console/quiet.py): per run, so a zygote serves every run
    "MEGATRON_TSP_WARNINGS",
)
WORKER_FLAG = "--cpu-runner-worker"


# --------------------------------------------------------------------------------------------
# The answers
# --------------------------------------------------------------------------------------------


class _CpuStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is ordered, so waits and syncs are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _CpuEvent:
    """Stands in for ``torch.cuda.Event`` (already complete; elapsed time 0)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_CPU_STREAM = _CpuStream()


def _device_properties(*args, **kwargs):
    # Megatron reads ``.major`` (architecture checks) and ``.name``; 9 = Hopper, the newest
    # architecture megatron-core 0.16 knows without Transformer Engine.
    return types.SimpleNamespace(
        major=9,
        minor=0,
        name="cpu (megatron_tsp cpu_runner)",
        total_memory=0,
        multi_processor_count=1,
    )


def _zero(*args, **kwargs):
    return 0


def _nothing(*args, **kwargs):
    return None


def _fused_weight_gradient_module() -> types.ModuleType:
    """A torch stand-in for apex's ``fused_weight_gradient_mlp_cuda``.

    ``wgrad_gemm_accum_fp32(input, grad_output, main_grad)``: ``main_grad += grad_output^T @
    input`` with fp32 accumulation (the operands are upcast exactly, the product and the sum are
    fp32, as apex's cuBLAS GEMM with an fp32 output does). ``..._fp16`` is the same into a
    half-precision ``main_grad``.
    """
    import torch

    module = types.ModuleType("fused_weight_gradient_mlp_cuda")

    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        main_grad.addmm_(grad_output.float().t(), total_input.float())

    def wgrad_gemm_accum_fp16(total_input, grad_output, main_grad):
        main_grad.add_((grad_output.float().t() @ total_input.float()).to(main_grad.dtype))

    module.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32
    module.wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp16
    module.__doc__ = _fused_weight_gradient_module.__doc__
    module.__tsp_cpu_stand_in__ = True
    del torch
    return module


def _check_dataset_helpers():
    """Replaces ``compile_helpers`` (which runs ``make`` on rank 0): the compiled extension must
    already sit next to ``helpers.cpp`` (``scripts/megatron_lm_sources.sh`` copies the wheel's)."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError as exc:
        raise RuntimeError(
            "megatron.core.datasets.helpers_cpp is not compiled in this checkout; copy the "
            "megatron-core wheel's helpers_cpp*.so next to helpers.cpp "
            "(scripts/megatron_lm_sources.sh does) or run `make -C megatron/core/datasets`"
        ) from exc


def _fork_rng(original):
    def warmup_without_drawing_from_the_training_generator(*args, **kwargs):
        import torch

        with torch.random.fork_rng(devices=[]):
            return original(*args, **kwargs)

    return warmup_without_drawing_from_the_training_generator


# Storages of stage outputs that Megatron's interleaved schedule pseudo-freed (``out.data =
# empty(1)``) right after posting their overlapped isend, before waiting on it. NCCL's send work
# keeps the sent storage alive until the transfer completes; gloo's holds only the tensor, whose
# storage the pseudo-free swaps out, so the CPU allocator could hand the memory to a new tensor
# while gloo's thread is still sending it and the next stage would receive partly overwritten
# activations (seen as run-to-run different losses with --num-virtual-stages-per-pipeline-rank).
# They are released when the next step's schedule starts: every send of a step has been received
# by then (the optimizer's collectives over the model-parallel ranks follow each schedule).
_HELD_STAGE_OUTPUTS: List = []
_IN_INTERLEAVED_SCHEDULE = False


def _hold_sent_output_storage(original):
    def deallocate_output_tensor(out, deallocate_pipeline_outputs=False):
        import torch

        if _IN_INTERLEAVED_SCHEDULE and deallocate_pipeline_outputs and torch.is_tensor(out):
            _HELD_STAGE_OUTPUTS.append(out.data)  # shares (and so keeps) the sent storage
        return original(out, deallocate_pipeline_outputs)

    return deallocate_output_tensor


def _release_held_outputs_each_step(original):
    def forward_backward_pipelining_with_interleaving(*args, **kwargs):
        global _IN_INTERLEAVED_SCHEDULE
        _HELD_STAGE_OUTPUTS.clear()
        _IN_INTERLEAVED_SCHEDULE = True
        try:
            return original(*args, **kwargs)
        finally:
            _IN_INTERLEAVED_SCHEDULE = False

    return forward_backward_pipelining_with_interleaving


RUNNER_MODULE = "megatron_tsp.megatron_lm.cpu_runner"
SCHEDULES = "megatron.core.pipeline_parallel.schedules"


def _spawn_children_import_the_runner(original):
    def get_preparation_data(name):
        data = original(name)
        if "init_main_from_path" in data:
            del data["init_main_from_path"]
            data["init_main_from_name"] = RUNNER_MODULE
        return data

    return get_preparation_data


@dataclasses.dataclass(frozen=True)
class Answer:
    """One CUDA-only call and what the CPU run answers instead: its ``cpu-runner`` patch (target,
    why, the parameters the answer relies on, whether the target may be absent) and ``make``
    (original -> replacement)."""

    patch: patches.Patch
    make: Callable

    @property
    def target(self) -> str:
        return self.patch.target

    @property
    def why(self) -> str:
        return self.patch.reason

    @property
    def optional(self) -> bool:
        return self.patch.optional


def _answer(target, why, make, params=None, versions=patches.MEGATRON_VERSIONS, optional=False):
    return Answer(patches.row(patches.CPU_RUNNER, target, why, params, versions, optional), make)


_DEVICE = patches.DEVICE_PARAM
_MEMORY_REPORT = "memory report (no device memory on CPU: 0)"


def _const(value):
    return lambda original: lambda *a, **k: value


def _value(value):
    if isinstance(value, type):
        return lambda original: value

    # A fresh function per answer: torch._dynamo's trace rules refuse one function object
    # registered under two torch names.
    def make(original):
        def answer(*args, **kwargs):
            return value(*args, **kwargs)

        answer.__name__ = getattr(original, "__name__", "answer")
        return answer

    return make


TOKEN_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"


def _host_copy_of_cpu_tensors(original):
    """What the device-to-host copy gives on a GPU, for CPU tensors too: a numpy array when
    ``as_numpy`` (the split sizes ``all_to_all_single`` takes), else the tensor."""

    def host_copy(tensor, as_numpy=False, record_stream=False):
        import torch

        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return host_copy


# The answers the alltoall MoE dispatcher needs outside the loop (in-process checks):
# its side stream, stream ordering, and the host copy of its split sizes.
ALLTOALL_DISPATCHER_TARGETS = (
    "torch.cuda:Stream",
    "torch.cuda:current_stream",
    "torch.cuda:stream",
    f"{TOKEN_DISPATCHER}:maybe_move_tensor_to_cpu",
)


@contextlib.contextmanager
def alltoall_dispatcher_on_cpu():
    """The ``CUDA_ANSWERS`` of ``ALLTOALL_DISPATCHER_TARGETS`` for the ``with`` block: what
    megatron-core's alltoall token dispatcher needs to run on CPU tensors in-process."""
    with contextlib.ExitStack() as stack:
        for answer in CUDA_ANSWERS:
            if answer.target in ALLTOALL_DISPATCHER_TARGETS:
                stack.enter_context(
                    patches.applied(patches.CPU_RUNNER, answer.target, make=answer.make)
                )
        yield


CUDA_ANSWERS: Sequence[Answer] = (
    # device setup
    _answer("torch.cuda:is_available", "initialize_megatron asserts CUDA first", _const(True), ()),
    _answer(
        "torch.cuda:device_count",
        "with 0 devices Megatron skips initialize_model_parallel and the model-parallel seed",
        _const(1),
        (),
    ),
    _answer("torch.cuda:set_device", "one CPU 'device' per rank", _value(_nothing), _DEVICE),
    _answer(
        "torch.cuda:get_device_properties",
        "architecture checks read .major",
        _value(_device_properties),
        _DEVICE,
    ),
    _answer("torch.cuda:get_device_capability", "architecture checks", _const((9, 0)), _DEVICE),
    _answer("torch.cuda:get_device_name", "printed in start-up reports", _const("cpu"), _DEVICE),
    _answer(
        "torch.accelerator:is_available",
        "the DataLoader pins memory on 'the accelerator' when one is reported; with a CUDA build "
        "of torch and no driver that initialises CUDA and fails",
        _const(False),
        (),
        optional=True,
    ),
    # streams and events (CPU work is ordered: waits are no-ops)
    _answer(
        "torch.cuda:Stream",
        "DDP / optimizer side streams (CPU work is ordered)",
        _value(_CpuStream),
    ),
    _answer("torch.cuda:Event", "timers and overlap bookkeeping", _value(_CpuEvent)),
    _answer("torch.cuda:current_stream", "stream ordering", _const(_CPU_STREAM), _DEVICE),
    _answer("torch.cuda:default_stream", "stream ordering", _const(_CPU_STREAM), _DEVICE),
    _answer("torch.cuda:set_stream", "stream ordering", _value(_nothing), ("stream",)),
    _answer(
        "torch.cuda:stream",
        "`with torch.cuda.stream(s):` blocks",
        _value(lambda *a, **k: contextlib.nullcontext()),
        ("stream",),
    ),
    _answer("torch.cuda:synchronize", "timers, barriers", _value(_nothing), _DEVICE),
    # memory reports (no device memory on CPU: 0)
    _answer("torch.cuda:empty_cache", "memory housekeeping", _value(_nothing), ()),
    _answer("torch.cuda:memory_allocated", _MEMORY_REPORT, _value(_zero), _DEVICE),
    _answer("torch.cuda:max_memory_allocated", _MEMORY_REPORT, _value(_zero), _DEVICE),
    _answer("torch.cuda:memory_reserved", _MEMORY_REPORT, _value(_zero), _DEVICE),
    _answer("torch.cuda:max_memory_reserved", _MEMORY_REPORT, _value(_zero), _DEVICE),
    _answer("torch.cuda:reset_peak_memory_stats", _MEMORY_REPORT, _value(_nothing), _DEVICE),
    _answer("torch.cuda:memory_stats", _MEMORY_REPORT, _value(lambda *a, **k: {}), _DEVICE),
    _answer("torch.cuda:device_memory_used", _MEMORY_REPORT, _value(_zero), _DEVICE, optional=True),
    _answer("torch.cuda:mem_get_info", _MEMORY_REPORT, _const((0, 0)), _DEVICE),
    # RNG: the CUDA generator is the CPU one. megatron_tsp.megatron_lm.cpu_support (applied with
    # these answers) also routes torch.cuda.current_device / get_rng_state / manual_seed, the
    # model-parallel RNG tracker and the default causal mask to the CPU.
    _answer(
        "torch.cuda:set_rng_state",
        "checkpoints save and restore the 'CUDA' RNG state",
        _value(lambda state, *a, **k: __import__("torch").set_rng_state(state)),
        ("new_state",),
    ),
    _answer(
        "torch.cuda.nvtx:range_push",
        "profiling ranges",
        _value(_nothing),
        ("msg",),
        optional=True,
    ),
    _answer("torch.cuda.nvtx:range_pop", "profiling ranges", _value(_nothing), (), optional=True),
    # the alltoall MoE dispatcher's device-to-host copy of its split sizes
    _answer(
        f"{TOKEN_DISPATCHER}:maybe_move_tensor_to_cpu",
        "the alltoall MoE dispatcher copies its split sizes to the host, where a CUDA tensor "
        "becomes a numpy array; a CPU tensor is returned as it is, which all_to_all_single "
        "refuses as split sizes",
        _host_copy_of_cpu_tensors,
        ("tensor", "as_numpy", "record_stream"),
    ),
    # builds of CUDA code
    _answer(
        "megatron.core.datasets.utils:compile_helpers",
        "rank 0 runs `make` for the dataset index helpers; the compiled .so must be there",
        _value(_check_dataset_helpers),
        (),
    ),
    _answer(
        "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.is_kernel_available",
        "the fused softmax CUDA kernels are imported when fp16/bf16 shapes qualify; without them "
        "Megatron's own torch softmax runs",
        lambda original: lambda self, *a, **k: False,
        ("self",),
    ),
    _answer(
        "megatron.legacy.fused_kernels:load",
        "compiles CUDA softmax kernels; Megatron falls back to torch softmax without them",
        _value(_nothing),
        ("args",),
        versions=("0.16",),
        optional=True,
    ),
    # spawned helper processes
    _answer(
        "multiprocessing.spawn:get_preparation_data",
        "the checkpoint writer's 'spawn' Manager child would re-run pretrain_gpt.py without these "
        "answers; children import the runner module instead",
        _spawn_children_import_the_runner,
        ("name",),
    ),
    # the jit warm-up's random draws
    _answer(
        "megatron.training.initialize:_warmup_jit_function",
        "its torch.rand draws depend on TP/SP and would shift --use-cpu-initialization weights",
        _fork_rng,
    ),
    # overlapped pipeline sends over gloo (interleaved schedule)
    _answer(
        f"{SCHEDULES}:deallocate_output_tensor",
        "the interleaved schedule pseudo-frees a stage output while its overlapped isend may still "
        "be running; gloo (unlike NCCL) does not keep the storage alive, so the allocator could "
        "reuse it mid-send: the storage is held until the next step's schedule starts",
        _hold_sent_output_storage,
        ("out", "deallocate_pipeline_outputs"),
    ),
    _answer(
        f"{SCHEDULES}:forward_backward_pipelining_with_interleaving",
        "marks the steps whose pseudo-freed outputs are held (see deallocate_output_tensor)",
        _release_held_outputs_each_step,
        (),
    ),
)


class CudaToCpuMode:
    """``device='cuda'`` in factory functions, ``Tensor.cuda()`` and ``.to('cuda')`` -> CPU;
    ``Tensor.type()`` (the legacy type string, asserted on by clip_grads) reports the CUDA name."""

    def __new__(cls):
        import torch
        from torch.overrides import TorchFunctionMode

        def is_cuda(device) -> bool:
            if device is None:
                return False
            if isinstance(device, int):
                return True  # Megatron passes torch.cuda.current_device() indices
            try:
                return torch.device(device).type == "cuda"
            except (RuntimeError, TypeError):
                return False

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types_, args=(), kwargs=None):
                kwargs = dict(kwargs or {})
                if func is torch.Tensor.cuda:
                    return args[0]
                if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                    # clip_grads asserts grad.type() == 'torch.cuda.FloatTensor'
                    name = func(*args)
                    return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
                if is_cuda(kwargs.get("device")):
                    kwargs["device"] = "cpu"
                if (
                    func is torch.Tensor.to
                    and len(args) > 1
                    and is_cuda(args[1])
                    and not torch.is_tensor(args[1])
                ):
                    args = (args[0], "cpu") + tuple(args[2:])
                return func(*args, **kwargs)

        return _Mode()


_MODE = None

BATCH_INVARIANT_KERNELS = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
FUSED_WEIGHT_GRADIENT = "fused_weight_gradient_mlp_cuda"
# the stand-in modules and the per-iteration record, applied by the runner itself
_FUSED_WEIGHT_GRADIENT_STAND_IN = patches.row(
    patches.CPU_RUNNER,
    f"{patches.STAND_IN_MODULE}:{FUSED_WEIGHT_GRADIENT}",
    "apex's gradient-accumulation-fusion kernels (imported by tensor_parallel.layers): a torch "
    "stand-in accumulating in fp32",
    ("wgrad_gemm_accum_fp32", "wgrad_gemm_accum_fp16"),
)
_TRITON_KERNELS_STAND_IN = patches.row(
    patches.CPU_RUNNER,
    f"{patches.STAND_IN_MODULE}:{BATCH_INVARIANT_KERNELS}",
    "training.initialize imports these Triton kernels at import time; without triton a "
    "stand-in refuses --batch-invariant-mode",
    (
        "enable_batch_invariant_mode",
        "set_batch_invariant_mode",
        "disable_batch_invariant_mode",
        "is_batch_invariant_mode_enabled",
    ),
    optional=True,
)
_ITERATION_RECORD = patches.row(
    patches.CPU_RUNNER,
    "megatron.training.training:training_log",
    "records the full-precision loss and grad norm per iteration (TSP_CPU_RUNNER_RECORD)",
    ("loss_dict", "iteration", "skipped_iter", "grad_norm"),
)
patches.declare(
    [a.patch for a in CUDA_ANSWERS]
    + [_ITERATION_RECORD, _FUSED_WEIGHT_GRADIENT_STAND_IN, _TRITON_KERNELS_STAND_IN]
)


def _triton_kernels_stand_in(original=None) -> types.ModuleType:
    """Without triton (CPU torch), ``megatron.training.initialize`` still imports Megatron's
    batch-invariant Triton kernels at import time; they run only with ``--batch-invariant-mode``.
    A module with the same functions that refuses to enable the mode, registered before Megatron
    imports the real one."""
    module = types.ModuleType(BATCH_INVARIANT_KERNELS)

    def needs_triton(*args, **kwargs):
        raise RuntimeError("--batch-invariant-mode needs triton (Megatron's Triton kernels)")

    module.enable_batch_invariant_mode = needs_triton
    module.set_batch_invariant_mode = needs_triton
    module.disable_batch_invariant_mode = lambda *a, **k: None
    module.is_batch_invariant_mode_enabled = lambda: False
    module.__tsp_cpu_stand_in__ = True
    return module


def apply_cuda_answers() -> List[str]:
    """Answer every entry of ``CUDA_ANSWERS`` (idempotent); returns the targets replaced.

    Needs the Megatron-LM checkout importable (the script's directory first on ``sys.path``).
    """
    global _MODE
    import importlib.util

    from megatron_tsp.megatron_lm import cpu_support

    if importlib.util.find_spec("triton") is None:
        stand_in = _TRITON_KERNELS_STAND_IN
        patches.apply(stand_in.mode, stand_in.target, make=_triton_kernels_stand_in)
    stand_in = _FUSED_WEIGHT_GRADIENT_STAND_IN
    patches.apply(
        stand_in.mode, stand_in.target, make=lambda original: _fused_weight_gradient_module()
    )
    replaced = []
    for answer in CUDA_ANSWERS:
        if patches.is_active(patches.CPU_RUNNER, answer.target):
            continue
        patches.apply(patches.CPU_RUNNER, answer.target, make=answer.make)
        if patches.is_active(patches.CPU_RUNNER, answer.target):
            replaced.append(answer.target)
    cpu_support.enable_cpu_support(force=True)
    if _MODE is None:
        _MODE = CudaToCpuMode()
        _MODE.__enter__()
    return replaced


# --------------------------------------------------------------------------------------------
# Per-iteration record (full precision) from Megatron's training_log
# --------------------------------------------------------------------------------------------


def _install_iteration_record(path: str) -> None:
    patches.apply(
        _ITERATION_RECORD.mode,
        _ITERATION_RECORD.target,
        make=lambda original: _recording_training_log(original, path),
    )


def _recording_training_log(original, path: str):
    import inspect

    import torch

    signature = inspect.signature(original)

    def training_log(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        loss_dict = bound.arguments.get("loss_dict") or {}
        grad_norm = bound.arguments.get("grad_norm")
        iteration = bound.arguments.get("iteration")
        dist = torch.distributed
        if dist.is_initialized() and dist.get_rank() == dist.get_world_size() - 1:
            losses = {
                k: float(v)
                for k, v in loss_dict.items()
                if torch.is_tensor(v) or isinstance(v, float)
            }
            with open(path, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "iteration": iteration,
                            "losses": losses,
                            "grad_norm": None if grad_norm is None else float(grad_norm),
                            "skipped": int(bound.arguments.get("skipped_iter") or 0),
                        }
                    )
                    + "\n"
                )
        return original(*args, **kwargs)

    return training_log


# --------------------------------------------------------------------------------------------
# Worker and launcher
# --------------------------------------------------------------------------------------------


def _rank_main(argv: List[str]) -> int:
    """One rank's entry point (fresh process or zygote fork): ``_worker``, noting when it fails
    in the file ``FAILED_AT_ENV`` names before the exit handlers run."""
    from megatron_tsp.console import quiet

    quiet.install_from_env()  # a forked rank: its environment arrived after the zygote's imports
    code: object = 1
    try:
        code = _worker(argv)
        return code
    except SystemExit as e:
        code = 0 if e.code is None else e.code
        raise
    finally:
        path = os.environ.get(FAILED_AT_ENV)
        if path and code != 0:
            with open(path, "w") as f:
                f.write(repr(time.monotonic()))


def _worker(argv: List[str]) -> int:
    """Inside one rank: answer CUDA, then run the script (through the TSP launcher or stock)."""
    stock = False
    if argv and argv[0] == "--stock":
        stock, argv = True, argv[1:]
    script = os.path.abspath(argv[0])
    script_dir = os.path.dirname(script)
    if script_dir not in sys.path:
        sys.path.insert(0, script_dir)
    apply_cuda_answers()
    record = os.environ.get(RECORD_ENV)
    if record:
        _install_iteration_record(record)
    if stock:
        import runpy

        sys.argv = [script] + argv[1:]
        runpy.run_path(script, run_name="__main__")
        return 0
    from megatron_tsp.megatron_lm import launch

    return launch.main([script] + argv[1:])


def _wait_for_ranks(
    procs: Sequence[subprocess.Popen],
    timeout: float,
    failed_at: Sequence[Optional[str]] = (),
    grace: float = 5.0,
) -> Tuple[int, Optional[int]]:
    """``(returncode, failed_rank)`` of a group of rank processes: the rank that failed first, or
    124 and the lowest rank still running when ``timeout`` s pass; ``(0, None)`` when all succeed.

    When one rank fails, the ranks waiting for it in a collective fail too, a few ms later (or sit
    until gloo's own timeout): once a failure is seen, the ranks get ``grace`` s to finish exiting,
    then the failed rank with the earliest time in its ``failed_at`` file (a rank killed by a
    signal writes none: the time it was seen dead stands in) is named and the rest are killed."""
    deadline = time.monotonic() + timeout
    seen_dead: dict = {}
    settle_by = None

    def failure_time(rank: int) -> Optional[float]:
        path = failed_at[rank] if rank < len(failed_at) else None
        if path and os.path.exists(path):
            try:
                with open(path) as f:
                    return float(f.read())
            except (OSError, ValueError):  # being written
                pass
        return seen_dead.get(rank)

    while True:
        now = time.monotonic()
        codes = [proc.poll() for proc in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                seen_dead.setdefault(rank, now)
        running = [rank for rank, code in enumerate(codes) if code is None]
        if seen_dead and settle_by is None:
            settle_by = now + grace
        if settle_by is not None:
            failing = [r for r in range(len(procs)) if failure_time(r) is not None]
            # wait for the ranks that noted a failure to exit (their code is the answer)
            if now < settle_by and any(codes[r] is None for r in failing):
                time.sleep(0.02)
                continue
            rank = min(failing, key=lambda r: (failure_time(r), r))
            code = codes[rank] if codes[rank] is not None else 1
        elif not running:
            return 0, None
        elif now > deadline:
            rank, code = running[0], 124
        else:
            time.sleep(0.1)
            continue
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        return code, rank


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (for ``tcp://127.0.0.1:port``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class TrainingRun:
    """What ``run_training`` returns. ``losses[i]`` / ``grad_norms[i]``: iteration ``i + 1``."""

    returncode: int
    losses: List[float]
    grad_norms: List[Optional[float]]
    iterations: List[int]
    records: List[dict]
    log: str  # stdout + stderr of every rank, rank-prefixed

    failed_rank: Optional[int] = None

    def rank_log(self, rank: int) -> str:
        prefix = f"[rank{rank}] "
        return "\n".join(line for line in self.log.splitlines() if line.startswith(prefix))

    def check(self) -> "TrainingRun":
        if self.returncode != 0:
            rank = self.failed_rank if self.failed_rank is not None else 0
            raise RuntimeError(
                f"training run failed (exit {self.returncode}), rank {rank}:\n"
                f"{self.rank_log(rank)[-6000:]}"
            )
        return self


LOSS_KEY = "lm loss"


def run_training(
    script: str,
    args: Sequence[str],
    nproc: int,
    env: Optional[dict] = None,
    python: Optional[str] = None,
    stock: bool = False,
    timeout: float = 1800,
    check: bool = True,
) -> TrainingRun:
    """Run ``script`` (Megatron-LM's ``pretrain_gpt.py``) on ``nproc`` CPU ranks over gloo.

    ``args``: Megatron's arguments (``--distributed-backend gloo`` is appended). ``env``: extra
    environment for every rank. ``python``: interpreter (default: this one). ``stock``: run the
    script without the TSP launcher. Returns the per-iteration ``lm loss`` and grad norm (full
    precision, from Megatron's own ``training_log``) and the ranks' output; raises (with the log)
    when a rank fails and ``check``.
    """
    python = python or sys.executable
    for _ in range(_PORT_ATTEMPTS):
        run = _run_once(script, args, nproc, env, python, stock, timeout, free_port())
        # the port was free when probed and taken before rank 0 bound it (another run on the
        # machine): nothing ran, try another
        if run.returncode == 0 or _ADDRESS_IN_USE not in run.rank_log(run.failed_rank or 0):
            break
    return run.check() if check else run


_PORT_ATTEMPTS = 3
_ADDRESS_IN_USE = "EADDRINUSE"


def _run_once(script, args, nproc, env, python, stock, timeout, port) -> TrainingRun:
    """One launch of ``run_training`` on rendezvous port ``port``."""
    # The workers import this package: make sure they find the copy this process uses.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory(prefix="tsp_cpu_run_") as tmp:
        record = os.path.join(tmp, "iterations.jsonl")
        failed_at = [os.path.join(tmp, f"rank{rank}.failed_at") for rank in range(nproc)]
        procs = []
        for rank in range(nproc):
            rank_env = dict(os.environ)
            rank_env.update(env or {})
            rank_env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                TORCHDYNAMO_DISABLE="1",
                CUDA_DEVICE_MAX_CONNECTIONS="1",
                PYTHONUNBUFFERED="1",
                **{RECORD_ENV: record, FAILED_AT_ENV: failed_at[rank]},
            )
            rank_env.setdefault("OMP_NUM_THREADS", "1")
            # env's PYTHONPATH goes in front of (not instead of) the inherited one
            rank_env["PYTHONPATH"] = os.pathsep.join(
                p
                for p in (package_root, (env or {}).get("PYTHONPATH"), os.environ.get("PYTHONPATH"))
                if p
            )
            for name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
                rank_env.pop(name, None)
            worker_argv = (["--stock"] if stock else []) + [script, *args]
            worker_argv += ["--distributed-backend", "gloo"]
            log_path = os.path.join(tmp, f"rank{rank}.log")
            zygote = rank_zygote.zygote_for(python, script, rank_env, PER_RUN_ENV)
            if zygote is not None:  # forked from a process that has imported Megatron-LM
                open(log_path, "w").close()
                procs.append((zygote.start(worker_argv, rank_env, log_path), None))
                continue
            cmd = [python, "-m", "megatron_tsp.megatron_lm.cpu_runner", WORKER_FLAG, *worker_argv]
            out = open(log_path, "w")
            procs.append(
                (subprocess.Popen(cmd, env=rank_env, stdout=out, stderr=subprocess.STDOUT), out)
            )
        try:
            returncode, failed_rank = _wait_for_ranks(
                [proc for proc, _ in procs], timeout, failed_at
            )
        finally:
            for proc, out in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                if out is not None:
                    out.close()
        log = ""
        for rank in range(nproc):
            with open(os.path.join(tmp, f"rank{rank}.log")) as f:
                log += "".join(f"[rank{rank}] {line}" for line in f)
        records = []
        if os.path.exists(record):
            with open(record) as f:
                records = [json.loads(line) for line in f if line.strip()]
    return TrainingRun(
        returncode=returncode,
        losses=[r["losses"].get(LOSS_KEY) for r in records],
        grad_norms=[r["grad_norm"] for r in records],
        iterations=[r["iteration"] for r in records],
        records=records,
        log=log,
        failed_rank=failed_rank,
    )


def parse_log_losses(log: str) -> List[float]:
    """``lm loss`` values as Megatron prints them (for logs of runs not made by this module)."""
    return [float(m) for m in re.findall(r"lm loss: ([0-9.eE+-]+)", log)]


SUMMARY_NOTE = (
    "lm loss (this iteration): that iteration's global-batch loss at full precision "
    "(training_log's loss_dict); Megatron's own log line prints lm loss averaged over the "
    "iterations since its previous log line (--log-interval), to 7 significant digits"
)


def summary(run: TrainingRun) -> str:
    """The per-iteration table ``cpu-run --summary`` prints, with what its loss is."""
    lines = [f"{'iteration':>9}  {'lm loss (this iteration)':>24}  {'grad norm':>22}"]
    for it, loss, norm in zip(run.iterations, run.losses, run.grad_norms):
        lines.append(f"{it:>9}  {loss!r:>24}  {norm!r:>22}")
    lines.append(SUMMARY_NOTE)
    return "\n".join(lines)


TP_SP_SPEC = ["--spec", "megatron_tsp.megatron_lm.spec", "tp_sp_block_spec"]
TP_SP_NOTICE = (
    "megatron-tsp cpu-run: --sequence-parallel without Transformer Engine: using the project's "
    "TP+SP spec (no Transformer Engine), {spec} (Megatron's local layers with "
    "sequence-parallel torch norms; Megatron's own norms refuse SP here)"
)


def _flag_value(args: Sequence[str], flag: str) -> Optional[str]:
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _has(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def tp_sp_spec_needed(args: Sequence[str]) -> bool:
    """A stock TP+SP command line (``--sequence-parallel``, no ``--spec``, no TSP flag) that
    Megatron cannot build on this machine: its layer spec's norm supports sequence parallelism
    only from Transformer Engine (``--transformer-impl transformer_engine``, the default) or apex
    (``local``: without apex it is torch's norm, which asserts ``not sequence_parallel``)."""
    # imported here: the runner's module stays torch-free until a run needs it
    from megatron_tsp.megatron_lm.arguments import TSP_FLAG, TSP_MLP_FLAG, flags_in

    names = flags_in(args)
    if "--sequence-parallel" not in names or "--spec" in names or names & {TSP_FLAG, TSP_MLP_FLAG}:
        return False
    impl = _flag_value(args, "--transformer-impl") or "transformer_engine"
    if impl == "local":
        return not _has("apex")
    return not _has("transformer_engine")


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == WORKER_FLAG:
        return _rank_main(argv[1:])
    if argv and argv[0] == rank_zygote.ZYGOTE_FLAG and len(argv) == 2:
        return rank_zygote.serve(argv[1], prepare=apply_cuda_answers, run=_rank_main)
    from megatron_tsp.console.args import ToolParser, positive_float, positive_int

    parser = ToolParser(
        prog="megatron-tsp cpu-run",
        description="Run Megatron-LM's pretrain_gpt.py on CPU ranks over gloo "
        "(CUDA-only calls answered; see the module docstring).",
        usage="%(prog)s --nproc N [--summary] [--stock] -- pretrain_gpt.py ARGS...",
    )
    parser.add_argument("--nproc", type=positive_int, required=True, help="number of ranks")
    parser.add_argument(
        "--summary", action="store_true", help="print only the per-iteration loss / grad norm table"
    )
    parser.add_argument(
        "--stock", action="store_true", help="run the script without the TSP launcher hooks"
    )
    parser.add_argument("--timeout", type=positive_float, default=3600)
    if "--" in argv:
        split = argv.index("--")
        ours, rest = argv[:split], argv[split + 1 :]
    else:
        ours, rest = argv, []
    opts = parser.parse_args(ours)
    if not rest:
        parser.error("give the script and its arguments after --")
    script, args, stock = rest[0], rest[1:], opts.stock
    if tp_sp_spec_needed(args):
        # the spec is a function of (config, vp_stage, pp_rank): the launcher's GPTModel hook
        # resolves it, so the run goes through the launcher, with no TSP flag (stock Megatron)
        args, stock = args + TP_SP_SPEC, False
        print(TP_SP_NOTICE.format(spec=" ".join(TP_SP_SPEC)), file=sys.stderr, flush=True)
    run = run_training(script, args, opts.nproc, stock=stock, timeout=opts.timeout, check=False)
    if not opts.summary or run.returncode != 0:
        sys.stdout.write(run.log)
    print(summary(run))
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
