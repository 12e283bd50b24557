"""Point-to-point and rooted collectives used by the TSP layers.

All functions take an explicit process group and use plain ``torch.distributed`` calls, so they
run unchanged on gloo (CPU tests), NCCL (GPU) and the ``fake`` backend (full-scale memory runs).
Weight shards travel as ONE flat buffer per message (``FlatShard``) so that a ring step or a
broadcast is a single transfer whatever the layer's parameter count.

Asynchronous collectives return a ``Pending`` handle: ``wait()`` completes the transfer and returns
its result (with any post-processing, e.g. the zigzag reorder of a gathered K/V). ``observe``
registers a callback that sees every post and wait, with the transfer's kind, payload name and
size (the overlap and queue-order trace tests use it; production code never imports the counter).
Receive buffers come from ``WORKSPACE``: persistent buffers keyed by (purpose, slot, shape, dtype,
device), reused by every layer and step instead of being allocated per call.

Queue model (what post order means on a GPU). Megatron-LM runs with
``CUDA_DEVICE_MAX_CONNECTIONS=1``: the compute stream and NCCL's stream feed ONE hardware queue,
which launches work in the order the host issued it (FIFO across streams). NCCL runs the
point-to-point and collective operations of a communicator one after another on its stream, so a
transfer's kernel cannot launch before the previous transfer on that communicator has finished;
while it waits at the head of the queue, every kernel issued after it waits too, whatever stream it
is on. Consequences for the order of posts in a layer:

* two transfers posted back to back (no compute issued between them) stall everything issued
  after the second until the first has completed; if the first is not needed yet, that stall is
  pure loss. So post the transfer that is needed soon (the next weight shard) before the one
  needed later (a gradient accumulator), and issue compute between consecutive posts that covers
  the earlier transfer, unless the earlier one has already been waited for (needed) anyway;
* a transfer posted right after its producer kernels and waited right before its consumer
  overlaps exactly the kernels issued in between, and nothing else;
* ``wait()`` on a GPU only orders the compute stream after the transfer (no host block), so
  waiting early for a transfer that has necessarily finished costs nothing.

gloo (the CPU tests) completes transfers eagerly and shows none of this; the order is checked from
the trace (``tests/checks_overlap.queue_stalls``) instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist


class FlatShard:
    """Views of several tensors laid out back to back in one contiguous buffer."""

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        dtype: torch.dtype,
        device: torch.device,
        buffer: Optional[torch.Tensor] = None,
    ):
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [s.numel() for s in self.shapes]
        total = sum(self.numels)
        self.buffer = (
            buffer if buffer is not None else torch.empty(total, dtype=dtype, device=device)
        )

    @classmethod
    def like(cls, other: "FlatShard") -> "FlatShard":
        return cls(other.shapes, other.buffer.dtype, other.buffer.device)

    @classmethod
    def pack(cls, tensors: Sequence[torch.Tensor]) -> "FlatShard":
        flat = cls([t.shape for t in tensors], tensors[0].dtype, tensors[0].device)
        for view, t in zip(flat.views(), tensors):
            view.copy_(t)
        return flat

    def views(self) -> List[torch.Tensor]:
        return [
            chunk.view(shape) for chunk, shape in zip(self.buffer.split(self.numels), self.shapes)
        ]

    def zero_(self) -> "FlatShard":
        self.buffer.zero_()
        return self


def weight_bias_views(views: Sequence[torch.Tensor], has_bias: bool):
    """(first weight, bias or None, second weight) from a shard packed as [w, (b), w2]."""
    return (views[0], views[1], views[2]) if has_bias else (views[0], None, views[1])


def ring_neighbours(group) -> tuple[int, int]:
    """Global ranks of the next (rank+1) and previous (rank-1) members of the group."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    return nxt, prv


# --------------------------------------------------------------------------------------------
# labels: which layer issued a transfer (read by diagnostics from outside, e.g. the counter)

_labels: contextvars.ContextVar[tuple] = contextvars.ContextVar("tsp_comm_labels", default=())


