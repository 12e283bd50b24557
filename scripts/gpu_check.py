#!/usr/bin/env python
"""One prepared GPU check for TSP: speed, memory and bf16 accuracy of the
real layer code on ONE GPU.

    python scripts/gpu_check.py --out-dir DIR            # H100 / H200, torch >= 2.11 with CUDA
    python scripts/gpu_check.py --out-dir DIR --cpu-smoke # tiny shapes on CPU (the test suite)

(a) One rank's full transformer-layer step (forward + backward) for TSP (D=8) and Megatron
    TP=8 + SP at 7B / 128k shapes (h=4096, 32 heads, FFN 4h, RoPE, S=131072, micro-batch 1,
    bf16), built from the same layer specs as training (``megatron_tsp.core.specs`` for TSP,
    megatron-core's local spec for TP+SP) in a world of D ranks made of torch's ``fake`` process
    group: every collective returns at once, so the timings are one rank's compute and memory
    copies with communication removed. TP+SP's core attention is one causal
    ``F.scaled_dot_product_attention`` call over the whole sequence (flash / cuDNN; Megatron's
    local core attention would materialise the [S, S] scores). Beside them FSDP x CP's rank
    (ZeRO-3 x CP over the same D ranks, the planner's ``fsdp_cp``): megatron-core's layer at
    TP = 1, CP = D, whole-weight GEMMs on the rank's S/D tokens and TE's all-gather CP attention
    as ``bench --traffic`` records it (``tools/traffic_fsdp_cp.KVAllGatherAttention``: K/V
    gathered and reordered, one causal flash call per zigzag chunk over the keys it sees); its
    weight all-gathers and gradient reduce-scatter are no-ops here like every collective.
    Reported: median step time of each and their ratios, kernels launched per layer step
    (torch.profiler), and the step's memory: ``torch.cuda.max_memory_allocated`` during the
    step minus the memory allocated before it (parameters, input, RoPE table), beside the
    fake-tensor prediction of the same difference (MemTracker under FakeTensorMode, the
    machinery of ``megatron-tsp memory``) for the same layer, input and layout
    (``--cpu-smoke``: that tracker on the real CPU tensors stands in for the CUDA allocator).
    TSP's persistent communication buffers (``comm.WORKSPACE``) are
    dropped before each scheme and before the measured step, so that step allocates (and
    counts) TSP's own and TP+SP's figure holds none of TSP's.
(b) TSP layers in bf16 against the same layers in fp32 (same weights, input and output
    gradient) at D=1: relative errors of the output, the input gradient and every weight
    gradient. D>1 on one GPU is not run: torch's single-process multi-rank ("threaded") process
    group has no point-to-point or reduce ops (the MLP ring needs isend/irecv, attention a
    reduce-to-owner); D=4 bf16 accuracy against TP+SP is tested on CPU by tests/test_precision.py.
(c) ``DIR/gpu_check.json`` and ``DIR/gpu_check.md``.

Before anything is timed, every attention backend available on the machine (aten_flash, cudnn
on sm90+, te_fused when Transformer Engine imports, sdpa_recompute; on CPU cpu_flash and
sdpa_recompute, and te_fused through the TE contract emulator with ``--te-emulator``) is checked
against an fp32 SDPA-math reference on the same inputs (``megatron_tsp/tools/kernel_check.py``:
forward and backward, both zigzag chunks, GQA, micro-batch 2); the errors go to the report, and
the TSP layers are pinned (``TSP_ATTENTION_KERNEL``) to a verified backend, the default choice
when it passed, whose name is recorded. TSP's own Triton kernels are checked too: the one-kernel
RoPE against the fp64 formula (report section (c)), the one-launch dK/dV row sum against its
torch path on every rank's pieces of a D=8 group (section (d)) and the one-launch MLP activation
backward against Megatron's formulas (section (e)).

Timings are reported as ratios and absolute medians, never asserted. Total run time on an H200:
a few minutes (7B-layer builds on CPU dominate); ``--iters`` / ``--seq`` shorten it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Dict, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

GB = 1e9
SCHEMES = {"tsp": "TSP", "tp_sp": "Megatron TP+SP", "fsdp_cp": "FSDP x CP"}


# --------------------------------------------------------------------------------------------
# layer construction (real specs, fake process group)


def _sdpa_core_attention_class():
    """Megatron ``core_attention`` for TP+SP on one GPU: one causal SDPA call (flash / cuDNN)."""
    from megatron.core.transformer.module import MegatronModule

    class SDPACoreAttention(MegatronModule):
        def __init__(
            self,
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=None,
            softmax_scale=None,
            cp_comm_type=None,
            pg_collection=None,
        ):
            super().__init__(config=config)
            kv = config.kv_channels or config.hidden_size // config.num_attention_heads
            self.scale = softmax_scale or 1.0 / math.sqrt(kv)

        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
        ):
            sq, b = query.shape[0], query.shape[1]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=k.shape[1] != q.shape[1]
            )
            return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    return SDPACoreAttention


def _run_config(scheme, d, model, seq, dtype, init):
    from megatron_tsp.tools.estimator import fake_run as fr

    fsdp = scheme == "fsdp_cp"  # Megatron's layer at TP = 1, CP = D (whole weights, S/D tokens)
    return fr.RunConfig(
        scheme="tp_cp" if fsdp else scheme,
        model=model,
        world_size=d,
        tp=1 if fsdp else d,
        cp=d if fsdp else 1,
        seq=seq,
        dtype="bf16" if dtype == torch.bfloat16 else "fp32",
        fake=not init,
    )


def device_and_model(cpu_smoke: bool):
    """("cpu", a tiny one-layer model) for ``--cpu-smoke``, else ("cuda", one 7B layer)."""
    from megatron_tsp.core.model_shape import ModelShape, load_model

    if cpu_smoke:
        return "cpu", ModelShape(hidden=64, num_layers=1, heads=4, vocab=128)
    return "cuda", dataclasses.replace(load_model("7b"), num_layers=1)


def layout_problems(model, seq: int, d: int) -> list:
    """What stops ``seq`` tokens and ``model``'s heads from splitting over D=``d`` ranks."""
    problems = []
    if seq % (2 * d):
        problems.append(f"--seq={seq} is not a multiple of 2 x --d={d} (two chunks per rank)")
    if model.heads % d:
        problems.append(f"the model's {model.heads} attention heads are not divisible by --d={d}")
    return problems


