"""Late completion: the asynchronous transfers of ``megatron_tsp.core.comm`` complete as late as
a GPU allows, so that a buffer touched while its transfer may still run fails a CPU test.

On gloo a posted collective runs at once on a background thread and is usually done long before
anyone waits for it; on NCCL it runs on another stream and may read its send buffer and write its
receive buffer at any moment between the post and ``wait()``. Code that reads a receive buffer
early, writes a send buffer before the wait, or posts a second transfer into a buffer that an
earlier one still owns therefore passes on gloo and corrupts data on a GPU. Inside ``enabled()``
every asynchronous transfer that ``comm.py`` posts is emulated the GPU's way:

* send buffers are read only when the transfer completes: a copy is taken at the post and compared
  (bitwise) with the buffer when the transfer runs and again at ``wait()``; a difference is a
  violation naming the transfer (and the message carries the written values, as on a GPU);
* receive buffers hold garbage from the post until ``wait()``: NaN for floating types (a sentinel
  for integers) is written at the post, the real result lands only at ``wait()``, and a receive
  buffer found no longer holding the garbage at ``wait()`` (written meanwhile) is a violation;
* completion comes no earlier than ``wait()``: the real gloo operation runs, into private buffers,
  no earlier than the first ``wait()`` that needs it. Transfers run in post order, as on one
  hardware queue, so every rank issues them to gloo in the same order whatever order they are
  waited in (a synchronous collective posted through ``comm`` first runs those still queued);
* a transfer posted while an earlier one that has not been waited uses an overlapping buffer
  (unless both only read it) is a violation naming both;
* a transfer never waited is named when the context closes (it is run then, so the other ranks
  do not hang on it).

Violations are collected and raised together when the context closes (``LateCompletionError``),
not at the offending line: a rank that raised mid-way would leave the others blocked in the next
collective. A read of a receive buffer before its wait is not detected as such; it reads NaN,
which the checks' ``assert_close`` reports.

The wrapper replaces ``comm.dist`` (the ``torch.distributed`` module as ``comm.py`` sees it) with
a proxy; every other module, the stock Megatron references of the checks included, keeps the real
functions. ``tests/test_late_completion.py`` scans ``megatron_tsp/core`` so that no other module
posts an asynchronous transfer, and checks that every collective ``comm.py`` calls is in
``WRAPPED``. Functions are looked up on ``torch.distributed`` when the transfer runs, so a
``CommCounter`` entered around the check still counts them (at completion, not at the post: the
post-order trace tests run with late completion off).

The rank pool runs a check in this mode with ``pool.run(fn, ..., late_completion=True)``, or every
check of a pool with ``RankPool(..., late_completion=True)`` / ``TSP_TEST_LATE_COMPLETION=1``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import traceback
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
import torch.distributed as _real_dist

ENV = "TSP_TEST_LATE_COMPLETION"

# The torch.distributed functions of comm.py that can post an asynchronous transfer
# (``isend`` / ``irecv`` only travel inside ``P2POp``s handed to ``batch_isend_irecv``).
WRAPPED = (
    "broadcast",
    "reduce",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "batch_isend_irecv",
)

_THIS_FILE = os.path.abspath(__file__)


def env_enabled() -> bool:
    """Whether ``TSP_TEST_LATE_COMPLETION=1`` asks for the whole pool in late-completion mode."""
    return os.environ.get(ENV, "0") == "1"


class LateCompletionError(AssertionError):
    """Buffers touched while their transfer could still run, or transfers never waited."""


def _poison(t: torch.Tensor) -> None:
    """Garbage in a receive buffer: NaN (floating), the type's max (integers), True (bool)."""
    with torch.no_grad():
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        else:
            t.fill_(torch.iinfo(t.dtype).max)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included)."""
    return torch.equal(_bits(a), _bits(b))


def _still_poisoned(t: torch.Tensor) -> bool:
    garbage = torch.empty_like(t)
    _poison(garbage)
    return _same_bits(t, garbage)


def _span(t: torch.Tensor) -> tuple:
    """[first byte, last byte + 1) of the memory a tensor view can touch."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) + 1
    return start, start + extent * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _emulated(*tensors) -> bool:
    """Real CPU/GPU tensors only: fake and meta tensors (memory tools) pass straight through."""
    from torch._subclasses.fake_tensor import FakeTensor

    return all(not isinstance(t, FakeTensor) and t.device.type != "meta" for t in tensors)


