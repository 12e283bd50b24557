"""Memory traffic, kernel launches and FLOPs of one rank's transformer layer, op by op (no GPU).

``megatron-tsp bench --traffic`` builds one transformer layer of a model for one rank of a TSP
group and of Megatron TP+SP (both of size D), at full shapes, on shape-only CUDA tensors
(``FakeTensorMode`` with ``device="cuda"`` fake tensors, torch's ``fake`` process group: every
collective returns at once), runs its forward and backward once, and records every aten op the
layer issues with a ``TorchDispatchMode``. Per op it counts:

* **kernel launches** - an op is a kernel unless it only changes metadata or allocates:
  aliasing views (``OpOverload.is_view``: view, t, transpose, slice, select, expand, split, ...),
  metadata-only ops (``_unsafe_view``, ``detach``, ``alias``, in-place ``t_`` / ``squeeze_`` /
  ``as_strided_`` ...) and uninitialised allocations (``empty*``, ``new_empty*``,
  ``resize_``). Everything else is one launch (``zeros`` and ``fill_`` are memsets, ``copy_`` and
  ``_to_copy`` are copy kernels). Collectives (``c10d``) are counted apart, not as kernels, and
  so is host work: an op none of whose tensors is on the CUDA device (index tables the layers
  build on the CPU with ``arange`` / ``cat`` / ``index_put_``; their upload is a ``_to_copy``,
  counted apart from the kernels: a GPU uploads each table once and caches it,
  ``CACHED_UPLOAD_SOURCES``), and so is the work one layer does for the whole step
  (``PER_STEP_SOURCES``: TSP's RoPE tables).
* **bytes read + written** - reads: every tensor input argument (not the ``out=`` argument, but
  an input that is also the ``out=`` tensor, as in ``addmm(acc, a, b, out=acc)``); writes:
  every tensor the op returns (an in-place op returns the tensor it mutates, so ``x.add_(y)``
  reads x and y and writes x: x counts twice). Ops that overwrite their destination without
  reading it (``copy_``, ``fill_``, ``zero_``, ``index_copy_``) do not count it as read; gathers
  (``index_select``, ``embedding``, ``gather``, ``index``) read as many source bytes as they
  write. A tensor's bytes are its distinct elements (broadcast, stride-0 dims count once) times
  its element size; only device tensors count (an upload reads host memory, not HBM). Views,
  metadata ops, host ops and collectives count 0.
* **FLOPs** - GEMMs (mm, addmm, bmm, baddbmm and their out / in-place / dtype forms):
  2 m n k; attention kernels: 2 b h (d_qk + d_v) per visited (query, key) pair forward and
  2 b h (3 d_qk + 2 d_v) backward (the scores are recomputed), the pairs a causal kernel visits
  with its own alignment (flash: bottom-right; cuDNN: top-left). The GEMM FLOPs are checked
  exactly against 2 x tokens x parameters of the layer's linear layers (forward, and twice that
  backward, plus the recomputed fc1 where the layer recomputes it).

Megatron's RoPE (the TP+SP baseline's) is recorded as on a Transformer Engine box by default:
megatron-core's fused path (``apply_rope_fusion``) runs, with TE's kernel stood in by one custom
op per tensor (q, k) and direction (``fused_rope_standin``: forward reads the tensor and the fp32
angles and writes the result, one launch; backward the inverse rotation, likewise);
``--unfused-rope`` records Megatron's unfused RoPE instead. TSP applies its own RoPE kernel.

The report splits every scheme's bytes into a length-independent part and a part per token
(fitted from the shortest and the longest length, checked at the others or at one more recorded
for the check), beside TSP's floor for the former (``tsp_weight_floor``). ``--flash-tiles BR,BC``
adds a view that charges a tiled flash kernel's re-reads (``flash_tile_rereads``) beside the
per-call rule, which stays the rule the bytes budget is measured by.

``--documents MIX [--draw-seed N]`` records packed documents: one document set per micro-batch
sample drawn from MIX (``tools/estimator/documents.py``'s specs and draws). TSP's layer gets them
as ``get_batch_on_this_tsp_rank`` hands them over (``DocumentMask.to_tensor()`` in the
``attention_mask`` slot) and runs its document path (natural-order K/V copy per head group, one
bottom-right call per (chunk, document) segment). TP+SP runs them as Megatron does on a
Transformer Engine box, a THD batch: TE's variable-length flash attention stood in by one custom
op per direction (``varlen_flash_standin``), whose FLOPs are the per-pair rule over the
in-document pairs of its ``cu_seqlens``. One document per sample records what the layer records
without the flag. The report adds per scheme the documents, TSP's segments, the attention calls,
FLOPs against the in-document pairs, TSP's natural-order K/V copy bytes and every TSP rank's
pairs; the length-independent split is left out (each length draws other documents) and
``--flash-tiles`` is refused (the stand-in has no tile geometry).

The measurement needs the stand-in CUDA device of :mod:`megatron_tsp.tools.cuda_standin`, which
must be loaded before torch: it runs in a fresh interpreter (:func:`measure_isolated`).
What is recorded is the layer only: the RoPE table is computed once before (as ``GPTModel``
does once per step), the output gradient is given, and weight gradients land in ``.grad`` (no DDP
``main_grad`` buffer, for both schemes alike).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Sequence

from megatron_tsp.console.args import (
    ToolParser,
    UsageError,
    from_value_error,
    non_negative_int,
    positive_int,
    positive_int_list,
)

# fsdp_cp / fsdp_cp_ring: ZeRO-3 x CP over the N ranks (``traffic_fsdp_cp``), K/V all-gathered or
# on TE's P2P ring
SCHEMES = ("tsp", "tp_sp", "fsdp_cp", "fsdp_cp_ring")
DEFAULT_SCHEMES = ("tsp", "tp_sp")  # what the report compares unless --schemes says otherwise
LABELS = {"tsp": "TSP", "tp_sp": "TP+SP", "fsdp_cp": "FSDPxCP", "fsdp_cp_ring": "FSDPxCP ring"}
GB = 1e9
# the schemes ``--documents`` records (FSDP x CP's packed documents are not stood in)
DOCUMENT_SCHEMES = ("tsp", "tp_sp")
# the bytes budget the report measures against: TSP's layer within 1.15x TP+SP's
BYTES_BUDGET = 1.15
# the flash-tiles view's query and key tile rows (Br, Bc): 128 x 128, a usual flash tile for head
# dim 128 (``--flash-tiles BR,BC`` picks others)
FLASH_TILES = (128, 128)

# ops that are not kernels: metadata-only, allocation without initialisation
NOT_KERNELS = frozenset(
    {
        "_unsafe_view",
        "detach",
        "detach_",
        "alias",
        "lift_fresh",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "resize_",
        "resize_as_",
        "set_",
        "as_strided_",
        "t_",
        "transpose_",
        "squeeze_",
        "unsqueeze_",
        "_reshape_alias",
        "record_stream",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_same_size",
        "_has_compatible_shallow_copy_type",
    }
)
# in-place / out ops that overwrite their destination without reading it
OVERWRITES = frozenset({"copy_", "fill_", "zero_", "index_copy_", "normal_", "uniform_"})
# custom ops that return nothing and write their mutated arguments without reading them (TSP's
# Triton kernels: ``megatron_tsp.rope`` writes ``out``, ``sum_rows`` ``dest``, ``mlp_act_backward``
# ``hidden_out`` and ``d_pre_out``)
WRITE_ONLY_MUTATED = frozenset({"rope", "sum_rows", "mlp_act_backward"})
# gathers: they read as many source bytes as they write (plus the index)
GATHERS = frozenset({"index_select", "embedding", "gather", "index"})
GEMMS = frozenset({"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "_scaled_mm"})
FLASH = frozenset({"_scaled_dot_product_flash_attention", "_flash_attention_forward"})
FLASH_BWD = frozenset({"_scaled_dot_product_flash_attention_backward", "_flash_attention_backward"})
CUDNN = frozenset({"_scaled_dot_product_cudnn_attention"})
CUDNN_BWD = frozenset({"_scaled_dot_product_cudnn_attention_backward"})
# top-left causal alignment, like cuDNN: memory-efficient attention (SDPA's fallback on CUDA) and
# the CPU flash kernel (``--cpu-smoke`` runs of the GPU scripts record on CPU)
OTHER_SDPA = frozenset(
    {"_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu"}
)
OTHER_SDPA_BWD = frozenset(
    {
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    }
)
# TP+SP's packed documents: the variable-length (THD) flash kernel, stood in by one custom op per
# direction (``varlen_flash_standin``); its FLOPs are the in-document causal pairs of its
# ``cu_seqlens`` (an int list argument: shape-only tensors hold no values)
VARLEN = frozenset({"varlen_flash"})
VARLEN_BWD = frozenset({"varlen_flash_backward"})


# --------------------------------------------------------------------------------------------
# the counting rule


@dataclass
class OpRecord:
    """One aten op as the recorder saw it."""

    name: str  # overload packet name, e.g. "addmm"
    phase: str  # "forward" | "backward"
    kind: str  # "kernel" | "view" (metadata / allocation) | "collective" | "host"
    read: int = 0
    written: int = 0
    flops: int = 0
    flop_kind: str = ""  # "gemm" | "attention" | ""
    source: str = ""  # the innermost Megatron / megatron_tsp function that issued it
    # attention kernels: their geometry, for the flash-tiles view (``attention_geometry``)
    attention: Dict[str, int] = field(default_factory=dict)
    # collectives: the bytes of their larger buffer (an all-gather's output, a reduce-scatter's
    # input, a P2P message); not HBM bytes of the counting rule
    comm_bytes: int = 0

    @property
    def bytes(self) -> int:
        return self.read + self.written


def tensor_bytes(t) -> int:
    """Distinct elements times element size (a broadcast, stride-0 dimension counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= int(size)
    return n * t.element_size()


def _tensors(x):
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


def _unique(tensors):
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _out_arguments(func, args, kwargs) -> List:
    """Tensors passed as ``out=`` arguments (written, not read)."""
    outs = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.is_out:
            value = kwargs.get(arg.name, args[i] if i < len(args) else None)
            outs += _tensors(value)
    return outs


def _mutated_arguments(func, args, kwargs) -> List:
    """Tensors of the arguments the op's schema marks as written (``Tensor(a!)``)."""
    found = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = kwargs[arg.name] if arg.name in kwargs else args[i] if i < len(args) else None
            found += _tensors(value)
    return found


def _input_arguments(func, args, kwargs) -> List:
    """Tensors passed in the op's input (non-``out=``) arguments."""
    ins = []
    for i, arg in enumerate(func._schema.arguments):
        if not arg.is_out:
            ins += _tensors(
                kwargs[arg.name] if arg.name in kwargs else args[i] if i < len(args) else None
            )
    return ins


def _gemm_flops(name: str, args) -> int:
    import torch

    mats = [a for a in args if isinstance(a, torch.Tensor)]
    a, b = (mats[1], mats[2]) if name in ("addmm", "addmm_", "baddbmm", "baddbmm_") else mats[:2]
    batch = 1
    for s in a.shape[:-2]:
        batch *= int(s)
    return 2 * batch * int(a.shape[-2]) * int(a.shape[-1]) * int(b.shape[-1])


def visited_pairs(lq: int, lk: int, causal: bool, bottom_right: bool) -> int:
    """(query, key) pairs a causal attention kernel visits."""
    if not causal:
        return lq * lk
    if bottom_right:  # query i sees keys [0, lk - lq + i]
        if lq <= lk:
            return lq * (lk - lq) + lq * (lq + 1) // 2
        return lk * (lk + 1) // 2
    if lq <= lk:  # top-left: query i sees keys [0, i]
        return lq * (lq + 1) // 2
    return lk * (lk + 1) // 2 + (lq - lk) * lk


def _attention_flops(name: str, args, kwargs) -> int:
    """[b, h, s, d] layouts (SDPA's); causal flag at the schema's ``is_causal``."""
    if name in FLASH | CUDNN | OTHER_SDPA:
        q, k, v = args[0], args[1], args[2]
    else:  # backward: grad_out, q, k, v, ...
        q, k, v = args[1], args[2], args[3]
    causal = bool(_argument(name, args, kwargs, "is_causal"))
    b, h, lq, d = (int(s) for s in q.shape)
    lk, dv = int(k.shape[2]), int(v.shape[3])
    pairs = visited_pairs(lq, lk, causal, bottom_right=name in FLASH | FLASH_BWD)
    per_pair = (d + dv) if name in FLASH | CUDNN | OTHER_SDPA else (3 * d + 2 * dv)
    return 2 * b * h * pairs * per_pair


def _varlen_flops(name: str, args) -> int:
    """The varlen stand-in (``varlen_flash_standin``): q, k, v [s, b, h, d] (the b x s tokens
    packed as one THD sequence), ``cu_seqlens`` an int list; per in-document causal pair
    2 h (d_qk + d_v) forward and 2 h (3 d_qk + 2 d_v) backward, as for the dense kernels."""
    if name in VARLEN:
        q, v, cu = args[0], args[2], args[3]
    else:  # backward: grad_out, q, k, v, out, lse, cu_seqlens, scale
        q, v, cu = args[1], args[3], args[6]
    h, d, dv = int(q.shape[2]), int(q.shape[3]), int(v.shape[3])
    pairs = sum((b - a) * (b - a + 1) // 2 for a, b in zip(cu, cu[1:]))
    per_pair = (d + dv) if name in VARLEN else (3 * d + 2 * dv)
    return 2 * h * pairs * per_pair


def attention_geometry(name: str, args, kwargs) -> Dict[str, int]:
    """What the flash-tiles view needs of an attention kernel ([b, h, s, d] layouts): batch,
    query / key-value heads, lengths, head dims, element size, causal alignment, and the bytes
    the per-call rule charged for the operands a tiled kernel re-reads (K and V forward; Q and
    the output gradient backward)."""
    forward = name in FLASH | CUDNN | OTHER_SDPA
    q, k, v = (args[0], args[1], args[2]) if forward else (args[1], args[2], args[3])
    once = tensor_bytes(k) + tensor_bytes(v) if forward else tensor_bytes(q) + tensor_bytes(args[0])
    return {
        "forward": int(forward),
        "batch": int(q.shape[0]),
        "heads": int(q.shape[1]),
        "lq": int(q.shape[2]),
        "lk": int(k.shape[2]),
        "d_qk": int(q.shape[3]),
        "d_v": int(v.shape[3]),
        "itemsize": q.element_size(),
        "causal": int(bool(_argument(name, args, kwargs, "is_causal"))),
        "bottom_right": int(name in FLASH | FLASH_BWD),
        "charged_once": once,
    }


def _ceil_to(n: int, tile: int) -> int:
    return -(-n // tile) * tile


def flash_tile_rereads(geom: Dict[str, int], br: int, bc: int) -> int:
    """Bytes a tiled flash-attention kernel reads beyond the per-call rule (which reads every
    operand once), FlashAttention-2's loop order, whole tiles loaded, no cache reuse:

    * forward: each query tile of ``br`` rows reads the K and V rows of every key tile (``bc``
      keys) it attends to: ``b h (d_qk + d_v) e sum_i keys_i``, keys_i = the keys the tile's last
      row sees, rounded up to a multiple of ``bc`` (at most Lk);
    * backward: each key tile of ``bc`` keys reads the Q and dO rows of every query tile that
      attends to it: ``b h (d_qk + d_v) e sum_j queries_j``, queries_j = Lq minus the start of
      the first query tile with a row that sees the tile's first key;

    less what the per-call rule charged for those operands (K + V, or Q + dO, once). h = query
    heads (each query head re-reads its K/V head under GQA), e = element size. Not charged: the
    backward's fp32 dQ accumulation and per-row statistics."""
    b, h, lq, lk = geom["batch"], geom["heads"], geom["lq"], geom["lk"]
    causal, br_align = geom["causal"], geom["bottom_right"]
    shift = lk - lq if br_align else 0  # row r sees keys [0, r + shift] when causal
    rows = 0
    if geom["forward"]:
        for start in range(0, lq, br):
            last = min(start + br, lq) - 1
            seen = min(lk, max(0, last + shift + 1)) if causal else lk
            rows += min(lk, _ceil_to(seen, bc))
    else:
        for k0 in range(0, lk, bc):
            first = max(0, k0 - shift) if causal else 0
            if first < lq:
                rows += lq - (first // br) * br
    return b * h * (geom["d_qk"] + geom["d_v"]) * geom["itemsize"] * rows - geom["charged_once"]


_SCHEMAS: Dict[str, object] = {}


def _argument(name, args, kwargs, arg_name):
    schema = _SCHEMAS[name]
    for i, arg in enumerate(schema.arguments):
        if arg.name == arg_name:
            if arg_name in kwargs:
                return kwargs[arg_name]
            return args[i] if i < len(args) else arg.default_value
    raise KeyError(f"{name} has no argument {arg_name!r}")


def op_record(func, args, kwargs, out, phase: str, device_type: str = "cuda") -> OpRecord:
    """The counting rule (see the module docstring) for one dispatched op; an op none of whose
    tensors is on ``device_type`` is host work (``kind="host"``, no kernel, no bytes)."""
    name = func.overloadpacket.__name__
    namespace = func.namespace
    if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
        buffers = _unique(_tensors(list(args)) + _tensors(list(kwargs.values())))
        return OpRecord(
            name, phase, "collective", comm_bytes=max(map(tensor_bytes, buffers), default=0)
        )
    if namespace == "prim" or func.is_view or name in NOT_KERNELS:  # prim.device: metadata
        return OpRecord(name, phase, "view")
    outs = _out_arguments(func, args, kwargs)
    # an input that is also the out= tensor (``addmm(acc, a, b, out=acc)``) is still read
    inputs = _unique(_input_arguments(func, args, kwargs))
    results = _unique(_tensors(out))
    if not func._schema.returns:  # a custom op that returns nothing writes what it mutates
        mutated = _mutated_arguments(func, args, kwargs)
        results = _unique(results + mutated)
        if name in WRITE_ONLY_MUTATED:
            inputs = [t for t in inputs if all(t is not m for m in mutated)]
    if not any(t.device.type == device_type for t in inputs + results + outs):
        return OpRecord(name, phase, "host")
    # device memory only: a host tensor an op uploads or downloads crosses PCIe, not HBM
    inputs = [t for t in inputs if t.device.type == device_type]
    results = [t for t in results if t.device.type == device_type]
    if name in OVERWRITES:  # the destination (first argument) is written, not read
        inputs = [t for t in inputs if t is not args[0]]
    written = sum(tensor_bytes(t) for t in results)
    if name in GATHERS:
        source = args[1] if name == "embedding" else args[0]
        read = sum(tensor_bytes(t) for t in inputs if t is not source) + written
    else:
        read = sum(tensor_bytes(t) for t in inputs)
    rec = OpRecord(name, phase, "kernel", read=read, written=written)
    if name in GEMMS:
        rec.flops, rec.flop_kind = _gemm_flops(name, args), "gemm"
    elif name in FLASH | FLASH_BWD | CUDNN | CUDNN_BWD | OTHER_SDPA | OTHER_SDPA_BWD:
        _SCHEMAS.setdefault(name, func._schema)
        rec.flops, rec.flop_kind = _attention_flops(name, args, kwargs), "attention"
        rec.attention = attention_geometry(name, args, kwargs)
    elif name in VARLEN | VARLEN_BWD:
        rec.flops, rec.flop_kind = _varlen_flops(name, args), "attention"
    elif "attention" in name:
        raise NotImplementedError(f"no FLOP formula for attention op {func}; add one")
    return rec


_SOURCE_DIRS = (os.sep + "megatron_tsp" + os.sep, os.sep + "megatron" + os.sep)
_SKIP = os.path.abspath(__file__)


def _source(frame) -> str:
    """``module.function`` of the innermost frame in Megatron or megatron_tsp (this file
    excluded); "autograd" for the backward of a built-in op, which runs in the C++ engine."""
    while frame is not None:
        path = frame.f_code.co_filename
        if path != _SKIP and any(d in path for d in _SOURCE_DIRS):
            module = os.path.splitext(os.path.basename(path))[0]
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "autograd"


def make_recorder(device_type: str = "cuda"):
    """A ``TorchDispatchMode`` appending one :class:`OpRecord` per aten op to ``.records``;
    kernels are the ops on ``device_type`` (the rest is host work)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class TrafficRecorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.records: List[OpRecord] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            rec = op_record(func, args, kwargs, out, phase, device_type)
            rec.source = _source(sys._getframe(1))
            if rec.kind == "kernel" and rec.source in CACHED_UPLOAD_SOURCES:
                rec.kind = "cached_upload"
            elif rec.kind == "kernel" and rec.source in PER_STEP_SOURCES:
                rec.kind = "per_step"
            self.records.append(rec)
            return out

    return TrafficRecorder()


# --------------------------------------------------------------------------------------------
# summary


# The layout's index tables (zigzag permutations, gathered K/V rows) are uploaded once per shape
# and device and cached (``layout._table``); a copy made under FakeTensorMode is not cached, so
# every recorded step would pay the first step's uploads. They are counted apart, not as the
# step's kernels.
CACHED_UPLOAD_SOURCES = ("layout._table", "traffic_fsdp_cp.reorder_indices")
# Work the first layer of a step does for every layer: TSP's local RoPE tables (cos and signed
# sines at the rank's positions, ``rope._build``), cached on the step's rotary embedding. The
# recording is one layer, so they are counted apart, as TP+SP's rotary table (``GPTModel``'s,
# built before the recording) is.
PER_STEP_SOURCES = ("rope._build",)


def summarize(
    records: Sequence[OpRecord], top: int = 8, flash_tiles: Sequence[int] = FLASH_TILES
) -> Dict[str, object]:
    """Totals, by phase, the top ops (by name) by bytes, and the flash-tiles view (the
    attention kernels' re-reads with query / key tiles of ``flash_tiles`` = (Br, Bc) rows)."""
    kernels = [r for r in records if r.kind == "kernel"]
    by_op: Dict[str, Dict[str, int]] = {}
    for r in kernels:
        e = by_op.setdefault(r.name, {"launches": 0, "bytes": 0, "read": 0, "written": 0})
        e["launches"] += 1
        e["bytes"] += r.bytes
        e["read"] += r.read
        e["written"] += r.written
    out = {
        "kernels": len(kernels),
        "bytes_read": sum(r.read for r in kernels),
        "bytes_written": sum(r.written for r in kernels),
        "collectives": sum(r.kind == "collective" for r in records),
        "views": sum(r.kind == "view" for r in records),
        "host_ops": sum(r.kind == "host" for r in records),
        "cached_uploads": sum(r.kind == "cached_upload" for r in records),
        "per_step_kernels": sum(r.kind == "per_step" for r in records),
        "gemm_flops": sum(r.flops for r in kernels if r.flop_kind == "gemm"),
        "attention_flops": sum(r.flops for r in kernels if r.flop_kind == "attention"),
        "by_phase": {},
        "top_ops": sorted(({"op": k, **v} for k, v in by_op.items()), key=lambda e: -e["bytes"])[
            :top
        ],
    }
    by_source: Dict[str, Dict[str, int]] = {}
    for r in kernels:
        e = by_source.setdefault(r.source, {"launches": 0, "bytes": 0})
        e["launches"] += 1
        e["bytes"] += r.bytes
    out["top_sources"] = sorted(
        ({"source": k, **v} for k, v in by_source.items()), key=lambda e: -e["launches"]
    )[:top]
    out["bytes_by_source"] = {k: v["bytes"] for k, v in by_source.items()}
    out["bytes"] = out["bytes_read"] + out["bytes_written"]
    out["flops"] = out["gemm_flops"] + out["attention_flops"]
    br, bc = flash_tiles
    rereads = {p: 0 for p in ("forward", "backward")}
    for r in kernels:
        if r.attention:
            rereads[r.phase] += flash_tile_rereads(r.attention, br, bc)
    out["flash_tiles"] = {"br": br, "bc": bc, "rereads": sum(rereads.values()), **rereads}
    for phase in ("forward", "backward"):
        rs = [r for r in kernels if r.phase == phase]
        out["by_phase"][phase] = {
            "kernels": len(rs),
            "bytes": sum(r.bytes for r in rs),
            "gemm_flops": sum(r.flops for r in rs if r.flop_kind == "gemm"),
            "attention_flops": sum(r.flops for r in rs if r.flop_kind == "attention"),
        }
    return out


# --------------------------------------------------------------------------------------------
# one layer of one rank


@dataclass
class TrafficConfig:
    model: str = "7b"  # a name under megatron_tsp/models or a JSON path
    seq: int = 32768
    world_size: int = 8  # D
    micro_batch: int = 1
    dtype: str = "bf16"
    schemes: List[str] = field(default_factory=lambda: list(DEFAULT_SCHEMES))
    top: int = 8
    # TSP: the activation sums over shards in fp32 (--tsp-activation-sums-in-fp32)
    activation_sums_fp32: bool = False
    # the baselines' RoPE: Megatron's fused path (``apply_rope_fusion``, Transformer Engine's
    # kernel stood in by one recorded op per tensor and direction: ``fused_rope_standin``);
    # False: Megatron's unfused RoPE (``--unfused-rope``)
    rope_fusion: bool = True
    # the flash-tiles view's (Br, Bc)
    flash_tiles: List[int] = field(default_factory=lambda: list(FLASH_TILES))
    # packed documents (``--documents``): per micro-batch sample its document lengths (summing
    # to ``seq``); None: one causal document per sample, as without the flag
    documents: List[List[int]] | None = None


def linear_params_per_rank(shape, d: int) -> Dict[str, int]:
    """Weights of the layer's linear layers on one rank (1/D of each)."""
    h, hd = shape.hidden, shape.hidden // shape.heads
    qkv = h * (shape.heads + 2 * shape.groups) * hd
    proj = shape.heads * hd * h
    fc1 = h * shape.ffn_hidden * (2 if shape.gated else 1)
    fc2 = shape.ffn_hidden * h
    return {"qkv": qkv // d, "proj": proj // d, "fc1": fc1 // d, "fc2": fc2 // d}


def _to_cuda(module) -> None:
    """Move parameters and buffers to the CUDA fake device, keeping the Parameter attributes
    Megatron tags (``Module.to`` would swap the fake tensors in place, which they refuse)."""
    import torch

    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.device.type != "cuda":
                q = torch.nn.Parameter(p.detach().to("cuda"), requires_grad=p.requires_grad)
                # Megatron's tags only: a FakeTensor keeps its own state (its device) there too
                q.__dict__.update({k: v for k, v in p.__dict__.items() if k not in q.__dict__})
                m._parameters[name] = q
        for name, b in list(m._buffers.items()):
            if b is not None and b.device.type != "cuda":
                m._buffers[name] = b.to("cuda")


# The baselines' fused RoPE: Megatron's ``apply_rope_fusion`` path calls
# ``rope_utils.fused_apply_rotary_pos_emb`` (Transformer Engine's kernel, which this machine cannot
# install) once per tensor. The recording stands one custom op in for it, with TE's contract:
# forward reads t [s, b, h, d] and the fp32 angles freqs [s, 1, 1, d] (cos and sin computed in
# the kernel), writes the rotated tensor, one launch; backward reads the output gradient and
# freqs, writes the input gradient (the inverse rotation), one launch.
FUSED_ROPE_OPS = ("fused_rope", "fused_rope_backward")
_FUSED_ROPE: List[object] = []


def fused_rope_standin():
    """``fused_apply_rotary_pos_emb(t, freqs, transpose_output_memory=False, interleaved=False)``
    (megatron-core's signature) on one ``megatron_tsp_traffic::fused_rope`` op, whose autograd
    backward is one ``megatron_tsp_traffic::fused_rope_backward`` op. Both compute the rotation
    in fp32 with one rounding where the tensors are real; on fake tensors they only allocate."""
    if _FUSED_ROPE:
        return _FUSED_ROPE[0]
    import torch

    def rotate(t, freqs, interleaved: bool, sign: float):
        x, f = t.float(), freqs[: t.shape[0]].float()
        cos, sin = f.cos(), sign * f.sin()
        if interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
        else:
            x1, x2 = x.chunk(2, dim=-1)
            rot = torch.cat((-x2, x1), dim=-1)
        return (x * cos + rot * sin).to(t.dtype)

    # explicit schemas: this module's annotations are strings (``from __future__``)
    schema = "(Tensor t, Tensor freqs, bool interleaved) -> Tensor"

    @torch.library.custom_op("megatron_tsp_traffic::fused_rope", mutates_args=(), schema=schema)
    def fused_rope(t, freqs, interleaved):
        return rotate(t, freqs, interleaved, 1.0)

    @fused_rope.register_fake
    def _(t, freqs, interleaved):
        return t.new_empty(t.shape)

    @torch.library.custom_op(
        "megatron_tsp_traffic::fused_rope_backward", mutates_args=(), schema=schema
    )
    def fused_rope_backward(t, freqs, interleaved):
        return rotate(t, freqs, interleaved, -1.0)  # the transpose: rotation by -angle

    @fused_rope_backward.register_fake
    def _(grad, freqs, interleaved):
        return grad.new_empty(grad.shape)

    def setup_context(ctx, inputs, output):
        ctx.freqs, ctx.interleaved = inputs[1], inputs[2]

    def backward(ctx, grad):
        ops = torch.ops.megatron_tsp_traffic
        return ops.fused_rope_backward(grad, ctx.freqs, ctx.interleaved), None, None

    fused_rope.register_autograd(backward, setup_context=setup_context)

    def fused_apply_rotary_pos_emb(t, freqs, transpose_output_memory=False, interleaved=False):
        # the rows of the table the sequence uses (a view), as TE's kernel reads them
        freqs = freqs.narrow(0, 0, t.shape[0])
        return torch.ops.megatron_tsp_traffic.fused_rope(t, freqs, interleaved)

    _FUSED_ROPE.append(fused_apply_rotary_pos_emb)
    return fused_apply_rotary_pos_emb


@contextlib.contextmanager
def _megatron_rope(cfg: "TrafficConfig", scheme: str):
    """A baseline's RoPE as configured: ``rope_fusion`` puts the stand-in where megatron-core
    looks up TE's fused kernel (``apply_rope_fusion`` is set on the layer's config by
    :func:`_layer_and_inputs`); TSP applies its own kernel either way."""
    from unittest import mock

    from megatron.core.models.common.embeddings import rope_utils

    if scheme == "tsp" or not cfg.rope_fusion:
        yield
        return
    with mock.patch.object(rope_utils, "fused_apply_rotary_pos_emb", fused_rope_standin()):
        yield


def _whole_sequence_attention():
    """The TP+SP core attention as users run it on GPUs (Transformer Engine's flash attention):
    one causal flash kernel forward and one backward over the whole sequence, on [s, b, n, d]
    views, gradients straight in the compute dtype. (``fake_run.FlashCoreAttention``, the memory
    tool's stand-in, sums dK/dV in an fp32 buffer through the zigzag helpers: ~0.7 GB of extra
    traffic per layer at 7B / 32k that TE does not have.)"""
    import torch

    from megatron_tsp.core.layers import kernels
    from megatron_tsp.tools.estimator.fake_run import FlashCoreAttention

    class _Flash(torch.autograd.Function):
        """Forward: one flash call; saves q, k, v, out and the fp32 log-sum-exp. Backward: one
        flash backward call. No communication either way (TP+SP holds whole heads)."""

        @staticmethod
        def forward(ctx, q, k, v, scale):
            kernel = kernels.select_kernel(q.device, q.dtype, q.shape[-1], q.shape[2] != k.shape[2])
            o, lse = kernel.forward(*map(kernels._heads_view, (q, k, v)), kernels.TOP_LEFT, scale)
            out = o.permute(2, 0, 1, 3)  # [s, b, n, d]: a view (flash allocates like q)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.kernel, ctx.scale = kernel, scale
            return out

        @staticmethod
        def backward(ctx, d_out):
            q, k, v, out, lse = ctx.saved_tensors
            heads = kernels._heads_view
            grads = ctx.kernel.backward(
                heads(d_out),
                heads(q),
                heads(k),
                heads(v),
                heads(out),
                lse,
                kernels.TOP_LEFT,
                ctx.scale,
            )
            return (*(g.permute(2, 0, 1, 3) for g in grads), None)

    class WholeSequenceFlashAttention(FlashCoreAttention):
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
            if self.cp_group is not None:
                raise ValueError("the traffic benchmark's TP+SP attention has no CP")
            sq, b = query.shape[0], query.shape[1]
            return _Flash.apply(query, key, value, self.scale).reshape(sq, b, -1)

    return WholeSequenceFlashAttention


# TP+SP with packed documents, as Megatron runs them on a Transformer Engine box: a THD batch
# (``packed_seq_params`` with the documents' ``cu_seqlens``) whose core attention is TE's
# variable-length flash attention, one kernel call forward and one backward over all the
# micro-batch's tokens, visiting the in-document causal pairs only. TE cannot be installed here,
# so one custom op per direction stands in for it (``varlen_flash_standin``), with the kernel's
# operands: forward reads q, k, v and writes the output and the fp32 log-sum-exp [h, tokens];
# backward reads the output gradient, q, k, v, the output and the log-sum-exp and writes dq, dk,
# dv. The [s, b, n, d] views Megatron hands core attention are passed as they are (a THD batch
# has b = 1: the same tensors, no copy). ``cu_seqlens`` is an int list so that the FLOP rule can
# read it on shape-only tensors (TE reads a small int32 tensor: not counted).
_VARLEN: List[object] = []


def _varlen_reference(q, k, v, cu, scale):
    """The in-document causal attention of ``cu`` (THD offsets over the b x s tokens, batch
    major) on [s, b, n, d] tensors, in fp32 (fp64 for fp64 inputs): ``(out, lse,
    probabilities, k, v)`` with K/V repeated to the query heads (GQA)."""
    import torch

    s, b, n, _ = q.shape
    rep = n // k.shape[2]
    wide = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    qf, kf, vf = (t.to(wide).permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
    kf, vf = kf.repeat_interleave(rep, dim=1), vf.repeat_interleave(rep, dim=1)
    doc = torch.empty(b * s, dtype=torch.long)
    for i, (a, e) in enumerate(zip(cu, cu[1:])):
        doc[a:e] = i
    doc = doc.view(b, 1, s)
    pos = torch.arange(s)
    allowed = (doc.unsqueeze(-1) == doc.unsqueeze(-2)) & (pos.view(-1, 1) >= pos.view(1, -1))
    scores = (qf @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [b, n, s]
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return probs @ vf, lse, probs, kf, vf


def varlen_flash_standin():
    """``varlen(q, k, v, cu_seqlens, scale)`` -> [s, b, n, d_v]: one
    ``megatron_tsp_traffic::varlen_flash`` op forward and one ``varlen_flash_backward`` op
    backward (see above). On real tensors they compute the in-document causal attention and its
    gradients in fp32 (fp64 inputs: fp64; one rounding); on fake tensors they only allocate."""
    if _VARLEN:
        return _VARLEN[0]
    import torch

    schema = "(Tensor q, Tensor k, Tensor v, int[] cu_seqlens, float scale) -> (Tensor, Tensor)"

    @torch.library.custom_op("megatron_tsp_traffic::varlen_flash", mutates_args=(), schema=schema)
    def varlen_flash(q, k, v, cu_seqlens, scale):
        out, lse, _, _, _ = _varlen_reference(q, k, v, cu_seqlens, scale)
        s, b, n, _ = q.shape
        out = out.permute(2, 0, 1, 3).to(q.dtype).contiguous()
        return out, lse.permute(1, 0, 2).reshape(n, b * s).float().contiguous()

    @varlen_flash.register_fake
    def _(q, k, v, cu_seqlens, scale):
        s, b, n, _ = q.shape
        out = q.new_empty((s, b, n, v.shape[3]))
        return out, q.new_empty((n, b * s), dtype=torch.float32)

    bwd_schema = (
        "(Tensor d_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, int[] cu_seqlens, "
        "float scale) -> (Tensor, Tensor, Tensor)"
    )

    @torch.library.custom_op(
        "megatron_tsp_traffic::varlen_flash_backward", mutates_args=(), schema=bwd_schema
    )
    def varlen_flash_backward(d_out, q, k, v, out, lse, cu_seqlens, scale):
        _, _, probs, kf, vf = _varlen_reference(q, k, v, cu_seqlens, scale)
        qf, do = (t.to(kf.dtype).permute(1, 2, 0, 3) for t in (q, d_out))  # [b, n, s, d]
        of = probs @ vf
        dv = probs.transpose(-1, -2) @ do
        dp = do @ vf.transpose(-1, -2)
        ds = probs * (dp - (do * of).sum(-1, keepdim=True))
        dq, dk = (ds @ kf) * scale, (ds.transpose(-1, -2) @ qf) * scale
        groups = k.shape[2]
        b, n, s, d = dk.shape
        dk = dk.view(b, groups, n // groups, s, d).sum(2)
        dv = dv.view(b, groups, n // groups, s, dv.shape[-1]).sum(2)
        back = [t.permute(2, 0, 1, 3) for t in (dq, dk, dv)]
        return tuple(g.to(x.dtype).contiguous() for g, x in zip(back, (q, k, v)))

    @varlen_flash_backward.register_fake
    def _(d_out, q, k, v, out, lse, cu_seqlens, scale):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup_context(ctx, inputs, output):
        q, k, v, ctx.cu_seqlens, ctx.scale = inputs
        ctx.save_for_backward(q, k, v, *output)
        # the log-sum-exp has no gradient: no zeros materialised for it (TE launches none)
        ctx.set_materialize_grads(False)

    def backward(ctx, d_out, _d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        grads = torch.ops.megatron_tsp_traffic.varlen_flash_backward(
            d_out.contiguous(), q, k, v, out, lse, ctx.cu_seqlens, ctx.scale
        )
        return (*grads, None, None)

    varlen_flash.register_autograd(backward, setup_context=setup_context)

    def varlen(q, k, v, cu_seqlens, scale):
        return torch.ops.megatron_tsp_traffic.varlen_flash(q, k, v, list(cu_seqlens), scale)[0]

    _VARLEN.append(varlen)
    return varlen


def thd_offsets(lengths_per_sample: Sequence[Sequence[int]]) -> List[int]:
    """``cu_seqlens`` of a micro-batch packed as one THD sequence: the samples' document
    lengths end to end, sample 0 first."""
    cu = [0]
    for row in lengths_per_sample:
        for n in row:
            cu.append(cu[-1] + int(n))
    return cu


def _varlen_attention(lengths_per_sample):
    """TP+SP's core attention with packed documents (``varlen_flash_standin``), one call per
    direction over the micro-batch's documents."""
    from megatron_tsp.tools.estimator.fake_run import FlashCoreAttention

    cu = thd_offsets(lengths_per_sample)
    varlen = varlen_flash_standin()

    class VarlenFlashAttention(FlashCoreAttention):
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
            if self.cp_group is not None:
                raise ValueError("the traffic benchmark's TP+SP attention has no CP")
            sq, b = query.shape[0], query.shape[1]
            if cu[-1] != sq * b:
                raise ValueError(f"documents cover {cu[-1]} tokens, the batch holds {sq * b}")
            return varlen(query, key, value, cu, self.scale).reshape(sq, b, -1)

    return VarlenFlashAttention


def _layer_and_inputs(cfg, scheme: str, shape):
    """Build one layer of ``scheme`` (fake_run's building blocks) on the CUDA fake device, its
    input, RoPE table and output gradient. Runs inside ``FakeTensorMode``."""
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_block import TransformerBlock
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from megatron_tsp.tools import traffic_fsdp_cp
    from megatron_tsp.tools.estimator import fake_run

    fsdp = scheme in traffic_fsdp_cp.FSDP_SCHEMES  # Megatron's layer at TP = 1, CP = N
    run_cfg = fake_run.RunConfig(
        scheme="tp_cp" if fsdp else scheme,
        model=dataclasses.replace(shape, num_layers=1),
        world_size=cfg.world_size,
        tp=1 if fsdp else cfg.world_size,
        cp=cfg.world_size if fsdp else 1,
        seq=cfg.seq,
        micro_batch=cfg.micro_batch,
        dtype=cfg.dtype,
        fake=True,
        tsp_activation_sums_fp32=cfg.activation_sums_fp32,
    )
    run_cfg.validate()
    with unset_fake_temporarily():  # the process groups are real (fake-backend) objects
        fake_run.init_parallel(run_cfg)
    config = fake_run.transformer_config(run_cfg)
    spec = fake_run.layer_spec(run_cfg, config)
    if scheme == "tp_sp":
        # one document per sample is the plain causal batch (the TSP batch hook hands TSP no
        # documents then either): the whole-sequence kernel, as without --documents
        packed = cfg.documents and any(len(row) > 1 for row in cfg.documents)
        attention = _varlen_attention(cfg.documents) if packed else _whole_sequence_attention()
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = attention
    if fsdp:
        ring = scheme == "fsdp_cp_ring"
        for layer in spec.layer_specs:
            attention = traffic_fsdp_cp.core_attention_class(ring)
            layer.submodules.self_attention.submodules.core_attention = attention
    if scheme != "tsp":  # Megatron's RoPE: fused (TE's kernel, stood in) or unfused
        config.apply_rope_fusion = cfg.rope_fusion
    block = TransformerBlock(config=config, spec=spec, pre_process=True, post_process=False)
    _to_cuda(block)
    dtype = config.params_dtype
    local = cfg.seq // cfg.world_size
    x = torch.empty(local, cfg.micro_batch, shape.hidden, dtype=dtype, device="cuda")
    x.requires_grad_(True)
    rope = RotaryEmbedding(
        kv_channels=shape.hidden // shape.heads,
        rotary_percent=1.0,
        rotary_base=shape.rotary_base or 10000,
        use_cpu_initialization=True,
    )(cfg.seq)  # under CP (fsdp_cp): the rank's zigzag rows, sliced by Megatron's CP group
    return block, x, rope.to("cuda")


@contextlib.contextmanager
def _cuda_queries():
    """The CUDA queries a layer makes, answered without initialising CUDA: the current device is
    CUDA device 0 (Megatron allocates its buffers there; ``enable_cpu_support`` routes it to the
    CPU for CPU runs), and a device's compute capability (torch.distributed asks for its FP8
    workaround) is an H100/H200's (9, 0)."""
    from unittest import mock

    import torch

    with (
        mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (9, 0)),
        mock.patch.object(torch.cuda, "current_device", lambda: 0),
    ):
        yield


def _cp_group():
    from megatron.core import parallel_state as mpu

    return mpu.get_context_parallel_group()


def measure_layer(cfg: TrafficConfig, scheme: str) -> Dict[str, object]:
    """One layer's forward + backward of one rank, recorded (needs the stand-in, see module)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_tsp.core.comm import WORKSPACE
    from megatron_tsp.core.model_shape import load_model
    from megatron_tsp.megatron_lm.cpu_support import enable_cpu_support
    from megatron_tsp.megatron_lm.fake_world import init_fake_world
    from megatron_tsp.tools import cuda_standin, traffic_fsdp_cp
    from megatron_tsp.tools.estimator import fake_run

    shape = load_model(cfg.model)
    enable_cpu_support()
    init_fake_world(cfg.world_size)
    WORKSPACE.clear()
    with (
        cuda_standin.active(),
        _cuda_queries(),
        _megatron_rope(cfg, scheme),
        FakeTensorMode(allow_non_fake_inputs=True),
    ):
        torch.manual_seed(0)
        block, x, rope = _layer_and_inputs(cfg, scheme, shape)
        grad = torch.empty_like(x)  # the output gradient (the layer keeps the input's shape)
        mask = _document_mask(cfg) if scheme == "tsp" else None
        recorder = make_recorder()
        if scheme in traffic_fsdp_cp.FSDP_SCHEMES:  # ZeRO-3: the unshard / reduce-scatter too
            shards = traffic_fsdp_cp.LayerShards(block.parameters(), _cp_group())
        with fake_run.no_rng_fork(True), recorder:
            if scheme in traffic_fsdp_cp.FSDP_SCHEMES:
                shards.run(block, x, rope, grad)
            else:
                out = block(hidden_states=x, attention_mask=mask, rotary_pos_emb=rope)
                out.backward(grad)
    WORKSPACE.clear()
    summary = summarize(recorder.records, cfg.top, cfg.flash_tiles)
    params = linear_params_per_rank(shape, cfg.world_size)
    tokens = cfg.seq * cfg.micro_batch
    summary["linear_params_per_rank"] = params
    summary["gemm_flops_expected"] = {
        "forward": 2 * tokens * sum(params.values()),
        "backward": 4 * tokens * sum(params.values()),
        "recompute_fc1": 2 * tokens * params["fc1"],
    }
    if cfg.documents:
        summary["documents"] = document_stats(cfg, scheme, recorder.records)
    summary["records"] = [dataclasses.asdict(r) for r in recorder.records]
    return summary


def _document_mask(cfg: TrafficConfig):
    """What ``get_batch_on_this_tsp_rank`` hands TSP's layers for ``cfg.documents``
    (``megatron_lm.batch.tsp_permute_batch``): ``DocumentMask.to_tensor()``, a small host int64
    tensor in the ``attention_mask`` slot, or None for one document per sample. Built outside
    the fake mode (its values are the documents)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if not cfg.documents:
        return None
    documents = document_mask(cfg.documents, cfg.seq)
    if documents.is_single_document:
        return None
    with unset_fake_temporarily():
        return documents.to_tensor()


def document_mask(lengths_per_sample: Sequence[Sequence[int]], seq: int):
    """The ``DocumentMask`` of per-sample document lengths."""
    from megatron_tsp.core.documents import DocumentMask

    starts = []
    for row in lengths_per_sample:
        if sum(row) != seq:
            raise ValueError(f"document lengths {list(row)[:4]}... add up to {sum(row)}, not {seq}")
        starts.append([sum(row[:i]) for i in range(len(row))])
    return DocumentMask.from_document_starts(starts, seq)


def rank_pairs(starts: Sequence[int], seq: int, spans) -> int:
    """In-document causal (query, key) pairs of the queries in ``spans`` (natural ``[a, e)``
    ranges): a query at p sees the keys ``[start of p's document, p]``."""
    bounds = list(starts) + [seq]
    total = 0
    for a, e in spans:
        for ds, de in zip(bounds, bounds[1:]):
            x, y = max(a, ds), min(e, de)
            if x < y:  # queries x .. y-1 of the document starting at ds
                total += (y - ds) * (y - ds + 1) // 2 - (x - ds) * (x - ds + 1) // 2
    return total


# the function that issues TSP's natural-order K/V copy (forward, and again in backward)
NATURAL_KV_SOURCE = "attention._natural_kv"


def document_stats(cfg: TrafficConfig, scheme: str, records) -> Dict[str, object]:
    """What the packed-documents report prints of one recorded scheme: the attention kernel
    calls per direction, the in-document causal (query, key) pairs its queries have (TSP: the
    recorded rank's tokens, rank 0; TP+SP: every token, its heads being 1/D), the segments TSP's
    plan cuts the rank's rows into (``DocumentMask.segments``) and the bytes of its
    natural-order K/V copies."""
    from megatron_tsp.core.layout import TSPLayout

    documents = document_mask(cfg.documents, cfg.seq)
    attention = [r for r in records if r.kind == "kernel" and r.flop_kind == "attention"]
    out = {
        "documents": sum(len(row) for row in cfg.documents),
        "calls": {p: sum(r.phase == p for r in attention) for p in ("forward", "backward")},
        "attention_flops": {
            p: sum(r.flops for r in attention if r.phase == p) for p in ("forward", "backward")
        },
    }
    if scheme == "tsp":
        layout = TSPLayout(cfg.world_size, cfg.seq, rank=0)
        plans = documents.segments(layout.natural_runs, cfg.micro_batch)
        out["segments"] = sum(len(plan.blocks) for plan in plans)
        # every rank's pairs (computed, not recorded): the slowest rank sets the layer's pace
        out["pairs_per_rank"] = [
            sum(
                rank_pairs(documents.starts_of(i), cfg.seq, layout.spans_of(rank))
                for i in range(cfg.micro_batch)
            )
            for rank in range(cfg.world_size)
        ]
        out["pairs"] = out["pairs_per_rank"][0]
        copies = [r for r in records if r.kind == "kernel" and r.source == NATURAL_KV_SOURCE]
        out["natural_kv_copy"] = {
            p: sum(r.bytes for r in copies if r.phase == p) for p in ("forward", "backward")
        }
        out["natural_kv_copy_launches"] = len(copies)
    else:
        out["pairs"] = documents.pairs()
    return out


def measure(cfg: TrafficConfig) -> Dict[str, object]:
    """Every scheme of ``cfg`` in this process (the stand-in must be loaded)."""
    return {scheme: measure_layer(cfg, scheme) for scheme in cfg.schemes}


def measure_isolated(cfg: TrafficConfig, timeout: float = 1800) -> Dict[str, object]:
    """:func:`measure` in a fresh interpreter that loads the CUDA stand-in before torch."""
    from megatron_tsp.tools.estimator.fake_run import run_in_fresh_process

    code = (
        "import json, sys, warnings; warnings.filterwarnings('ignore'); "
        "from megatron_tsp.tools import cuda_standin; cuda_standin.load(); "
        "from megatron_tsp.tools import traffic as t; "
        "r = t.measure(t.TrafficConfig(**json.loads(sys.stdin.read()))); "
        "print('@@RESULT@@' + json.dumps(r))"
    )
    return run_in_fresh_process(code, json.dumps(dataclasses.asdict(cfg)), timeout)


def gemm_check(summary: Dict[str, object]) -> Dict[str, object]:
    """GEMM FLOPs against 2 x tokens x linear parameters: forward must equal it exactly,
    backward twice it (dgrad + wgrad), plus 2 x tokens x fc1 parameters when fc1 is recomputed."""
    exp = summary["gemm_flops_expected"]
    fwd = summary["by_phase"]["forward"]["gemm_flops"]
    bwd = summary["by_phase"]["backward"]["gemm_flops"]
    if bwd == exp["backward"]:
        recompute = "none"
    elif bwd == exp["backward"] + exp["recompute_fc1"]:
        recompute = "fc1"
    else:
        recompute = None
    return {"forward_exact": fwd == exp["forward"], "backward_recompute": recompute}


# --------------------------------------------------------------------------------------------
# the length-independent part


def length_split(
    results: Dict[int, Dict[str, object]], scheme: str, micro_batch: int = 1
) -> Dict[str, object]:
    """``bytes = fixed + per_token x tokens`` for ``scheme`` (tokens = sequence length x
    ``micro_batch``), from the shortest and the longest
    length measured: every tensor the layer touches is either a weight (or a weight-sized
    buffer) or scales with the sequence, and the counting rule reads each kernel's arguments
    once, so the recorded bytes are affine in the length (``tests/test_traffic.py`` checks it at
    three lengths). ``fixed`` is what a layer moves for its weights whatever the length;
    ``by_source`` splits it by the function that issued the op."""
    lo, hi = min(results), max(results)
    if lo == hi:
        raise ValueError(f"length_split needs two sequence lengths, got only {lo}")
    a, b = results[lo][scheme], results[hi][scheme]
    tokens_lo, tokens_hi = lo * micro_batch, hi * micro_batch

    def split(at_lo: int, at_hi: int):
        per_token = (at_hi - at_lo) / (tokens_hi - tokens_lo)
        return at_lo - per_token * tokens_lo, per_token

    fixed, per_token = split(a["bytes"], b["bytes"])
    sources = set(a["bytes_by_source"]) | set(b["bytes_by_source"])
    by_source = {
        src: split(a["bytes_by_source"].get(src, 0), b["bytes_by_source"].get(src, 0))[0]
        for src in sources
    }
    return {"fixed": fixed, "per_token": per_token, "by_source": by_source}


def tsp_weight_floor(summary: Dict[str, object], world_size: int, dtype: str) -> int:
    """The length-independent bytes no TSP layer can move fewer of under the counting rule: every
    rank applies every one of the D weight shards to its tokens in the forward and again for
    dX (all the layer's linear weights read twice, in the compute dtype), and writes a partial
    gradient of every shard (its tokens touch every weight) in the accumulation dtype that the
    shard owner's sum keeps (``precision.accumulation_dtype``: fp32 for bf16). TP+SP reads 1/D
    of the weights; that difference is TSP's, whatever the implementation."""
    import torch

    from megatron_tsp.core.layers.precision import accumulation_dtype

    weights = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    per_weight = 2 * weights.itemsize + accumulation_dtype(weights).itemsize
    return world_size * sum(summary["linear_params_per_rank"].values()) * per_weight


def affine_check(
    results: Dict[int, Dict[str, object]],
    scheme: str,
    micro_batch: int = 1,
    checks: Dict[int, Dict[str, object]] | None = None,
) -> Dict[int, float]:
    """Measured minus fitted bytes (:func:`length_split`, from the shortest and the longest of
    ``results``) at every other length of ``results`` and of ``checks`` (recordings kept for the
    check only): 0 where the bytes are affine in the length."""
    split = length_split(results, scheme, micro_batch)
    lo, hi = min(results), max(results)
    at = {q: r for q, r in results.items() if q not in (lo, hi)}
    at.update(checks or {})
    return {
        q: r[scheme]["bytes"] - (split["fixed"] + split["per_token"] * q * micro_batch)
        for q, r in sorted(at.items())
    }


def check_length(seqs: Sequence[int], world_size: int) -> int:
    """A length between the shortest and the longest of ``seqs`` that D ranks split (a multiple
    of 2D): where the report checks the affine fit when it has only two lengths."""
    step = 2 * world_size
    return (min(seqs) + max(seqs)) // 2 // step * step


def _fixed_part_lines(results, cfg: TrafficConfig, checks=None) -> List[str]:
    """The report's section on the length-independent part of every scheme, checked affine,
    TSP's floor, and what the budget leaves per token once that part is at the floor."""
    seqs = sorted(results)
    schemes = [s for s in SCHEMES if s in cfg.schemes]
    split = {s: length_split(results, s, cfg.micro_batch) for s in schemes}
    off = {s: affine_check(results, s, cfg.micro_batch, checks) for s in schemes}

    def gb(n: float) -> str:
        return f"{n / GB:.2f} GB"

    def per_token(s: str) -> str:
        cell = f"{split[s]['per_token']:,.0f} B"
        if s != "tp_sp" and "tp_sp" in split:
            cell += f" ({split[s]['per_token'] / split['tp_sp']['per_token']:.3f}×)"
        return cell

    checked = sorted({q for s in schemes for q in off[s]})
    if checked:
        fit = (
            "checked at "
            + ", ".join(_seq_label(q) for q in checked)
            + ": "
            + (
                "measured = fitted"
                if all(abs(d) < 1 for s in schemes for d in off[s].values())
                else "DEVIATES, "
                + "; ".join(
                    f"{LABELS[s]} {_seq_label(q)} {d:+,.0f} B"
                    for s in schemes
                    for q, d in off[s].items()
                    if abs(d) >= 1
                )
            )
        )
    else:
        fit = "not checked (a third --seq-lengths value checks it)"
    lines = [
        "Bytes split into a part independent of the length and a part per token (fitted from "
        f"{_seq_label(seqs[0])} and {_seq_label(seqs[-1])}; {fit}):",
        "",
        "| per layer | " + " | ".join(LABELS[s] for s in schemes) + " |",
        "|---|" + "---:|" * len(schemes),
        "| independent of the length | "
        + " | ".join(gb(split[s]["fixed"]) for s in schemes)
        + " |",
        "| per token (× TP+SP's) | " + " | ".join(per_token(s) for s in schemes) + " |",
    ]
    if "tsp" not in schemes:
        return lines + [""]
    floor = tsp_weight_floor(results[seqs[0]]["tsp"], cfg.world_size, cfg.dtype)
    lines.append(
        "| TSP's floor for the length-independent part | "
        + " | ".join(gb(floor) if s == "tsp" else "" for s in schemes)
        + " |"
    )
    lines += [
        "",
        f"TSP's floor ({gb(floor)}): every weight shard read forward and for dX, one partial "
        "gradient of each written in the accumulation dtype.",
    ]
    if "tp_sp" in schemes:
        tsp, tp_sp = split["tsp"], split["tp_sp"]
        left = []
        for q in seqs:
            room = (BYTES_BUDGET * results[q]["tp_sp"]["bytes"] - floor) / (q * cfg.micro_batch)
            left.append(
                f"{room:,.0f} B at {_seq_label(q)} ({room / tp_sp['per_token']:.3f}× "
                f"TP+SP's, {room / tsp['per_token']:.3f}× TSP's now)"
            )
        lines[-1] += (
            f" Within {BYTES_BUDGET}× TP+SP's bytes, a TSP layer whose length-independent part "
            "were at that floor would have per token " + " and ".join(left) + "."
        )
    above_1mb = sorted(
        ((src, b) for src, b in split["tsp"]["by_source"].items() if b > 1e6), key=lambda e: -e[1]
    )
    return lines + [
        "",
        "TSP's length-independent bytes by source (above 1 MB):",
        "",
        "| source | bytes |",
        "|---|---:|",
        *[f"| `{src}` | {gb(b)} |" for src, b in above_1mb],
        "",
    ]


def _flash_tile_lines(results, cfg: TrafficConfig) -> List[str]:
    """The flash-tiles view beside the per-call rule: each scheme's bytes plus its attention
    kernels' tile re-reads (:func:`flash_tile_rereads`)."""
    seqs = sorted(results)
    schemes = [s for s in SCHEMES if s in cfg.schemes]
    both = "tsp" in schemes and "tp_sp" in schemes
    br, bc = cfg.flash_tiles
    head = ["per layer"] + [f"{LABELS[s]} {_seq_label(q)}" for q in seqs for s in schemes]

    def row(label, value, with_ratio):
        cells = [label]
        for q in seqs:
            for s in schemes:
                cell = _gb(value(results[q][s]))
                if with_ratio and s == "tsp" and both:
                    cell += f" ({value(results[q]['tsp']) / value(results[q]['tp_sp']):.2f}×)"
                cells.append(cell)
        return "| " + " | ".join(cells) + " |"

    def tiled(r):
        return r["bytes"] + r["flash_tiles"]["rereads"]

    return [
        f"Flash-tiles view (Br = {br} query rows, Bc = {bc} keys per tile; the budget stays on "
        "the per-call rule): a tiled flash kernel re-reads operands the per-call rule reads once. "
        "Forward, each query tile reads the K and V rows of every key tile it attends to: "
        "b·h·(d_qk + d_v)·e·Σ_i keys_i, keys_i = the keys its last row sees rounded up to Bc; "
        "backward, each key tile reads the Q and dO rows of every query tile attending to it: "
        "b·h·(d_qk + d_v)·e·Σ_j queries_j, from the query tile holding the first row that sees "
        "the tile's first key; each less the once-read the rule charged (h: query heads, e: "
        "element size; the backward's fp32 dQ accumulation is not charged).",
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
        row("bytes, per-call rule", lambda r: r["bytes"], True),
        row("+ tile re-reads, forward", lambda r: r["flash_tiles"]["forward"], False),
        row("+ tile re-reads, backward", lambda r: r["flash_tiles"]["backward"], False),
        row("bytes with flash tiles", tiled, True),
        "",
    ]


# --------------------------------------------------------------------------------------------
# report


def _gb(n: float) -> str:
    if n == 0:
        return "0"
    return f"{n / GB:.1f} GB" if n >= 0.1 * GB else f"{n / 1e6:.2f} MB"


def rope_line(cfg: TrafficConfig) -> str:
    """The report's header line: how the baselines' RoPE is recorded."""
    if cfg.rope_fusion:
        return (
            "RoPE of TP+SP: Megatron's fused path (`apply_rope_fusion`), Transformer Engine's "
            "kernel stood in by one recorded op per tensor and direction (reads the tensor and "
            "the fp32 angles, writes the result; `--unfused-rope`: Megatron's unfused RoPE). "
            "TSP: its own RoPE kernel."
        )
    return (
        "RoPE of TP+SP: Megatron's unfused RoPE (`--unfused-rope`; by default its fused path, as "
        "with Transformer Engine). TSP: its own RoPE kernel."
    )


def render(
    results: Dict[int, Dict[str, object]],
    cfg: TrafficConfig,
    command: str,
    checks: Dict[int, Dict[str, object]] | None = None,
    flash_tiles: bool = False,
) -> str:
    """Markdown: the per-layer table (kernels, bytes, FLOPs, TSP / TP+SP), the length-independent
    and per-token parts (``checks``: recordings at more lengths, for the affine check only), the
    flash-tiles view where asked, and the top ops."""
    seqs = sorted(results)
    schemes = [s for s in SCHEMES if s in cfg.schemes]
    both = "tsp" in schemes and "tp_sp" in schemes
    head = ["per layer"] + [f"{LABELS[s]} {_seq_label(q)}" for q in seqs for s in schemes]

    def ratio(q, key):
        r = results[q]
        return f" ({r['tsp'][key] / r['tp_sp'][key]:.2f}×)" if both else ""

    rows = []
    for label, key, fmt in (
        ("aten kernels (fwd + bwd)", "kernels", None),
        ("bytes read + written", "bytes", _gb),
        ("GEMM TFLOP", "gemm_flops", None),
        ("attention TFLOP", "attention_flops", None),
    ):
        row = [label]
        for q in seqs:
            for s in schemes:
                r = results[q][s]
                if key == "kernels":
                    ph = r["by_phase"]
                    cell = f"{r['kernels']} ({ph['forward']['kernels']} + "
                    cell += f"{ph['backward']['kernels']})"
                elif fmt is not None:
                    cell = fmt(r[key])
                else:
                    cell = f"{r[key] / 1e12:.3f}"
                if s == "tsp" and both:
                    cell += ratio(q, key)
                row.append(cell)
        rows.append(row)
    if both:
        row = ["FLOPs TSP / TP+SP"]
        for q in seqs:
            for s in schemes:
                r = results[q]
                row.append(f"{r['tsp']['flops'] / r['tp_sp']['flops']:.3f}×" if s == "tsp" else "1")
        rows.append(row)
    row = ["GEMM FLOPs = 2·T·P fwd / bwd"]
    for q in seqs:
        for s in schemes:
            c = gemm_check(results[q][s])
            bwd = {"none": "4·T·P", "fc1": "4·T·P + fc1 recompute", None: "MISMATCH"}
            row.append(
                ("exact" if c["forward_exact"] else "MISMATCH")
                + " / "
                + bwd[c["backward_recompute"]]
            )
    rows.append(row)
    shape = results[seqs[0]][schemes[0]]

    def per_scheme(key: str) -> str:
        return ", ".join(f"{LABELS[s]} {results[seqs[0]][s].get(key, 0)}" for s in schemes)

    lines = [
        rope_line(cfg),
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
        *["| " + " | ".join(r) + " |" for r in rows],
        "",
        f"One rank, D = {cfg.world_size}, micro-batch {cfg.micro_batch}, {cfg.dtype}, model "
        f"`{cfg.model}`; T = tokens of the sequence, P = linear weights per rank "
        f"({sum(shape['linear_params_per_rank'].values()):,}). Collectives issued (no-ops, "
        "not counted): "
        + per_scheme("collectives")
        + ". Per-step kernels of the first layer (TSP's RoPE tables, not counted): "
        + per_scheme("per_step_kernels")
        + ". Index-table uploads of the first step (cached on a GPU, not counted): "
        + per_scheme("cached_uploads")
        + ".",
        "",
        f"Command: `{command}`",
        "",
    ]
    if cfg.documents:
        lines += _document_lines(results, cfg)
    if len(seqs) > 1 and not cfg.documents:
        lines += _fixed_part_lines(results, cfg, checks)
    if flash_tiles:
        lines += _flash_tile_lines(results, cfg)
    q = seqs[0]
    for s in schemes:
        r = results[q][s]
        lines += [
            f"Top sources by launches, {LABELS[s]} {_seq_label(q)} (the innermost Megatron / "
            "megatron_tsp function that issued the op; `autograd`: the backward of built-in ops):",
            "",
            "| source | launches | bytes |",
            "|---|---:|---:|",
            *[
                f"| `{e['source']}` | {e['launches']} | {_gb(e['bytes'])} |"
                for e in r["top_sources"]
            ],
            "",
        ]
    for q in seqs:
        for s in schemes:
            r = results[q][s]
            lines += [
                f"Top ops by bytes, {LABELS[s]} {_seq_label(q)} "
                f"(of {_gb(r['bytes'])} in {r['kernels']} kernels):",
                "",
                "| op | launches | read | written | share |",
                "|---|---:|---:|---:|---:|",
            ]
            for e in r["top_ops"]:
                lines.append(
                    f"| `{e['op']}` | {e['launches']} | {_gb(e['read'])} | {_gb(e['written'])} "
                    f"| {100 * e['bytes'] / max(r['bytes'], 1):.0f}% |"
                )
            lines.append("")
    return "\n".join(lines)


def _document_lines(results, cfg: TrafficConfig) -> List[str]:
    """The packed-documents section: per scheme and length the documents, the attention kernel
    calls, the attention FLOPs against the in-document pairs they cover, and TSP's natural-order
    K/V copies."""
    seqs = sorted(results)
    schemes = [s for s in SCHEMES if s in cfg.schemes]
    rows = []
    for q in seqs:
        for s in schemes:
            r = results[q][s]
            doc = r["documents"]
            flops = doc["attention_flops"]
            calls = doc["calls"]
            per_pair = (flops["forward"] + flops["backward"]) / max(doc["pairs"], 1)
            copy = doc.get("natural_kv_copy")
            rows.append(
                [
                    f"{LABELS[s]} {_seq_label(q)}",
                    str(doc["documents"]),
                    str(doc.get("segments", "-")),
                    f"{r['kernels']}",
                    f"{calls['forward']} + {calls['backward']}",
                    _gb(r["bytes"]),
                    f"{flops['forward'] / 1e12:.3f} + {flops['backward'] / 1e12:.3f}",
                    f"{doc['pairs']:,}",
                    f"{per_pair:,.0f}",
                    f"{_gb(copy['forward'])} + {_gb(copy['backward'])}" if copy else "-",
                ]
            )
    head = [
        "scheme",
        "documents",
        "TSP segments (rank 0)",
        "kernels",
        "attention calls fwd + bwd",
        "HBM bytes",
        "attention TFLOP fwd + bwd",
        "in-document pairs",
        "FLOP per pair",
        "natural-order K/V copy fwd + bwd",
    ]
    balance = []
    for q in seqs:
        if "tsp" in schemes:
            per_rank = results[q]["tsp"]["documents"]["pairs_per_rank"]
            mean = sum(per_rank) / len(per_rank)
            balance.append(
                f"TSP {_seq_label(q)}: in-document pairs per rank (computed from the layout, "
                f"not recorded) min {min(per_rank):,} / mean {mean:,.0f} / max {max(per_rank):,}"
                f" (rank 0 {per_rank[0] / mean:.2f}× the mean, the slowest "
                f"{max(per_rank) / mean:.2f}×: rank {per_rank.index(max(per_rank))})."
            )
    return [
        "Packed documents: per micro-batch sample one document set drawn from the mix "
        "(`megatron-tsp documents`' draws). TSP gets them as `get_batch_on_this_tsp_rank` hands "
        "them over (`DocumentMask.to_tensor()` in the `attention_mask` slot): per head group the "
        "gathered K/V copied once into natural order, then one bottom-right causal call per "
        "(chunk, document) segment; its pairs are the recorded rank's (rank 0: chunks 0 and "
        "2D-1). TP+SP as Megatron runs them on a Transformer Engine box, a THD batch: one "
        "variable-length flash call per direction over all its tokens for its 1/D of the heads "
        "(TE's kernel stood in by one recorded op per direction reading q, k, v (+ output, "
        "log-sum-exp, output gradient backward) and writing its results; its FLOPs from the "
        "`cu_seqlens`). FLOP per pair = 2·heads·(d_qk + d_v) forward + 2·heads·(3·d_qk + 2·d_v) "
        "backward over the heads the scheme's rank computes (TSP: all, TP+SP: 1/D).",
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
        *["| " + " | ".join(r) + " |" for r in rows],
        "",
        *[line for b in balance for line in (b, "")],
    ]


def _seq_label(seq: int) -> str:
    return f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)


def parse_args(argv=None) -> argparse.Namespace:
    p = ToolParser(
        prog="megatron-tsp bench --traffic",
        description="one rank's transformer layer, fwd + bwd, op by op on shape-only CUDA "
        "tensors: kernel launches, bytes read + written, FLOPs, TSP vs Megatron TP+SP",
    )
    p.add_argument("--model", default="7b", help="megatron_tsp/models name or JSON path")
    p.add_argument("--seq-lengths", type=positive_int_list, default=[32768, 131072])
    p.add_argument("--world-size", type=positive_int, default=8, help="D (TSP group = TP group)")
    p.add_argument("--micro-batch-size", type=positive_int, default=1)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument(
        "--schemes",
        default=",".join(DEFAULT_SCHEMES),
        help=f"comma list among {','.join(SCHEMES)} (fsdp_cp: ZeRO-3 x CP over the D ranks, "
        "K/V all-gathered; fsdp_cp_ring: on TE's P2P ring)",
    )
    p.add_argument("--top", type=non_negative_int, default=8, help="top ops by bytes to list")
    p.add_argument("--out", default=None, help="write the markdown report here too")
    p.add_argument("--json", dest="json_path", default=None, help="write the summaries here")
    p.add_argument(
        "--tsp-activation-sums-in-fp32",
        action="store_true",
        help="TSP's MLP output and input gradients summed over the shards in fp32 (Megatron-LM's "
        "--tsp-activation-sums-in-fp32; default: in place in the compute dtype)",
    )
    p.add_argument(
        "--unfused-rope",
        action="store_true",
        help="record TP+SP with Megatron's unfused RoPE (default: its fused path, "
        "apply_rope_fusion, as with Transformer Engine: one kernel per tensor and direction)",
    )
    p.add_argument(
        "--flash-tiles",
        nargs="?",
        const=list(FLASH_TILES),
        default=None,
        metavar="BR,BC",
        type=positive_int_list,
        help="also show the bytes with a tiled flash kernel's re-reads (query tiles of BR rows, "
        f"key tiles of BC; default {FLASH_TILES[0]},{FLASH_TILES[1]}) beside the per-call rule",
    )
    p.add_argument(
        "--documents",
        default=None,
        metavar="MIX",
        help="packed documents: one document set drawn per micro-batch sample from MIX "
        "(megatron-tsp documents' specs: single, uniform:LO-HI, heavy:ALPHA,LO-HI, "
        "long+short:L,LO-HI, fixed:L1,L2,...); TSP gets them as get_batch_on_this_tsp_rank "
        "hands them over, TP+SP runs them as a THD batch (variable-length flash attention)",
    )
    p.add_argument(
        "--draw-seed",
        type=non_negative_int,
        default=0,
        help="seed of the --documents draws (megatron-tsp documents' convention; default 0)",
    )
    p.add_check(_check_args)
    args = p.parse_args(argv)
    args.schemes = [s for s in args.schemes.split(",") if s]
    return args


def draw_documents(mix: str | None, seq: int, micro_batch: int, seed: int = 0):
    """Per sample of a micro-batch its document lengths, drawn from ``mix`` (None: no
    ``--documents``) as ``megatron-tsp documents`` draws them (draw i of ``seed`` for sample
    i)."""
    if mix is None:
        return None
    from megatron_tsp.tools.estimator import documents

    return documents.draws(documents.parse_mix(mix), seq, micro_batch, seed)


def scheme_fits(model: str, scheme: str, world_size: int) -> bool:
    """Whether ``scheme``'s layer of ``model`` (a name or JSON path) splits over ``world_size``
    ranks: TSP and TP+SP shard heads, query groups and FFN (``core.validation``); FSDP x CP
    keeps whole heads (its parameters' shards are checked when it is recorded)."""
    from megatron_tsp.core import model_shape
    from megatron_tsp.core.validation import check_model_shape

    if scheme not in ("tsp", "tp_sp"):
        return True
    shape = model_shape.load_model(model)
    try:
        check_model_shape(
            world_size,
            shape.heads,
            num_query_groups=shape.query_groups,
            ffn_hidden_size=shape.ffn or 4 * shape.hidden,
            hidden_size=shape.hidden,
        )
    except ValueError:
        return False
    return True


def _check_args(args: argparse.Namespace) -> None:
    """Before any recording: schemes known, D >= 2, every length splits into 2D chunks, the
    model exists and splits over D (heads, query groups, FFN: ``core.validation``)."""
    # imported here: they import torch, which this interpreter keeps unloaded (the recording
    # runs in a fresh one whose CUDA stand-in must load before torch)
    from megatron_tsp.core import model_shape
    from megatron_tsp.core.validation import check_model_shape

    if args.flash_tiles is not None and len(args.flash_tiles) != 2:
        given = ",".join(map(str, args.flash_tiles))
        raise UsageError(f"--flash-tiles {given}", "give two tile sizes: BR,BC")
    bad = [s for s in args.schemes.split(",") if s and s not in SCHEMES]
    if bad:
        raise UsageError(f"--schemes {args.schemes}", f"unknown {bad}; choose among {SCHEMES}")
    if args.world_size < 2:
        raise UsageError(f"--world-size {args.world_size}", "D must be >= 2")
    if args.documents is not None:
        from megatron_tsp.tools.estimator import documents

        try:
            documents.parse_mix(args.documents)
        except ValueError as exc:
            raise from_value_error(exc, "--documents") from None
        if args.flash_tiles is not None:
            raise UsageError(
                f"--documents {args.documents} --flash-tiles",
                "the flash-tiles view has no tile geometry for TP+SP's variable-length "
                "stand-in; leave out one of them",
            )
        others = [s for s in args.schemes.split(",") if s and s not in DOCUMENT_SCHEMES]
        if others:
            raise UsageError(
                f"--documents {args.documents} --schemes {args.schemes}",
                f"packed documents are recorded for {','.join(DOCUMENT_SCHEMES)} only, not "
                f"{','.join(others)}",
            )
    for s in args.seq_lengths:
        if s % (2 * args.world_size):
            raise UsageError(
                f"--seq-lengths {s}", f"not divisible by 2 x --world-size = {2 * args.world_size}"
            )
    try:
        shape = model_shape.load_model(args.model)
    except ValueError as exc:
        raise UsageError(f"--model {args.model}", str(exc)) from None
    try:
        check_model_shape(
            args.world_size,
            shape.heads,
            num_query_groups=shape.query_groups,
            ffn_hidden_size=shape.ffn or 4 * shape.hidden,
            hidden_size=shape.hidden,
        )
    except ValueError as exc:
        raise from_value_error(exc, f"--world-size {args.world_size}") from None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    results, checks = {}, {}
    seqs = sorted(set(args.seq_lengths))
    extra = []  # two lengths: a third, recorded only to check the affine fit
    if len(seqs) == 2 and check_length(seqs, args.world_size) not in seqs:
        extra = [check_length(seqs, args.world_size)]
    for seq in seqs + extra:
        cfg = TrafficConfig(
            model=args.model,
            seq=seq,
            world_size=args.world_size,
            micro_batch=args.micro_batch_size,
            dtype=args.dtype,
            schemes=args.schemes,
            top=args.top,
            activation_sums_fp32=args.tsp_activation_sums_in_fp32,
            rope_fusion=not args.unfused_rope,
            flash_tiles=list(args.flash_tiles or FLASH_TILES),
            documents=draw_documents(args.documents, seq, args.micro_batch_size, args.draw_seed),
        )
        what = "recording" if seq in seqs else "recording (affine check only)"
        print(f"[traffic] S={seq}: {what} ...", file=sys.stderr, flush=True)
        res = measure_isolated(cfg)
        for r in res.values():
            r.pop("records", None)
        (results if seq in seqs else checks)[seq] = res
    command = "megatron-tsp bench --traffic " + " ".join(argv)
    text = render(results, cfg, command.strip(), checks, args.flash_tiles is not None)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({str(k): v for k, v in results.items()}, f, indent=1)
    bad = [
        (q, s)
        for q, res in {**results, **checks}.items()
        for s, r in res.items()
        if not gemm_check(r)["forward_exact"] or gemm_check(r)["backward_recompute"] is None
    ]
    if bad:
        print(f"error: GEMM FLOPs differ from 2·T·P for {bad}", file=sys.stderr)
        return 1
    return 0


def layer_traffic(
    model: str,
    seq: int,
    world_size: int,
    micro_batch: int = 1,
    dtype: str = "bf16",
    rope_fusion: bool = True,
) -> Dict[str, Dict[str, float]]:
    """Measured kernel launches and bytes read + written of one layer (fwd + bwd) of one rank,
    per scheme ("tsp", "tp_sp"), for the planner: ``{"tsp": {"kernels": ..., "bytes": ...,
    "flops": ...}, ...}``. Runs :func:`measure_isolated` (a fresh interpreter, ~seconds)."""
    res = measure_isolated(
        TrafficConfig(
            model=model,
            seq=seq,
            world_size=world_size,
            micro_batch=micro_batch,
            dtype=dtype,
            rope_fusion=rope_fusion,
        )
    )
    return {
        s: {"kernels": r["kernels"], "bytes": r["bytes"], "flops": r["flops"]}
        for s, r in res.items()
    }
