"""Where a transfer's ``wait()`` sits: no kernel touching a buffer that an asynchronous transfer of
``megatron_tsp.core.comm`` still owns is queued before that transfer's ``wait()``.

On a GPU ``wait()`` orders the compute stream after the transfer: a kernel queued before it may
run while the transfer still writes its receive buffer or reads its send buffer. So between a
transfer's post and its ``wait()`` no kernel may read or write its receive buffer (nor either role
of a reduce's root buffer, which is read and then written), and none may write its send buffer.
Reading a send buffer is allowed (the weight ring computes with the shard it is sending).

``recording()`` checks that from the host's issue order, generically, for every transfer and
every op of the code inside it:

* each asynchronous ``torch.distributed`` call of ``comm.py`` (the functions of
  ``late_completion.WRAPPED``, reached through ``comm.dist``) records its buffers and their roles
  (send / recv / inout) and is in flight from that call until the ``wait`` event of the
  ``comm.Pending`` it belongs to (``comm.observe``);
* a ``TorchDispatchMode`` sees every op (forward, backward, autograd's own) with the byte spans of
  the tensors it reads and writes (written: the schema's mutable arguments, ``out=`` included;
  view ops and ops that read only a shape, e.g. ``empty_like``, touch no data), and a
  synchronous collective of ``comm`` counts as an op reading its input and writing its output;
* an op that touches the receive bytes, or writes the send bytes, of a transfer in flight is a
  violation naming the op, where it was issued, the buffer and the transfer (and where that was
  posted). A transfer never waited is one too.

It also lists the transfers whose received bytes nothing read after the ``wait()`` (a recorder
that misses the consumers could not see an early one either; the tests assert the list is empty).

Unlike late completion (``tests/late_completion.py``) this does not depend on what a misplaced read
happens to return: it flags the queue position itself, at every D and on every rank. Run it with
late completion off (its emulation reads and writes the buffers inside the transfer calls).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as _real_dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.late_completion import WRAPPED, _global, _is_send, _overlap

_THIS_FILE = os.path.abspath(__file__)
_COMM_FILE = os.path.join("megatron_tsp", "core", "comm.py")

# ops that read no tensor data (a shape, a dtype) or only allocate
_SHAPE_ONLY = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "zeros_like",
    "ones_like",
    "full_like",
    "new_zeros",
    "new_ones",
    "new_full",
    "rand_like",
    "randn_like",
    "sym_size",
    "sym_numel",
    "sym_stride",
    "sym_storage_offset",
    "is_same_size",
    "lift_fresh",
    "resize_",
    "set_",
}


class WaitOrderError(AssertionError):
    """Ops queued before the wait() of a transfer whose buffer they touch."""


def _site() -> str:
    """The innermost frame outside this file, comm.py and torch: where an op or transfer came
    from."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        name = os.path.abspath(frame.filename)
        if name == _THIS_FILE or name.endswith(_COMM_FILE) or f"{os.sep}torch{os.sep}" in name:
            continue
        return f"{os.path.relpath(name)}:{frame.lineno} ({frame.name})"
    return "?"


@dataclass(eq=False)
class _Buffer:
    tensor: torch.Tensor
    role: str  # "send" (read by the transfer), "recv" (written), "inout" (reduce's root)


@dataclass(eq=False)
class _Transfer:
    fn: str
    buffers: List[_Buffer]
    site: str
    ident: Optional[int] = None
    name: str = ""
    read_after_wait: bool = False

    def describe(self) -> str:
        return self.name or f"{self.fn} posted at {self.site}"


class _Tracked:
    """A ``Work`` of a recorded transfer: its ``wait()`` runs with the recording paused (a
    wrapper underneath, e.g. late completion, may copy into the buffers there)."""

    def __init__(self, recorder: "WaitOrder", work, transfer: Optional[_Transfer]):
        self._recorder, self._work, self.transfer = recorder, work, transfer

    def wait(self, *args, **kwargs):
        with self._recorder.paused():
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _operands(func, args, kwargs):
    """(tensors the op touches, tensors it writes) from its schema."""
    touched, written = [], []
    schema_args = func._schema.arguments
    positional = [a for a in schema_args if not a.kwarg_only]
    pairs = list(zip(positional, args)) + [
        (a, kwargs[a.name]) for a in schema_args if a.name in kwargs
    ]
    for arg, value in pairs:
        tensors = _tensors(value)
        touched += tensors
        if arg.alias_info is not None and arg.alias_info.is_write:
            written += tensors
    return touched, written


class _Dist:
    """``torch.distributed`` as comm.py sees it inside ``recording()``: the asynchronous calls of
    ``WRAPPED`` record their buffers; every other name is the wrapped module's."""

    def __init__(self, recorder: "WaitOrder", inner):
        self._recorder, self._inner = recorder, inner

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in WRAPPED or not callable(attr):
            return attr

        def call(*args, **kwargs):
            return self._recorder.transfer(name, attr, args, kwargs)

        return call


def _roles(name: str, real, args, kwargs):
    """(buffers, asynchronous?) of one call of ``torch.distributed.<name>``."""
    import inspect

    if name == "batch_isend_irecv":
        ops = args[0] if args else kwargs["p2p_op_list"]
        return [_Buffer(p.tensor, "send" if _is_send(p) else "recv") for p in ops], True
    bound = inspect.signature(getattr(_real_dist, name)).bind(*args, **kwargs)
    bound.apply_defaults()
    values = bound.arguments
    asynchronous = bool(values.get("async_op", False))
    first, second = list(values.values())[:2]
    if name == "broadcast":
        root = _global(values["group"], values["src"], values["group_src"]) == _real_dist.get_rank()
        return [_Buffer(first, "send" if root else "recv")], asynchronous
    if name == "reduce":
        root = _global(values["group"], values["dst"], values["group_dst"]) == _real_dist.get_rank()
        return [_Buffer(first, "inout" if root else "send")], asynchronous
    # (output, input): all-gathers, reduce-scatters, all-to-all
    return [_Buffer(first, "recv"), _Buffer(second, "send")], asynchronous