def _post_site() -> str:
    """The innermost caller outside comm.py, this file and torch: where the transfer was posted."""
    comm_file = os.path.join("megatron_tsp", "core", "comm.py")
    for frame in reversed(traceback.extract_stack()[:-1]):
        name = os.path.abspath(frame.filename)
        if name == _THIS_FILE or name.endswith(comm_file) or f"{os.sep}torch{os.sep}" in name:
            continue
        return f"{os.path.relpath(name)}:{frame.lineno} ({frame.name})"
    return "?"


@dataclass
class _Buffer:
    tensor: torch.Tensor
    role: str  # "send" (read), "recv" (written) or "inout" (read, then written: reduce's root)
    copy: Optional[torch.Tensor] = None  # send/inout: the contents at the post
    result: Optional[torch.Tensor] = None  # recv/inout: where the real transfer writes

    @property
    def writes(self) -> bool:
        return self.role != "send"


@dataclass
class LateOp:
    """A posted transfer; ``wait()`` completes it (``Work``'s interface)."""

    emulator: "LateCompletion"
    name: str
    buffers: List[_Buffer]
    run: Callable[[], None]  # the real, synchronous gloo transfer into the private buffers
    ran: bool = False
    waited: bool = False
    bad: set = field(default_factory=set)  # indices of buffers already reported

    def wait(self, timeout=None) -> bool:
        self.emulator.complete(self)
        return True

    def is_completed(self) -> bool:
        return self.waited

    def __str__(self) -> str:
        return self.name


class LateCompletion:
    """State of one ``enabled()`` context on one rank."""

    def __init__(self):
        self.queue: List[LateOp] = []  # posted, not yet run (post order)
        self.in_flight: List[LateOp] = []  # posted, not yet waited
        self.violations: List[str] = []
        self.posted = 0
        self._ids = itertools.count()

    # -- posting -------------------------------------------------------------------------------
    def post(self, fn_name: str, buffers: List[_Buffer], run: Callable[[], None]) -> LateOp:
        from megatron_tsp.core import comm

        label = f" [{comm.current_label()}]" if comm.current_label() else ""
        name = f"{fn_name} #{next(self._ids)}{label} posted at {_post_site()}"
        op = LateOp(self, name, buffers, run)
        self._check_reuse(op.name, buffers)
        with torch.no_grad():
            for buf in buffers:
                if buf.role in ("send", "inout"):
                    buf.copy = buf.tensor.detach().clone()
                if buf.writes:
                    buf.result = torch.empty_like(buf.tensor)
                    _poison(buf.tensor)
        self.queue.append(op)
        self.in_flight.append(op)
        self.posted += 1
        return op

    def _check_reuse(self, name: str, buffers: List[_Buffer]) -> None:
        """A new transfer's buffer overlapping a buffer of a transfer still in flight, where one
        of the two writes it: on a GPU the two race."""
        for other in self.in_flight:
            for new in buffers:
                for old in other.buffers:
                    if (new.writes or old.writes) and _overlap(new.tensor, old.tensor):
                        self.violations.append(
                            f"{name}: its {new.role} buffer {tuple(new.tensor.shape)} overlaps "
                            f"the {old.role} buffer of {other.name}, still in flight (not waited)"
                        )

    def before_sync(self, fn_name: str, buffers: List[_Buffer]) -> None:
        """A synchronous collective through comm: earlier transfers run first (queue order); its
        buffers must not race with those of a transfer still in flight."""
        self.flush()
        self._check_reuse(f"synchronous {fn_name} at {_post_site()}", buffers)

    # -- running and completing ----------------------------------------------------------------
    def _check_sends(self, op: LateOp, when: str) -> None:
        """Send buffers as at the post, receive buffers still holding the garbage (once per
        buffer: a write seen when the transfer ran is not reported again at its wait)."""
        for i, buf in enumerate(op.buffers):
            if i in op.bad:
                continue
            if buf.role == "send" and not _same_bits(buf.tensor, buf.copy):
                what = "a GPU sends what is there at completion"
            elif buf.writes and not _still_poisoned(buf.tensor):
                what = "the transfer owns it until then"
            else:
                continue
            op.bad.add(i)
            self.violations.append(
                f"{op.name}: {buf.role} buffer {i} {tuple(buf.tensor.shape)} was written after "
                f"the post, before {when} ({what})"
            )

    def flush(self, upto: Optional[LateOp] = None) -> None:
        """Run queued transfers in post order (up to and including ``upto``; all when None)."""
        while self.queue:
            op = self.queue.pop(0)
            self._check_sends(op, "the transfer ran")
            op.run()
            op.ran = True
            if op is upto:
                return

    def complete(self, op: LateOp) -> None:
        if op.waited:
            return
        if not op.ran:
            self.flush(upto=op)
        self._check_sends(op, "wait()")
        with torch.no_grad():
            for buf in op.buffers:
                if buf.writes:
                    buf.tensor.copy_(buf.result)
                buf.copy = buf.result = None
        op.waited = True
        self.in_flight.remove(op)

    def close(self) -> List[str]:
        """Run what is still queued (the other ranks expect it), name the transfers never waited;
        returns every violation of the context."""
        self.flush()
        for op in self.in_flight:
            self.violations.append(f"{op.name}: never waited")
        self.in_flight = []
        return self.violations