def markdown_kernel_name(name: str, width: int) -> str:
    """A kernel's name for a markdown table cell: at most ``width`` characters, pipes escaped."""
    label = name if len(name) <= width else name[: width - 3] + "..."
    return label.replace("|", "\\|")


def setup_groups(scheme: str, d: int, model, seq: int) -> None:
    """A fake world of ``d`` ranks (this process is rank 0) and the scheme's Megatron groups.
    Outside FakeTensorMode: group creation checks its configuration with a real collective."""
    from megatron_tsp.megatron_lm.fake_world import init_fake_world
    from megatron_tsp.tools.estimator import fake_run as fr

    cfg = _run_config(scheme, d, model, seq, torch.bfloat16, False)
    init_fake_world(d)
    fr.init_parallel(cfg)


def build_layer(scheme: str, d: int, model, seq: int, dtype: torch.dtype, device: str, init: bool):
    """One TransformerLayer of ``scheme`` for rank 0 of the fake group of ``d`` ranks (see
    ``setup_groups``), plus the full-sequence RoPE table the model would pass it."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.spec_utils import build_module

    from megatron_tsp.tools.estimator import fake_run as fr

    cfg = _run_config(scheme, d, model, seq, dtype, init)
    # D=1: Megatron refuses sequence parallelism without tensor parallelism (config only).
    config_cfg = dataclasses.replace(cfg, scheme="tp") if d == 1 else cfg
    # On the GPU the parameters are created there (Megatron's default); torch modules (the norms)
    # follow the default-device context below.
    config = dataclasses.replace(
        fr.transformer_config(config_cfg), use_cpu_initialization=device == "cpu"
    )
    if scheme == "tp_sp":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from megatron_tsp.core.layers.norm import SequenceParallelNorm

        spec = get_gpt_layer_local_spec(normalization=model.normalization)
        spec.submodules.input_layernorm = SequenceParallelNorm
        spec.submodules.pre_mlp_layernorm = SequenceParallelNorm
        spec.submodules.self_attention.submodules.core_attention = _sdpa_core_attention_class()
    else:
        spec = fr.layer_spec(cfg, config).layer_specs[0]
    if scheme == "fsdp_cp":  # TE's all-gather CP attention, as bench --traffic records it
        from megatron_tsp.tools.traffic_fsdp_cp import core_attention_class

        spec.submodules.self_attention.submodules.core_attention = core_attention_class(False)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    with torch.device(device):
        layer = build_module(spec, config=config, layer_number=1)
    kv = config.kv_channels or model.hidden // model.heads
    rope = RotaryEmbedding(kv_channels=kv, rotary_percent=1.0, use_cpu_initialization=True)
    # under CP (fsdp_cp) Megatron slices the rank's zigzag rows, its index built on CUDA: on the
    # CPU the memory tool's CPU version of it
    with fr.cpu_cp_rope() if device == "cpu" else contextlib.nullcontext():
        freqs = rope(seq).to(device)
    return layer, freqs


def layer_inputs(d: int, model, seq: int, dtype, device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    shape = (seq // d, 1, model.hidden)
    x = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    dy = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    return x, dy


def layer_step(layer, x, dy, freqs):
    """Forward + backward of one layer; returns the output (detached)."""
    x = x.detach().requires_grad_(True)
    out, _ = layer(x, attention_mask=None, rotary_pos_emb=freqs)
    out.backward(dy)
    return out.detach(), x.grad


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------
# (a) timing, kernels, memory


def _count_kernels(layer, x, dy, freqs, device) -> Dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        layer_step(layer, x, dy, freqs)
        _sync(device)
    events = prof.events()
    if device == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        kind = "CUDA kernels"
    else:
        kernels = [e for e in events if e.name.startswith("aten::") and not e.cpu_children]
        kind = "leaf aten ops (CPU smoke)"
    # the summed durations of those kernels: beside the step's wall time, the share the device
    # is busy (a step much longer than its kernels is bound by the host: Python, launches)
    busy = sum(e.time_range.elapsed_us() for e in kernels) * 1e-6
    by_name: Dict[str, dict] = {}
    for e in kernels:
        entry = by_name.setdefault(e.name, {"kernel": e.name, "launches": 0, "s": 0.0})
        entry["launches"] += 1
        entry["s"] += e.time_range.elapsed_us() * 1e-6
    top = sorted(by_name.values(), key=lambda entry: -entry["s"])[:12]
    return {"kernels": len(kernels), "kind": kind, "busy_s": busy, "top": top}


def _host_profile(layer, x, dy, freqs, device, path: str) -> None:
    """cProfile of one layer step: where the host's time goes (top functions by own time)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    layer_step(layer, x, dy, freqs)
    _sync(device)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    with open(path, "w") as f:
        f.write(text.getvalue())