@dataclass
class WaitOrder:
    """State of one ``recording()`` context on one rank."""

    in_flight: List[_Transfer] = field(default_factory=list)
    unread: List[_Transfer] = field(default_factory=list)  # waited, received bytes not yet read
    violations: List[str] = field(default_factory=list)
    transfers: int = 0  # asynchronous torch.distributed calls (as late completion counts them)
    ops_checked: int = 0
    _paused: int = 0

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # -- transfers -----------------------------------------------------------------------------
    def transfer(self, name, fn, args, kwargs):
        buffers, asynchronous = _roles(name, fn, args, kwargs)
        touched = [b.tensor for b in buffers]
        written = [b.tensor for b in buffers if b.role != "send"]
        self.check(f"{'' if asynchronous else 'synchronous '}{name}", touched, written)
        with self.paused():
            result = fn(*args, **kwargs)
        if not asynchronous:
            return result
        record = _Transfer(name, buffers, _site())
        self.in_flight.append(record)
        self.transfers += 1
        if isinstance(result, list):  # batch_isend_irecv: the first work carries the record
            return [_Tracked(self, w, record if i == 0 else None) for i, w in enumerate(result)]
        return _Tracked(self, result, record)

    def observe(self, event: str, pending) -> None:
        if event == "post":
            # one Pending may hold several calls (e.g. the two halves of a K/V gather): one
            # record, all their buffers
            records = [w.transfer for w in pending.works if isinstance(w, _Tracked)]
            records = [r for r in records if r is not None]
            if not records:
                return
            record = records[0]
            for other in records[1:]:
                record.buffers += other.buffers
                self.in_flight.remove(other)
            record.ident = pending.ident
            label = f" [{pending.label}]" if pending.label else ""
            record.name = (
                f"{pending.op} '{pending.payload}' #{pending.ident}{label} posted at {record.site}"
            )
        elif event == "wait":
            done = [t for t in self.in_flight if t.ident == pending.ident]
            for t in done:
                self.in_flight.remove(t)
                if any(b.role != "send" for b in t.buffers):
                    self.unread.append(t)

    # -- ops -----------------------------------------------------------------------------------
    def check(self, what: str, touched, written) -> None:
        """An op (or a transfer's call) touching ``touched`` and writing ``written``, issued now."""
        if not (self.in_flight or self.unread):
            return
        self.ops_checked += 1
        site = None
        for t in self.in_flight:
            for i, buf in enumerate(t.buffers):
                hits = written if buf.role == "send" else touched
                hit = next((x for x in hits if _overlap(x, buf.tensor)), None)
                if hit is None:
                    continue
                site = site or _site()
                verb = "writes" if any(x is hit for x in written) else "reads"
                self.violations.append(
                    f"{what} at {site} {verb} {tuple(hit.shape)} in the {buf.role} buffer {i} "
                    f"{tuple(buf.tensor.shape)} of {t.describe()}, before its wait()"
                )
        for t in list(self.unread):
            if any(_overlap(x, b.tensor) for b in t.buffers if b.role != "send" for x in touched):
                t.read_after_wait = True
                self.unread.remove(t)

    def close(self) -> List[str]:
        for t in self.in_flight:
            self.violations.append(f"{t.describe()}: never waited")
        self.in_flight = []
        return self.violations


class _OpMode(TorchDispatchMode):
    def __init__(self, recorder: WaitOrder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.recorder
        if not rec._paused and (rec.in_flight or rec.unread):
            name = func.overloadpacket.__name__
            if not func.is_view and name not in _SHAPE_ONLY and func.namespace != "c10d":
                touched, written = _operands(func, args, kwargs)
                if touched:
                    rec.check(f"{func}", touched, written)
        return func(*args, **kwargs)


_active: Optional[WaitOrder] = None
last = {}  # summary of the last context closed on this rank (tests read it)


@contextlib.contextmanager
def recording():
    """Check the wait order of every transfer ``comm.py`` posts inside the context (this rank);
    raises ``WaitOrderError`` on exit listing every violation (all ranks finish the body first,
    so none is left waiting in a collective). Yields the ``WaitOrder`` state."""
    global _active, last
    from megatron_tsp.core import comm

    if _active is not None:
        raise RuntimeError("wait-order recording is already on on this rank")
    state = _active = WaitOrder()
    saved = comm.dist
    comm.dist = _Dist(state, saved)
    remove = comm.observe(state.observe)
    try:
        try:
            with _OpMode(state):
                yield state
        except BaseException as exc:
            violations = state.close()
            if violations:
                exc.add_note(_report(violations))
            raise
        violations = state.close()
        if violations:
            raise WaitOrderError(_report(violations))
    finally:
        remove()
        comm.dist, _active = saved, None
        last = {
            "transfers": state.transfers,
            "ops_checked": state.ops_checked,
            "unread": [(t.fn, t.describe()) for t in state.unread],
        }


def _report(violations: List[str]) -> str:
    rank = _real_dist.get_rank() if _real_dist.is_initialized() else 0
    shown = violations[:20]
    more = f"\n  ... and {len(violations) - len(shown)} more" if len(violations) > 20 else ""
    lines = "\n".join(f"  - {v}" for v in shown)
    return f"wait order: {len(violations)} violation(s) on rank {rank}:\n{lines}{more}"