def _global(group, rank: Optional[int], group_rank: Optional[int]) -> int:
    return rank if group_rank is None else _real_dist.get_global_rank(group, group_rank)


class _LateDist:
    """``torch.distributed`` as comm.py sees it inside ``enabled()``: the functions in
    ``WRAPPED`` post late-completing transfers when ``async_op`` (``batch_isend_irecv``:
    always); everything else is the real module's, looked up at each access."""

    def __init__(self, emulator: LateCompletion):
        self._emulator = emulator

    def __getattr__(self, name):
        return getattr(_real_dist, name)

    def _sync(self, name, buffers, *args, **kwargs):
        if _emulated(*[b.tensor for b in buffers]):
            self._emulator.before_sync(name, buffers)
        return getattr(_real_dist, name)(*args, **kwargs)

    # rooted collectives: in place, the root's buffer is sent (broadcast) or also written (reduce)
    def broadcast(self, tensor, src=None, group=None, async_op=False, group_src=None):
        root = _global(group, src, group_src) == _real_dist.get_rank()
        buf = _Buffer(tensor, "send" if root else "recv")
        if not async_op or not _emulated(tensor):
            return self._sync("broadcast", [buf], tensor, src, group, async_op, group_src=group_src)

        def run():
            target = buf.tensor if root else buf.result
            _real_dist.broadcast(target, src, group, group_src=group_src)

        return self._emulator.post("broadcast", [buf], run)

    def reduce(
        self,
        tensor,
        dst=None,
        op=_real_dist.ReduceOp.SUM,
        group=None,
        async_op=False,
        group_dst=None,
    ):
        root = _global(group, dst, group_dst) == _real_dist.get_rank()
        # NCCL leaves a non-root's buffer as it was; only the root's is written.
        buf = _Buffer(tensor, "inout" if root else "send")
        if not async_op or not _emulated(tensor):
            return self._sync(
                "reduce", [buf], tensor, dst, op, group, async_op, group_dst=group_dst
            )

        def run():
            work = buf.copy.clone() if root else buf.tensor.detach().clone()
            _real_dist.reduce(work, dst, op, group, group_dst=group_dst)
            if root:
                buf.result.copy_(work)

        return self._emulator.post("reduce", [buf], run)

    # sequence collectives: (output, input)
    def _gather_scatter(self, name, output, input, *extra, group=None, async_op=False):
        out_buf, in_buf = _Buffer(output, "recv"), _Buffer(input, "send")
        if not async_op or not _emulated(output, input):
            return self._sync(name, [out_buf, in_buf], output, input, *extra, group=group)

        def run():
            getattr(_real_dist, name)(out_buf.result, in_buf.tensor, *extra, group=group)

        return self._emulator.post(name, [out_buf, in_buf], run)

    def all_gather_single(self, output_tensor, input_tensor, group=None, async_op=False):
        return self._gather_scatter(
            "all_gather_single", output_tensor, input_tensor, group=group, async_op=async_op
        )

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        return self._gather_scatter(
            "all_gather_into_tensor", output_tensor, input_tensor, group=group, async_op=async_op
        )

    def reduce_scatter_single(
        self, output, input, op=_real_dist.ReduceOp.SUM, group=None, async_op=False
    ):
        return self._gather_scatter(
            "reduce_scatter_single", output, input, op, group=group, async_op=async_op
        )

    def reduce_scatter_tensor(
        self, output, input, op=_real_dist.ReduceOp.SUM, group=None, async_op=False
    ):
        return self._gather_scatter(
            "reduce_scatter_tensor", output, input, op, group=group, async_op=async_op
        )

    def all_to_all_single(self, output, input, group=None, async_op=False):
        return self._gather_scatter(
            "all_to_all_single", output, input, group=group, async_op=async_op
        )

    # point to point: always asynchronous
    def batch_isend_irecv(self, p2p_op_list):
        if not _emulated(*[p.tensor for p in p2p_op_list]):
            return _real_dist.batch_isend_irecv(p2p_op_list)
        buffers = [_Buffer(p.tensor, "send" if _is_send(p) else "recv") for p in p2p_op_list]

        def run():
            ops = [
                _real_dist.P2POp(
                    p.op,
                    buf.tensor if buf.role == "send" else buf.result,
                    group=p.group,
                    tag=p.tag,
                    group_peer=p.group_peer,
                )
                for p, buf in zip(p2p_op_list, buffers)
            ]
            for work in _real_dist.batch_isend_irecv(ops):
                work.wait()

        return [self._emulator.post("batch_isend_irecv", buffers, run)]