def _fake_peak(scheme, d, model, seq, dtype, device) -> Dict[str, float]:
    """The fake-tensor tool's prediction for this layer step: MemTracker's peak under
    FakeTensorMode (no storage) over the same build and step, parameters, inputs and RoPE table
    included (as ``max_memory_allocated`` includes them), and what it holds before the step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_tsp.core.comm import WORKSPACE

    setup_groups(scheme, d, model, seq)
    with FakeTensorMode(allow_non_fake_inputs=True):
        layer, freqs = build_layer(scheme, d, model, seq, dtype, device, init=False)
        x, dy = layer_inputs(d, model, seq, dtype, device)
        tracker = _memory_tracker(layer, x, dy, freqs)
        with tracker:
            before = _one_device(tracker.get_tracker_snapshot("current"))
            layer_step(layer, x, dy, freqs)
        peak = _one_device(tracker.get_tracker_snapshot("peak"))
    WORKSPACE.clear()  # the fake run's buffers (no storage, but WORKSPACE.nbytes counts them)
    total, by_cat = _snapshot_bytes(peak)
    return {
        "peak_bytes": total,
        "before_step_bytes": _snapshot_bytes(before)[0],
        "by_category": by_cat,
    }


def _memory_tracker(layer, *tensors):
    """MemTracker holding the layer's parameters and the step's inputs as memory already there."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(layer, *tensors)
    return tracker


def _one_device(snapshot) -> dict:
    return next(iter(snapshot.values()), {})


def _snapshot_bytes(snapshot) -> Tuple[int, Dict[str, int]]:
    """(total, bytes by category) of one device's MemTracker snapshot."""
    total = None
    by_cat = {}
    for k, v in snapshot.items():
        name = str(getattr(k, "value", k))
        if name == "Total":
            total = int(v)
        else:
            by_cat[name] = int(v)
    if total is None:
        total = sum(by_cat.values())
    return total, by_cat


def time_scheme(
    scheme, d, model, seq, dtype, device, iters, warmup, host_profile_path=None
) -> dict:
    from megatron_tsp.core.comm import WORKSPACE

    WORKSPACE.clear()  # a previous scheme's persistent buffers are not this scheme's memory
    setup_groups(scheme, d, model, seq)
    layer, freqs = build_layer(scheme, d, model, seq, dtype, device, init=False)
    x, dy = layer_inputs(d, model, seq, dtype, device)
    for _ in range(warmup):
        layer_step(layer, x, dy, freqs)
        layer.zero_grad(set_to_none=True)
    # Memory step: it allocates the scheme's persistent buffers itself, as a first training step
    # does, so the peak counts them and the baseline (parameters, input, RoPE table) does not.
    WORKSPACE.clear()
    layer.zero_grad(set_to_none=True)
    _sync(device)
    # no CUDA allocator (--cpu-smoke): the fake-tensor tool's tracker on the real tensors
    tracker = _memory_tracker(layer, x, dy, freqs) if device != "cuda" else None
    with tracker or contextlib.nullcontext():
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = _snapshot_bytes(_one_device(tracker.get_tracker_snapshot("current")))[0]
        workspace_at_start = WORKSPACE.nbytes()
        layer_step(layer, x, dy, freqs)
        _sync(device)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _snapshot_bytes(_one_device(tracker.get_tracker_snapshot("peak")))[0]
    workspace_after = WORKSPACE.nbytes()
    times = []
    for _ in range(iters):
        layer.zero_grad(set_to_none=True)
        _sync(device)
        t0 = time.perf_counter()
        layer_step(layer, x, dy, freqs)
        _sync(device)
        times.append(time.perf_counter() - t0)
    layer.zero_grad(set_to_none=True)
    kernels = _count_kernels(layer, x, dy, freqs, device)
    if host_profile_path:
        layer.zero_grad(set_to_none=True)
        _host_profile(layer, x, dy, freqs, device, host_profile_path)
    params = sum(p.numel() for p in layer.parameters())
    kernel_name = getattr(layer.self_attention, "attention_kernel_name", None)  # TSP only
    del layer, x, dy
    WORKSPACE.clear()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "scheme": scheme,
        "step_s": times,
        "step_s_median": statistics.median(times),
        "kernels_per_layer_step": kernels["kernels"],
        "kernel_kind": kernels["kind"],
        "kernel_busy_s": kernels["busy_s"],
        "top_kernels_by_time": kernels["top"],
        "max_memory_allocated_bytes": peak,
        "memory_before_step_bytes": base,
        "step_peak_bytes": peak - base,
        "memory_measured_by": (
            "torch.cuda.max_memory_allocated" if device == "cuda" else "MemTracker (CPU smoke)"
        ),
        "workspace_bytes_at_step_start": workspace_at_start,
        "workspace_bytes_after_step": workspace_after,
        "layer_params": params,
        "attention_kernel": kernel_name,
    }