@contextlib.contextmanager
def labelled(name: str):
    """Label the collectives issued inside (nested labels are joined with '/'). The layers label
    their own traffic; ``megatron_tsp.tools.comm_counter`` reads the label, the core never imports
    the counter."""
    token = _labels.set(_labels.get() + (name,))
    try:
        yield
    finally:
        _labels.reset(token)


def current_label() -> str:
    return "/".join(_labels.get())


def current_labels() -> tuple:
    """The label context as it stands (for ``labelled_as``)."""
    return _labels.get()


@contextlib.contextmanager
def labelled_as(labels: tuple):
    """Issue under ``labels``, a context captured with ``current_labels`` elsewhere: a transfer
    one layer posts early on another's behalf (``layers.kv_prefetch``) stays its owner's traffic
    for whoever reads the labels."""
    token = _labels.set(labels)
    try:
        yield
    finally:
        _labels.reset(token)


# --------------------------------------------------------------------------------------------
# pending transfers and their observers

_observers: List[Callable[[str, "Pending"], None]] = []
_ids = itertools.count()


def observe(callback: Callable[[str, "Pending"], None]) -> Callable[[], None]:
    """Call ``callback(event, transfer)`` for every ``"post"`` and ``"wait"`` of a ``Pending``
    transfer (read ``transfer.ident``, ``.op``, ``.payload``, ``.nbytes``, ``.label``; the
    object is finished after its wait, so copy what you need); returns a function that removes
    the callback."""
    _observers.append(callback)

    def remove() -> None:
        if callback in _observers:
            _observers.remove(callback)

    return remove


def _notify(event: str, transfer: "Pending") -> None:
    for callback in list(_observers):
        callback(event, transfer)


class Pending:
    """An asynchronous transfer in flight. ``wait()`` blocks until it is done and returns
    ``finish()`` (or None); waiting twice is harmless.

    ``payload`` names what travels (e.g. ``"mlp.weights"``), ``nbytes`` is the size of this
    rank's contribution (the send buffer of a ring step, the buffer of a broadcast or reduce, the
    local block of an all-gather, the full input of a reduce-scatter); ``label`` is the layer's
    ``labelled`` context at the post. Observers read them to check order and sizes."""

    def __init__(
        self,
        op: str,
        works: Sequence = (),
        finish: Optional[Callable] = None,
        payload: str = "",
        nbytes: int = 0,
    ):
        self.op, self.works, self._finish = op, [w for w in works if w is not None], finish
        self.payload, self.nbytes, self.label = payload or op, int(nbytes), current_label()
        self.ident = next(_ids)
        self._done, self._result = False, None
        _notify("post", self)

    def wait(self):
        if not self._done:
            for work in self.works:
                work.wait()
            _notify("wait", self)
            self._result = self._finish() if self._finish is not None else None
            self._done, self.works, self._finish = True, [], None
        return self._result


def done(value=None, op: str = "local") -> Pending:
    """A completed transfer (group of size 1): no events, ``wait()`` returns ``value``."""
    pending = Pending.__new__(Pending)
    pending.op, pending.works, pending._finish = op, [], None
    pending.payload, pending.nbytes, pending.label = op, 0, current_label()
    pending.ident, pending._done, pending._result = -1, True, value
    return pending


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def ring_exchange(send: torch.Tensor, recv: torch.Tensor, group, payload: str = "") -> Pending:
    """Post ``send -> rank+1`` and ``recv <- rank-1`` together (``payload`` names what travels,
    for observers)."""
    nxt, prv = ring_neighbours(group)
    ops = [
        dist.P2POp(dist.isend, send, nxt, group),
        dist.P2POp(dist.irecv, recv, prv, group),
    ]
    return Pending(
        "ring_exchange", dist.batch_isend_irecv(ops), payload=payload, nbytes=_nbytes(send)
    )


# --------------------------------------------------------------------------------------------
# persistent communication buffers


