"""Count the communication a piece of code actually issues.

``CommCounter`` is a context manager that wraps the ``torch.distributed`` entry points (and the
names megatron-core binds at import time) and records one ``CommRecord`` per call: operation, group
size, payload bytes, bytes this rank receives under the standard ring/direct algorithms, phase
(forward or backward, from the autograd engine) and scope (the innermost ``comm_scope`` label, set
by TSP layers or by ``label_modules`` hooks on stock Megatron modules).

Received bytes per rank (n = payload bytes, D = group size, f = (D-1)/D):
    all_gather: f * n_out         reduce_scatter: f * n_in      all_reduce: 2 f * n
    all_to_all: f * n             broadcast / reduce: f * n (average over the ranks of a
    recv / irecv: n               send / isend: 0                rooted op; summed over D roots
                                                                  it is exact)
An uneven ``all_to_all_single`` (split sizes given) counts exactly the rows the other ranks
send (its output but ``output_split_sizes[own rank]``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from megatron_tsp.core import comm
from megatron_tsp.megatron_lm import patches

# The scope label lives in the core (``comm.labelled``): layers label their own traffic and the
# counter reads it, so the core never imports this module.
comm_scope = comm.labelled
current_scope = comm.current_label
_scope = comm._labels
_suppress = threading.local()


@functools.lru_cache(maxsize=None)
def _signature(fn):
    return inspect.signature(fn)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass
class CommRecord:
    op: str
    group_size: int
    payload_bytes: int
    recv_bytes: float
    phase: str
    scope: str
    dtype: str


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


def _dtype(t) -> str:
    if isinstance(t, (list, tuple)):
        t = t[0] if t else None
    return str(t.dtype).replace("torch.", "") if t is not None else "-"


# op name -> (argument holding the payload, received bytes as a fraction of it for group size D)
_RING = lambda d: (d - 1) / d  # noqa: E731
_SPEC = {
    "all_reduce": ("tensor", lambda d: 2 * (d - 1) / d),
    "all_gather": ("tensor_list", _RING),
    "all_gather_into_tensor": ("output_tensor", _RING),
    "_all_gather_base": ("output_tensor", _RING),
    "reduce_scatter": ("input_list", _RING),
    "reduce_scatter_tensor": ("input", _RING),
    "_reduce_scatter_base": ("input", _RING),
    "all_to_all": ("input_tensor_list", _RING),
    "all_to_all_single": ("input", _RING),
    "broadcast": ("tensor", _RING),
    "reduce": ("tensor", _RING),
    "all_gather_single": ("output_tensor", _RING),
    "reduce_scatter_single": ("input", _RING),
    "send": ("tensor", lambda d: 0.0),
    "isend": ("tensor", lambda d: 0.0),
    "recv": ("tensor", lambda d: 1.0),
    "irecv": ("tensor", lambda d: 1.0),
}


def _split_sizes(sizes) -> List[int]:
    return [] if sizes is None else [int(x) for x in sizes]


def _all_to_all_v_received(bound) -> float:
    """Bytes an uneven ``all_to_all_single`` brings from the other ranks: its output rows but
    the ones it sends itself (``output_split_sizes[own rank]``)."""
    rows = _split_sizes(bound["output_split_sizes"])
    group = bound.get("group")
    own = dist.get_rank(group) if group is not None else dist.get_rank()
    output = bound["output"]
    return (sum(rows) - rows[own]) * (_nbytes(output) / max(sum(rows), 1))


def received_fraction(op: str, group_size: int) -> float:
    """Bytes one rank receives for ``op`` as a fraction of its payload, in a group of
    ``group_size`` (the rule every ``CommRecord`` applies; module docstring)."""
    return _SPEC[op][1](group_size)


# torch 2.13 renamed two collectives; the old names still work but warn (FutureWarning). Calls
# through either name are recorded under the old one (reports and tests keep one name per op),
# and a wrapped old name forwards to the new function when torch has it (megatron-core binds the
# old names at import: the counter's wrapper is the one place those calls pass through).
_RENAMED = {
    "all_gather_into_tensor": "all_gather_single",
    "reduce_scatter_tensor": "reduce_scatter_single",
}
_RECORDED_AS = {new: old for old, new in _RENAMED.items()}
_P2P_OPS = ("isend", "irecv", "send", "recv")
# megatron-core binds two collectives by name at import, in these modules: name -> (the op it
# is counted as, the parameters the wrapper reads)
_MEGATRON_MODULES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
)
_MEGATRON_BOUND = {
    "dist_all_gather_func": ("all_gather_into_tensor", ("output_tensor", "input_tensor", "group")),
    "dist_reduce_scatter_func": ("reduce_scatter_tensor", ("output", "input", "op", "group")),
}


def _counter_patches() -> List[patches.Patch]:
    """What ``CommCounter`` replaces while active (it sets and restores the attributes itself;
    declared so that ``megatron-tsp check-patches`` checks every target and the parameters the
    wrappers read)."""
    new_names = set(_RENAMED.values())

    def row(target, reason, params, optional=False):
        return patches.row(patches.COUNTER, target, reason, params, optional=optional)

    rows = [
        row(
            f"torch.distributed:{op}",
            "counted (payload and group read by name)",
            (payload, "group"),
            optional=op in new_names,
        )
        for op, (payload, _) in _SPEC.items()
    ]
    rows += [
        row(
            f"torch.distributed.distributed_c10d:{op}",
            "P2POp validates its op against these globals: counted under both names",
            (_SPEC[op][0], "group"),
        )
        for op in _P2P_OPS
    ]
    rows += [
        row(
            f"torch.distributed.distributed_c10d:{op}",
            "the same global identity for the collectives",
            (payload, "group"),
        )
        for op, (payload, _) in _SPEC.items()
        if op not in _P2P_OPS and op not in new_names
    ]
    rows.append(
        row(
            "torch.distributed:batch_isend_irecv",
            "counts each P2POp of the batch",
            ("p2p_op_list",),
        )
    )
    rows += [
        row(f"{module}:{name}", "megatron-core binds this collective by name at import", params)
        for module in _MEGATRON_MODULES
        for name, (_, params) in _MEGATRON_BOUND.items()
    ]
    return rows


patches.declare(_counter_patches())


class CommCounter:
    """Record every collective / P2P issued inside the ``with`` block on this rank."""

    def __init__(self, on_record=None) -> None:
        self.records: List[CommRecord] = []
        self.on_record = on_record  # called with each new record (e.g. to interleave a trace)
        self._originals: Dict[tuple, object] = {}

    # -- recording -------------------------------------------------------------------------
    def _record(self, op: str, fn, args, kwargs) -> None:
        if getattr(_suppress, "on", False):
            return
        name, factor = _SPEC[op]
        op = _RECORDED_AS.get(op, op)
        bound = _signature(fn).bind_partial(*args, **kwargs).arguments
        tensor = bound[name]
        d = _group_size(bound.get("group"))
        n = _nbytes(tensor)
        received = factor(d) * n
        if op == "all_to_all_single" and _split_sizes(bound.get("output_split_sizes")):
            received = _all_to_all_v_received(bound)
        record = CommRecord(
            op,
            d,
            n,
            received,
            "bwd" if _in_backward() else "fwd",
            current_scope(),
            _dtype(tensor),
        )
        self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)

    def _wrap(self, op: str, fn):
        original = getattr(fn, "__wrapped__", fn)
        call = self._undeprecated(op, fn)

        def wrapper(*args, **kwargs):
            self._record(op, original, args, kwargs)
            return call(*args, **kwargs)

        wrapper.__wrapped__ = fn
        return wrapper

    def _undeprecated(self, op: str, fn):
        """``fn``, or torch's new function when ``fn`` is torch's deprecated ``op``. Compared
        with the unpatched functions: ``c10d`` keeps the new names unwrapped (see ``__enter__``)."""
        new = getattr(dist.distributed_c10d, _RENAMED.get(op, ""), None)
        deprecated = self._originals.get((dist, op), getattr(dist, op, None))
        return new if new is not None and fn is deprecated else fn

    def _wrap_batch(self, fn):
        def wrapper(p2p_op_list):
            for p in p2p_op_list:
                name = getattr(getattr(p.op, "__wrapped__", p.op), "__name__", "irecv")
                name = name if name in ("isend", "irecv") else "irecv"
                self._record(name, self._originals[(dist, name)], (p.tensor, p.peer, p.group), {})
            _suppress.on = True
            try:
                return fn(p2p_op_list)
            finally:
                _suppress.on = False

        return wrapper

    # -- patching ------------------------------------------------------------------------------
    def _megatron_modules(self):
        """megatron-core modules that bind collectives by name at import time."""
        for name in _MEGATRON_MODULES:
            try:
                yield importlib.import_module(name)
            except ImportError:  # megatron-core is optional for the counter
                pass

    def __enter__(self) -> "CommCounter":
        c10d = dist.distributed_c10d
        for op in _SPEC:
            if hasattr(dist, op):
                wrapped = self._wrap(op, getattr(dist, op))
                self._patch(dist, op, wrapped)
                # P2POp validates its op against distributed_c10d's globals: patch those too
                # (not the new names: torch's deprecated old names call them through there).
                same = getattr(c10d, op, None) is self._originals[(dist, op)]
                if same and op not in _RECORDED_AS:
                    self._patch(c10d, op, wrapped)
        for module in self._megatron_modules():
            for name, (op, _) in _MEGATRON_BOUND.items():
                if hasattr(module, name):
                    self._patch(module, name, self._wrap(op, getattr(module, name)))
        batch = self._wrap_batch(dist.batch_isend_irecv)
        self._patch(dist, "batch_isend_irecv", batch)
        return self

    def _patch(self, module, name, value) -> None:
        self._originals[(module, name)] = getattr(module, name)
        setattr(module, name, value)

    def __exit__(self, *exc) -> None:
        for (module, name), fn in self._originals.items():
            setattr(module, name, fn)
        self._originals.clear()

    # -- summaries -----------------------------------------------------------------------------
    def clear(self) -> None:
        self.records.clear()

    def filter(
        self,
        phase: Optional[str] = None,
        scope: Optional[str] = None,
        ops: Optional[Iterable[str]] = None,
    ) -> List[CommRecord]:
        ops = set(ops) if ops is not None else None
        return [
            r
            for r in self.records
            if (phase is None or r.phase == phase)
            and (scope is None or r.scope == scope or r.scope.startswith(scope + "/"))
            and (ops is None or r.op in ops)
        ]

    def recv_bytes(self, **kw) -> float:
        return sum(r.recv_bytes for r in self.filter(**kw))

    def payload_bytes(self, **kw) -> int:
        return sum(r.payload_bytes for r in self.filter(**kw))

    def by_op(self, **kw) -> Dict[str, Dict[str, float]]:
        out: Dict[str, Dict[str, float]] = defaultdict(
            lambda: {"calls": 0, "payload": 0, "recv": 0.0}
        )
        for r in self.filter(**kw):
            e = out[r.op]
            e["calls"] += 1
            e["payload"] += r.payload_bytes
            e["recv"] += r.recv_bytes
        return dict(out)

    def ops(self, **kw) -> List[str]:
        return [r.op for r in self.filter(**kw)]

    def table(self, **kw) -> str:
        rows = sorted(self.by_op(**kw).items())
        lines = [f"{'op':<24}{'calls':>7}{'payload MB':>13}{'recv MB':>11}"]
        for op, e in rows:
            lines.append(
                f"{op:<24}{e['calls']:>7}{e['payload'] / 2**20:>13.3f}{e['recv'] / 2**20:>11.3f}"
            )
        return "\n".join(lines)


def label_modules(model: torch.nn.Module, labels: Dict[type, str]) -> List:
    """Attach hooks so collectives issued inside modules of the given types (forward and
    backward) carry ``labels[type]`` as their scope. Returns the hook handles."""
    handles = []
    for module in model.modules():
        label = next((name for cls, name in labels.items() if isinstance(module, cls)), None)
        if label is None:
            continue
        tokens: list = []

        def push(*_args, _label=label, _tokens=tokens):
            _tokens.append(_scope.set(_scope.get() + (_label,)))

        def pop(*_args, _tokens=tokens):
            if _tokens:
                _scope.reset(_tokens.pop())

        handles.append(module.register_forward_pre_hook(push))
        handles.append(module.register_forward_hook(pop))
        handles.append(module.register_full_backward_pre_hook(push))
        handles.append(module.register_full_backward_hook(pop))
    return handles