# --------------------------------------------------------------------------------------------
# (b) bf16 vs fp32


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    b = b.double()
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


@contextlib.contextmanager
def _unpinned():
    from megatron_tsp.core.layers import kernels

    pinned = os.environ.pop(kernels.ENV_OVERRIDE, None)
    try:
        yield
    finally:
        if pinned is not None:
            os.environ[kernels.ENV_OVERRIDE] = pinned


def _bf16_vs_fp32(scheme, model, seq, device) -> Tuple[Dict[str, float], Dict[str, str]]:
    """One scheme's layer at D=1 in bf16 vs the same layer in fp32: relative errors of the
    output, the input gradient and every weight gradient, and the attention kernel each ran.
    Weights are seeded by parameter name, so both schemes run the very same weights."""
    import zlib

    errors, kernels_used, runs = {}, {}, {}
    setup_groups(scheme, 1, model, seq)
    for dtype in (torch.float32, torch.bfloat16):
        # the fp32 reference takes the default kernel for fp32: the backend pinned for the timed
        # bf16 layers (flash, cuDNN) may not run fp32 at all
        with _unpinned() if dtype == torch.float32 else contextlib.nullcontext():
            layer, freqs = build_layer(scheme, 1, model, seq, dtype, device, init=True)
        kernels_used[str(dtype).split(".")[-1]] = getattr(
            layer.self_attention, "attention_kernel_name", "sdpa"
        )
        with torch.no_grad():
            for name, p in layer.named_parameters():  # bf16-representable weights
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                noise = torch.randn(p.shape, generator=g) * 0.05
                value = 1.0 + noise if "layernorm" in name and name.endswith("weight") else noise
                p.copy_(value.to(torch.bfloat16).to(p.dtype))
        x, dy = layer_inputs(1, model, seq, torch.bfloat16, device, seed=3)
        y, gx = layer_step(layer, x.to(dtype), dy.to(dtype), freqs)
        runs[dtype] = (y, gx, {n: p.grad.detach().clone() for n, p in layer.named_parameters()})
        del layer
    (y32, g32, w32), (y16, g16, w16) = runs[torch.float32], runs[torch.bfloat16]
    errors["output"] = _rel(y16, y32)
    errors["grad:input"] = _rel(g16, g32)
    for name in w32:
        errors[f"grad:{name}"] = _rel(w16[name], w32[name])
    return errors, kernels_used


def precision_check(model, seq, device) -> Tuple[Dict[str, float], Dict[str, str], dict]:
    """TSP's and Megatron's layer (D=1), each in bf16 against itself in fp32 on the same
    weights and data: TSP's errors, the kernels it ran, and Megatron's errors beside them."""
    tsp, kernels_used = _bf16_vs_fp32("tsp", model, seq, device)
    megatron, megatron_kernels = _bf16_vs_fp32("tp_sp", model, seq, device)
    return tsp, kernels_used, {"errors": megatron, "attention_kernels": megatron_kernels}


# --------------------------------------------------------------------------------------------
# attention backends: checked before timing, one pinned


def verify_attention_backends(model, device, dtype, te_emulator=None, timed=None) -> dict:
    """Check each available backend (``kernel_check``), then pin the one the TSP layers will
    run: ``timed`` when given (it must have passed), else the default choice for this layer
    when verified, else the first verified one."""
    import contextlib

    from megatron_tsp.core.layers import kernels
    from megatron_tsp.tools import kernel_check

    names = kernel_check.candidates(device)
    stack = contextlib.ExitStack()
    if te_emulator:  # CPU smoke only: te_fused's call sequence through the TE contract emulator
        import megatron.core  # noqa: F401  it probes for TE when first imported: not the emulator

        from tests.emulators import transformer_engine_emulator

        stack.enter_context(transformer_engine_emulator.install(te_emulator))
        names.insert(-1, "te_fused")
    with stack:
        report = kernel_check.verify_backends(device, dtype, names, **_check_case(device))
    head_dim = model.hidden // model.heads
    capability = torch.cuda.get_device_capability() if device == "cuda" else None
    gqa = (model.query_groups or model.heads) != model.heads
    default = kernels.kernel_choice(device, dtype, head_dim, gqa, 0.0, capability)
    report["default"] = default
    if timed is not None:
        result = report["checked"].get(timed)
        if result is None or not result["verified"]:
            raise RuntimeError(
                f"--timed-backend={timed}: not verified on this machine "
                f"({result['error'] or result['errors'] if result else 'not available'})"
            )
        report["timed"] = timed
    else:
        report["timed"] = kernel_check.pin_backend(report, default)
    report["te_emulator"] = te_emulator
    os.environ[kernels.ENV_OVERRIDE] = report["timed"]
    return report