class Workspace:
    """Persistent buffers keyed by (purpose, slot, shape, dtype, device). A caller owns a slot
    until it posts the next transfer into the same (purpose, slot): the TSP layers alternate two
    slots so that one head group's buffer is read while the next one's is being filled.

    Buffers created under a ``FakeTensorMode`` are kept apart from real ones (the mode's identity
    is part of the key), so the memory tool's fake runs and real runs never share one."""

    def __init__(self):
        self._buffers: Dict[tuple, tuple] = {}

    def get(
        self, purpose: str, slot: int, shape, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        from torch._guards import active_fake_mode

        mode = active_fake_mode()
        key = (purpose, slot, tuple(shape), dtype, torch.device(device), id(mode))
        entry = self._buffers.get(key)
        if entry is None or entry[0] is not mode:  # the mode is held, so its id is not reused
            entry = self._buffers[key] = (
                mode,
                torch.empty(tuple(shape), dtype=dtype, device=device),
            )
        return entry[1]

    def clear(self) -> None:
        self._buffers.clear()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for _, b in self._buffers.values())


WORKSPACE = Workspace()


def broadcast_from(buffer: torch.Tensor, owner: int, group, async_op: bool = True):
    """Broadcast ``buffer`` from group rank ``owner`` to every member of the group (a ``Pending``
    when ``async_op``)."""
    work = dist.broadcast(
        buffer, src=dist.get_global_rank(group, owner), group=group, async_op=async_op
    )
    return Pending("broadcast", [work], nbytes=_nbytes(buffer)) if async_op else work


def reduce_to(buffer: torch.Tensor, owner: int, group, async_op: bool = True):
    """SUM-reduce ``buffer`` over the group onto group rank ``owner`` (a ``Pending`` when
    ``async_op``)."""
    work = dist.reduce(
        buffer, dst=dist.get_global_rank(group, owner), group=group, async_op=async_op
    )
    return Pending("reduce", [work], nbytes=_nbytes(buffer)) if async_op else work


def all_gather_single(output: torch.Tensor, local: torch.Tensor, group, async_op: bool = False):
    """``torch.distributed.all_gather_single`` (torch >= 2.13, where the old name
    ``all_gather_into_tensor`` is deprecated and warns), or the old name on older torch. Looked up
    per call, so a counter that wraps ``torch.distributed`` sees it."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, local, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, full: torch.Tensor, group, async_op: bool = False):
    """SUM ``torch.distributed.reduce_scatter_single`` (torch >= 2.13), or its deprecated old
    name ``reduce_scatter_tensor`` on older torch (see ``all_gather_single``)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, full, group=group, async_op=async_op)