def _is_send(p2p) -> bool:
    op = p2p.op
    while hasattr(op, "__wrapped__"):  # a counter's wrapper
        op = op.__wrapped__
    return getattr(op, "__name__", "") == "isend"


_active: Optional[LateCompletion] = None
last_posted = 0  # transfers posted in the last context closed on this rank (tests read it)


@contextlib.contextmanager
def enabled():
    """Late completion for the transfers ``comm.py`` posts inside the context (this rank); raises
    ``LateCompletionError`` on exit listing every violation. If the body raised, its exception
    propagates with the violations attached as a note."""
    global _active
    from megatron_tsp.core import comm

    if _active is not None:
        raise RuntimeError("late completion is already enabled on this rank")
    emulator = _active = LateCompletion()
    saved, comm.dist = comm.dist, _LateDist(emulator)
    try:
        try:
            yield emulator
        except BaseException as exc:
            try:
                violations = emulator.close()
            except BaseException as during:  # a rank that failed mid-way may not flush cleanly
                violations = emulator.violations + [f"(closing failed: {during!r})"]
            if violations:
                exc.add_note(_report(violations))
            raise
        violations = emulator.close()
        if violations:
            raise LateCompletionError(_report(violations))
    finally:
        global last_posted
        comm.dist, _active, last_posted = saved, None, emulator.posted


def _report(violations: List[str]) -> str:
    lines = "\n".join(f"  - {v}" for v in violations)
    return f"late completion: {len(violations)} violation(s) on rank {_rank()}:\n{lines}"


def _rank() -> int:
    return _real_dist.get_rank() if _real_dist.is_initialized() else 0


def maybe_enabled(on: bool):
    """``enabled()`` when ``on``, else a context that does nothing."""
    return enabled() if on else contextlib.nullcontext()