def verify_rope_kernel(device) -> dict:
    """TSP's one-kernel RoPE (``rope_kernel``: Triton, the CUDA default) against the fp64
    formula, bf16 and fp32, a strided destination, forward and inverse: worst error relative to
    the terms' magnitude (one rounding is 2^-9 in bf16, 6e-8 in fp32). On CPU tensors it runs in
    Triton's interpreter (which truncates to bf16). Triton missing: reported, not run."""
    from megatron_tsp.core.layers import rope_kernel, triton_choice

    if not triton_choice.triton_importable():
        return {"ran": False, "why": "triton not importable", "errors": {}}
    g = torch.Generator().manual_seed(0)
    # the interpreter runs one program at a time: a few tokens on CPU
    t, a, b, d = (4096 if torch.device(device).type == "cuda" else 32), 4, 1, 128
    angles = torch.rand(t, d // 2, generator=g, dtype=torch.float64).repeat(1, 2) * 6.3
    sign = torch.ones(d, dtype=torch.float64)
    sign[: d // 2] = -1
    cos, signed = (
        torch.cos(angles).float().to(device),
        (torch.sin(angles) * sign).float().to(device),
    )
    errors = {}
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(t, a, b, d, generator=g).to(dtype).to(device)
        for inverse in (False, True):
            holder = torch.zeros(t, a, 2 * b, d, dtype=dtype, device=device)
            out = holder[:, :, ::2]
            rope_kernel.rope_into(x, cos, signed, out, False, inverse)
            i = torch.arange(d, device=device)
            partner = torch.where(i < d // 2, i + d // 2, i - d // 2)
            s = signed.double()[:, None, None, :]
            s = s[..., partner] if inverse else s
            xd = x.double()
            ref = xd * cos.double()[:, None, None, :] + xd[..., partner] * s
            terms = (xd.abs() * cos.double().abs()[:, None, None, :]) + xd[
                ..., partner
            ].abs() * s.abs()
            err = ((out.double() - ref).abs() / terms.clamp_min(1e-30)).max().item()
            errors[f"{str(dtype).split('.')[-1]} {'inverse' if inverse else 'forward'}"] = err
    return {
        "ran": True,
        "why": "",
        "errors": errors,
        "chosen_on_this_device": rope_kernel.available(torch.device(device), torch.bfloat16),
    }


def verify_row_sum_kernel(device) -> dict:
    """TSP's one-launch dK/dV sum (``row_sum_kernel``: Triton, the CUDA default) against its torch
    path (``layout.sum_row_pieces``: copies and one fp32 add rounded once) on the pieces every
    rank of a D=8 group sums, bf16 and fp32, strided sources: the largest difference in units of
    the destination's rounding (0 on a GPU: both round the same fp32 sum to nearest; up to one
    bf16 ulp in Triton's interpreter, which truncates). Triton missing: reported, not run."""
    from megatron_tsp.core.layers import row_sum_kernel, triton_choice
    from megatron_tsp.core.layout import TSPLayout, sum_row_pieces

    if not triton_choice.triton_importable():
        return {"ran": False, "why": "triton not importable", "ulps": {}}
    g = torch.Generator().manual_seed(0)
    d, (b, n, dim) = 8, (1, 4, 128)
    seq = 2 * d * (512 if torch.device(device).type == "cuda" else 2)
    ulps = {}
    for dtype in (torch.bfloat16, torch.float32):
        worst = 0.0
        for rank in range(d):
            layout = TSPLayout(d, seq, rank)
            sources = []
            for block in layout.gathered_blocks:
                base = torch.randn(b, n, block.key_len, dim, generator=g).to(dtype).to(device)
                sources.append((block.key_start, base.permute(2, 0, 1, 3)))
            pieces = layout.key_pieces(seq, sources)
            out = torch.empty(seq, b, n, dim, dtype=dtype, device=device)
            row_sum_kernel.sum_rows_into(out, pieces)
            ref = sum_row_pieces(torch.empty_like(out), pieces).double()
            ulp = torch.finfo(dtype).eps * ref.abs().clamp_min(torch.finfo(dtype).tiny)
            worst = max(worst, ((out.double() - ref).abs() / ulp).max().item())
        ulps[str(dtype).split(".")[-1]] = worst
    return {
        "ran": True,
        "why": "",
        "ulps": ulps,
        "chosen_on_this_device": row_sum_kernel.available(torch.device(device), torch.bfloat16),
    }


def verify_activation_kernel(device) -> dict:
    """TSP's one-launch MLP activation backward (``activation_kernel``: Triton, the CUDA default)
    against Megatron's fused GeLU / SwiGLU formulas and torch's exact GeLU evaluated in fp64, bf16
    and fp32, from and into strided slots (a shard's columns of a [tokens, D, width] tensor): the
    worst error of the activation output and of d(fc1 output) relative to their terms' magnitude
    (one rounding is 2^-9 in bf16, 6e-8 in fp32). Triton missing: reported, not run."""
    from megatron.core.fusions import fused_bias_gelu, fused_bias_swiglu

    from megatron_tsp.core.layers import activation_kernel, triton_choice

    if not triton_choice.triton_importable():
        return {"ran": False, "why": "triton not importable", "errors": {}}
    g = torch.Generator().manual_seed(0)
    n, shards, f = (4096 if torch.device(device).type == "cuda" else 16), 4, 256
    errors = {}
    for kind in activation_kernel.KINDS:
        cols = 2 * f if kind == "swiglu" else f
        for dtype in (torch.bfloat16, torch.float32):
            pre = (torch.randn(n, shards, cols, generator=g) * 3).to(dtype).to(device)[:, 1]
            dh = torch.randn(n, f, generator=g).to(dtype).to(device)
            d_pre = torch.empty(n, shards, cols, dtype=dtype, device=device)[:, 2]
            hidden = torch.empty(n, f, dtype=dtype, device=device)
            activation_kernel.act_backward_into(kind, pre, dh, hidden, d_pre)
            x, gd = pre.double(), dh.double()
            if kind == "gelu":
                ref_h = torch.nn.functional.gelu(x)
                ref_d = torch.ops.aten.gelu_backward(gd, x)
            elif kind == "gelu_tanh":
                zero = x.new_zeros(())
                ref_h = fused_bias_gelu.bias_gelu(zero, x)
                ref_d = fused_bias_gelu.bias_gelu_back(gd, zero, x)
            else:
                ref_h, ref_d = fused_bias_swiglu.swiglu(x), fused_bias_swiglu.swiglu_back(gd, x)
            # the terms' magnitudes (as in tests/test_activation_kernel.py): fp32 loses digits
            # where 1 + erf / 1 + tanh cancel, as torch's own GeLU does
            ax, ag = x.abs(), gd.abs()
            if kind == "swiglu":
                a, b = ax.chunk(2, -1)
                terms = {"h": a * b, "d": torch.cat([ag * (1 + a) * b, ag * a], -1)}
            else:
                terms = {"h": ax, "d": ag * (1 + ax * (0.8 + 0.11 * ax * ax))}
            for name, got, ref in (("h", hidden, ref_h), ("d", d_pre, ref_d)):
                scale = (ref.abs() + terms[name]).clamp_min(1e-30)
                err = ((got.double() - ref).abs() / scale).max().item()
                errors[f"{kind} {str(dtype).split('.')[-1]} {name}"] = err
    return {
        "ran": True,
        "why": "",
        "errors": errors,
        "chosen_on_this_device": activation_kernel.available(torch.device(device), torch.bfloat16),
    }


def _check_case(device) -> dict:
    if device == "cpu":
        return dict(size=2, rank=1, chunk=8, head_dim=16, batch=2)
    return dict(size=4, rank=1, chunk=256, head_dim=128, batch=2)


def _backend_lines(bk: dict) -> list:
    case = bk["case"]
    lines = [
        "## attention backends, checked before timing",
        "",
        f"fp32 SDPA-math reference on the same inputs: D={case['size']}, rank {case['rank']} "
        f"(both zigzag chunks, bottom-right blocks), chunk {case['chunk']} tokens, head_dim "
        f"{case['head_dim']}, micro-batch {case['batch']}, GQA 4:2 (cuDNN: MHA); relative "
        f"errors, verified if all <= {bk['tolerance']:g}"
        + (f"; te_fused through the TE {bk['te_emulator']} emulator" if bk["te_emulator"] else ""),
        "",
        "| backend | out | lse | dq | dk | dv | verified |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in bk["checked"].items():
        if r["error"]:
            lines.append(f"| {name} | {r['error'][:120]} | | | | | no |")
            continue
        errs = [r["errors"].get(k) for k in ("out", "lse", "dq", "dk", "dv")]
        cells = " | ".join("n/a" if e is None else f"{e:.2e}" for e in errs)
        lines.append(f"| {name} | {cells} | {'yes' if r['verified'] else '**no**'} |")
    lines += ["", f"Timed with: **{bk['timed']}** (default choice: {bk['default']}).", ""]
    return lines


# --------------------------------------------------------------------------------------------
# report


def _gb(nbytes) -> str:
    return f"{nbytes / GB:.4g}"


def write_report(result: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    a, b = result["timing"], result["precision"]
    s = result["setup"]
    lines = [
        f"# gpu_check ({s['mode']})",
        "",
        f"{s['device_name']}, torch {s['torch']}, megatron-core {s['megatron_core']}; "
        f"h={s['hidden']}, heads={s['heads']}, FFN={s['ffn']}, S={s['seq']}, D={s['d']}, "
        f"micro-batch 1, {s['dtype']}, fake process group (no communication).",
        "",
        *_backend_lines(result["attention_backends"]),
        "## (a) one rank's layer step, forward + backward",
        "",
        "| scheme | step ms (median) | kernels / layer step | kernels' summed time ms "
        "| allocated before the step GB "
        "| step peak − before GB | fake-tensor prediction of it GB | persistent buffers GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, name in SCHEMES.items():
        r = a[key]
        fake = (
            "skipped (--skip-fake)"
            if r["fake_peak_bytes"] is None
            else f"{_gb(r['fake_peak_bytes'] - r['fake_before_step_bytes'])}"
        )
        lines.append(
            f"| {name} | {1e3 * r['step_s_median']:.2f} | {r['kernels_per_layer_step']}"
            f" | {1e3 * r['kernel_busy_s']:.2f}"
            f" | {_gb(r['memory_before_step_bytes'])} | {_gb(r['step_peak_bytes'])}"
            f" | {fake} | {_gb(r['workspace_bytes_after_step'])} |"
        )
    lines += [
        "",
        f"Memory ({a['tsp']['memory_measured_by']}) is the step's peak minus what was "
        "allocated before it; the persistent buffers (TSP's communication workspace) are "
        "allocated inside the measured step and counted in its peak.",
        "",
        f"TSP / TP+SP step time: **{a['ratio_tsp_over_tp_sp']:.3f}** ({a['tsp']['kernel_kind']}); "
        f"kernels' summed time: **{a['tsp']['kernel_busy_s'] / a['tp_sp']['kernel_busy_s']:.3f}** "
        "(a step far longer than its kernels' summed time is bound by the host).",
        "",
        f"FSDP x CP / TSP step time: **{a['ratio_fsdp_cp_over_tsp']:.3f}**; kernels' summed "
        f"time: **{a['fsdp_cp']['kernel_busy_s'] / a['tsp']['kernel_busy_s']:.3f}** (FSDP x "
        "CP's rank: whole weights on S/D tokens, attention over the gathered K/V; its weight "
        "all-gathers and gradient reduce-scatter are no-ops here).",
        *_top_kernel_lines(a),
        "",
        "## (b) TSP layer, bf16 vs fp32 (D=1)",
        "",
        "attention kernel: "
        + ", ".join(f"{k} {v}" for k, v in b.get("attention_kernels", {}).items()),
        "",
        "Each layer in bf16 against itself in fp32, same bf16-representable weights and data; "
        "Megatron's layer (local spec, SDPA core attention) beside TSP's.",
        "",
        "| tensor | TSP relative error | Megatron relative error | TSP / Megatron |",
        "|---|---|---|---|",
    ]
    megatron_errors = b.get("megatron_d1", {}).get("errors", {})
    for k, v in b["d1"].items():
        m = megatron_errors.get(k)
        ratio = f"{v / m:.3f}" if m else "-"
        lines.append(
            f"| {k} | {v:.3e} | {m:.3e} | {ratio} |" if m else f"| {k} | {v:.3e} | - | - |"
        )
    lines += ["", f"D>1: {b['d_gt_1']}", ""]
    lines += _triton_kernel_lines(
        "(c) TSP's one-kernel RoPE against the fp64 formula",
        result.get("rope_kernel", {}),
        "errors",
        "worst error relative to the terms' magnitude (one rounding: 2^-9 = 2.0e-03 in bf16)",
        ("case", "error", "{:.2e}"),
    )
    lines += _triton_kernel_lines(
        "(d) TSP's one-launch dK/dV row sum against its torch path",
        result.get("row_sum_kernel", {}),
        "ulps",
        "largest difference in units of the result's rounding (0 where both round to nearest)",
        ("dtype", "ulps", "{:.2f}"),
    )
    lines += _triton_kernel_lines(
        "(e) TSP's one-launch MLP activation backward against Megatron's formulas",
        result.get("activation_kernel", {}),
        "errors",
        "worst error relative to the terms' magnitude (one rounding: 2^-9 = 2.0e-03 in bf16)",
        ("case", "error", "{:.2e}"),
    )
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write("\n".join(lines))


def _triton_kernel_lines(title: str, check: dict, key: str, what: str, columns) -> list:
    """Report section of one of TSP's Triton kernel checks (``verify_rope_kernel``,
    ``verify_row_sum_kernel``, ``verify_activation_kernel``): the measured values by case, or why
    it did not run."""
    lines = [f"## {title}", ""]
    if not check.get("ran"):
        return lines + [f"not run: {check.get('why', '?')}", ""]
    name, value, fmt = columns
    return lines + [
        f"chosen by the layers on this device: {check['chosen_on_this_device']}; {what}:",
        "",
        f"| {name} | {value} |",
        "|---|---|",
        *[f"| {k} | {fmt.format(v)} |" for k, v in check[key].items()],
        "",
    ]


def _top_kernel_lines(a: dict) -> list:
    lines = []
    for key, name in SCHEMES.items():
        lines += [
            "",
            f"{name}: kernels by summed time in the profiled step",
            "",
            "| kernel | launches | ms |",
            "|---|---|---|",
        ]
        for k in a[key].get("top_kernels_by_time", []):
            label = markdown_kernel_name(k["kernel"], 80)
            lines.append(f"| `{label}` | {k['launches']} | {1e3 * k['s']:.2f} |")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny shapes on CPU, same code path (used by tests/test_gpu_check.py)",
    )
    p.add_argument(
        "--seq",
        type=int,
        default=None,
        help="sequence length (default 131072; 64 with --cpu-smoke)",
    )
    p.add_argument(
        "--iters", type=int, default=None, help="timed steps (default 3; 2 with --cpu-smoke)"
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--d",
        type=int,
        default=None,
        help="group size D (TSP) = TP size (TP+SP) (default 8; 2 with --cpu-smoke)",
    )
    p.add_argument("--skip-fake", action="store_true", help="skip the fake-tensor prediction")
    p.add_argument(
        "--timed-backend",
        default=None,
        help="time the TSP layers with this attention backend (it must pass the check); "
        "default: the layer's default choice",
    )
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="also write host_profile_<scheme>.txt: cProfile of one layer step (Python time)",
    )
    p.add_argument(
        "--te-emulator",
        choices=("2.8", "2.15"),
        default=None,
        help="with --cpu-smoke: also check te_fused through the Transformer Engine contract "
        "emulator of this TE signature (tests/emulators)",
    )
    args = p.parse_args(argv)
    for flag, value, least in (
        ("--d", args.d, 1),
        ("--iters", args.iters, 1),
        ("--seq", args.seq, 2),
    ):
        if value is not None and value < least:
            p.error(f"{flag}={value}: must be at least {least}")
    if args.warmup < 0:
        p.error(f"--warmup={args.warmup}: must be at least 0")
    return args


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    args = parse_args(argv)
    if args.te_emulator and not args.cpu_smoke:
        print("--te-emulator is a CPU stand-in for TE: use it with --cpu-smoke", file=sys.stderr)
        return 2
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke on a CPU machine", file=sys.stderr)
        return 2
    device, model = device_and_model(args.cpu_smoke)
    if args.cpu_smoke:
        seq, d, iters = args.seq or 64, args.d or 2, args.iters or 2
    else:
        seq, d, iters = args.seq or 131072, args.d or 8, args.iters or 3
    problems = layout_problems(model, seq, d)
    if problems:
        print("gpu_check: " + "; ".join(problems), file=sys.stderr)
        return 2
    if args.cpu_smoke:
        from megatron_tsp.megatron_lm.cpu_support import enable_cpu_support

        enable_cpu_support()
    dtype = torch.bfloat16
    t0 = time.time()
    backends = verify_attention_backends(model, device, dtype, args.te_emulator, args.timed_backend)
    print(
        "[backends]",
        {n: (r["verified"], r["error"] or r["errors"]) for n, r in backends["checked"].items()},
        "-> timing",
        backends["timed"],
        flush=True,
    )
    rope = verify_rope_kernel(device)
    print("[rope kernel]", rope, flush=True)
    row_sum = verify_row_sum_kernel(device)
    print("[row-sum kernel]", row_sum, flush=True)
    activation = verify_activation_kernel(device)
    print("[activation kernel]", activation, flush=True)
    timing = {}
    for scheme in SCHEMES:
        profile_path = None
        if args.host_profile:
            os.makedirs(args.out_dir, exist_ok=True)
            profile_path = os.path.join(args.out_dir, f"host_profile_{scheme}.txt")
        timing[scheme] = time_scheme(
            scheme, d, model, seq, dtype, device, iters, args.warmup, profile_path
        )
        timing[scheme]["fake_peak_bytes"] = timing[scheme]["fake_before_step_bytes"] = None
        if not args.skip_fake:
            fk = _fake_peak(scheme, d, model, seq, dtype, device)
            timing[scheme]["fake_peak_bytes"] = fk["peak_bytes"]
            timing[scheme]["fake_before_step_bytes"] = fk["before_step_bytes"]
            timing[scheme]["fake_peak_by_category"] = fk["by_category"]
        print(
            f"[a] {scheme}: {1e3 * timing[scheme]['step_s_median']:.2f} ms, "
            f"{timing[scheme]['kernels_per_layer_step']} kernels "
            f"(busy {1e3 * timing[scheme]['kernel_busy_s']:.2f} ms), "
            f"step peak - before {timing[scheme]['step_peak_bytes']}, "
            f"fake {timing[scheme]['fake_peak_bytes']} - "
            f"{timing[scheme]['fake_before_step_bytes']}",
            flush=True,
        )
    if timing["tsp"]["attention_kernel"] != backends["timed"]:
        raise RuntimeError(
            f"the TSP layer ran {timing['tsp']['attention_kernel']}, not the verified "
            f"{backends['timed']} it was pinned to"
        )
    timing["ratio_tsp_over_tp_sp"] = (
        timing["tsp"]["step_s_median"] / timing["tp_sp"]["step_s_median"]
    )
    timing["ratio_fsdp_cp_over_tsp"] = (
        timing["fsdp_cp"]["step_s_median"] / timing["tsp"]["step_s_median"]
    )
    prec_seq = seq if args.cpu_smoke else min(seq, 8192)
    errors, kernels_used, megatron = precision_check(model, prec_seq, device)
    precision = {
        "d1": errors,
        "attention_kernels": kernels_used,
        "megatron_d1": megatron,
        "seq": prec_seq,
        "d_gt_1": "not run on one GPU: torch's threaded process group implements no "
        "isend/irecv/reduce (the MLP ring and the attention owner reduce "
        "need them); D=4 bf16 vs TP+SP is tests/test_precision.py (CPU)",
    }
    print(
        "[b] bf16 vs fp32 (D=1), TSP error / Megatron error:",
        {
            k: f"{v:.2e} / {precision['megatron_d1']['errors'].get(k, float('nan')):.2e}"
            for k, v in precision["d1"].items()
        },
        flush=True,
    )
    try:
        import megatron.core as mc

        core_version = getattr(mc, "__version__", "?")
    except Exception:  # pragma: no cover
        core_version = "?"
    result = {
        "setup": {
            "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
            "device": device,
            "device_name": (
                torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
            ),
            "torch": torch.__version__,
            "megatron_core": core_version,
            "hidden": model.hidden,
            "heads": model.heads,
            "ffn": model.ffn_hidden,
            "seq": seq,
            "d": d,
            "dtype": "bf16",
            "iters": iters,
            "wall_s": None,
        },
        "attention_backends": backends,
        "rope_kernel": rope,
        "row_sum_kernel": row_sum,
        "activation_kernel": activation,
        "timing": timing,
        "precision": precision,
    }
    result["setup"]["wall_s"] = round(time.time() - t0, 1)
    write_report(result, args.out_dir)
    print(f"wrote {args.out_dir}/gpu_check.md and gpu_check.json ({result['setup']['wall_s']} s)")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