def all_gather_seq(local: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dim 0 in rank order: ``[D * s, ...]`` from each rank's ``[s, ...]``."""
    size = dist.get_world_size(group)
    if size == 1:
        return local
    local = local.contiguous()
    out = torch.empty(
        (size * local.shape[0],) + tuple(local.shape[1:]), dtype=local.dtype, device=local.device
    )
    all_gather_single(out, local, group)
    return out


def post_all_gather(
    local: Union[torch.Tensor, Sequence[torch.Tensor]],
    group,
    slot: int = 0,
    purpose: str = "all_gather",
    finish: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    tail: Optional[torch.Tensor] = None,
) -> Pending:
    """Asynchronous all-gather along dim 0 into a ``WORKSPACE`` buffer ``[D * s, ...]``;
    ``wait()`` returns ``finish(gathered)`` (or the buffer).

    ``local`` may be a sequence of tensors (one collective each, one ``Pending``): part i's
    gather ``[D * s_i, ...]`` follows part i-1's in the one buffer. ``tail``: local rows
    copied after the gathered ones (no collective; a group of one rank ignores it), for a
    reader that wants them next to gathered rows in one buffer."""
    parts = [local] if isinstance(local, torch.Tensor) else list(local)
    size = dist.get_world_size(group)
    if size == 1:
        whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return done(finish(whole) if finish is not None else whole)
    parts = [p.contiguous() for p in parts]
    first = parts[0]
    rows = [size * p.shape[0] for p in parts]
    extra = 0 if tail is None else tail.shape[0]
    out = WORKSPACE.get(
        purpose, slot, (sum(rows) + extra,) + tuple(first.shape[1:]), first.dtype, first.device
    )
    works, start = [], 0
    for p, n in zip(parts, rows):
        works.append(all_gather_single(out.narrow(0, start, n), p, group, async_op=True))
        start += n
    if tail is not None:
        out.narrow(0, start, extra).copy_(tail)
    return Pending(
        "all_gather_into_tensor",
        works,
        (lambda: finish(out)) if finish is not None else (lambda: out),
        payload=purpose,
        nbytes=sum(_nbytes(p) for p in parts),
    )


def post_reduce_scatter(
    full: Union[torch.Tensor, Sequence[torch.Tensor]],
    group,
    slot: int = 0,
    purpose: str = "reduce_scatter",
) -> Pending:
    """Asynchronous SUM reduce-scatter of ``[D * s, ...]`` into a ``WORKSPACE`` buffer; ``wait()``
    returns this rank's block ``[s, ...]``. ``full`` must stay untouched until then.

    ``full`` may be a sequence of such tensors (one collective each, one ``Pending``): their
    blocks land one after another in the one buffer, ``[s_0 + s_1 + ..., ...]``."""
    parts = [full] if isinstance(full, torch.Tensor) else list(full)
    size = dist.get_world_size(group)
    if size == 1:
        return done(parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))
    parts = [p.contiguous() for p in parts]
    first = parts[0]
    rows = [p.shape[0] // size for p in parts]
    out = WORKSPACE.get(
        purpose, slot, (sum(rows),) + tuple(first.shape[1:]), first.dtype, first.device
    )
    works, start = [], 0
    for p, n in zip(parts, rows):
        works.append(reduce_scatter_single(out.narrow(0, start, n), p, group, async_op=True))
        start += n
    return Pending(
        "reduce_scatter_tensor",
        works,
        lambda: out,
        payload=purpose,
        nbytes=sum(_nbytes(p) for p in parts),
    )


def post_all_to_all_sum(
    full: Union[torch.Tensor, Sequence[torch.Tensor]],
    group,
    sum_dtype: torch.dtype,
    slot: int = 0,
    purpose: str = "all_to_all_sum",
) -> Pending:
    """The reduce-scatter of ``post_reduce_scatter`` as an all-to-all: block j of ``full``
    ``[D * s, ...]`` goes to rank j, which receives every rank's block for its rows into a
    ``WORKSPACE`` buffer the size of ``full`` and sums the D blocks in ``sum_dtype``;
    ``wait()`` returns that ``[s, ...]`` sum. Same bytes as the reduce-scatter, but the partials
    are added once, in ``sum_dtype``, where a ring reduce-scatter rounds to the wire dtype at
    every hop. ``full`` must stay untouched until ``wait()``. A sequence of tensors: one
    all-to-all each, their sums one after another, as ``post_reduce_scatter``."""
    parts = [full] if isinstance(full, torch.Tensor) else list(full)
    size = dist.get_world_size(group)
    if size == 1:
        whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return done(whole.to(sum_dtype))
    parts = [p.contiguous() for p in parts]
    first = parts[0]
    total = sum(p.shape[0] for p in parts)
    received = WORKSPACE.get(
        purpose, slot, (total,) + tuple(first.shape[1:]), first.dtype, first.device
    )
    works, views, start = [], [], 0
    for p in parts:
        view = received.narrow(0, start, p.shape[0])
        works.append(dist.all_to_all_single(view, p, group=group, async_op=True))
        views.append(view)
        start += p.shape[0]

    def summed():
        shape = (total // size,) + tuple(first.shape[1:])
        out, row = torch.empty(shape, dtype=sum_dtype, device=first.device), 0
        for v in views:
            block = v.view((size, v.shape[0] // size) + tuple(v.shape[1:]))
            torch.sum(block, 0, dtype=sum_dtype, out=out.narrow(0, row, block.shape[1]))
            row += block.shape[1]
        return out

    return Pending(
        "all_to_all_single",
        works,
        summed,
        payload=purpose,
        nbytes=sum(_nbytes(p) for p in parts),
    )


def reduce_scatter_seq(full: torch.Tensor, group) -> torch.Tensor:
    """SUM-reduce a ``[D * s, ...]`` tensor over the group; rank r keeps rows of block r."""
    size = dist.get_world_size(group)
    if size == 1:
        return full
    full = full.contiguous()
    out = torch.empty(
        (full.shape[0] // size,) + tuple(full.shape[1:]), dtype=full.dtype, device=full.device
    )
    reduce_scatter_single(out, full, group)
    return out
