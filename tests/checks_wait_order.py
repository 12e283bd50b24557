"""Rank-side checks of where waits sit (``tests/wait_order.py``): any check of the pool run with
the wait-order recording on (``under_wait_order``), the recorder's own reports on hand-made
misuses of ``comm``'s transfers, and a planted weight ring that waits one step late. They enter
the recording themselves; the pool runs them with ``late_completion=False``."""

from __future__ import annotations

import contextlib
import importlib

import torch
import torch.distributed as dist

from megatron_tsp.core import comm
from tests import wait_order
from tests.wait_order import WaitOrderError


def under_wait_order(module: str, name: str, *args, **kwargs) -> dict:
    """``module.name(*args, **kwargs)`` with the wait order recorded (raises on a violation):
    ``{"result": its result, "transfers": transfers posted, "unread": transfers whose received
    bytes nothing read after their wait}``."""
    fn = getattr(importlib.import_module(module), name)
    with wait_order.recording():
        result = fn(*args, **kwargs)
    return {"result": result, **wait_order.last}


def _violations(body) -> str:
    """The wait-order report of running ``body`` ("" when it reported nothing)."""
    try:
        with wait_order.recording():
            body()
    except WaitOrderError as error:
        return str(error)
    return ""


def _reported(body) -> str:
    message = _violations(body)
    if not message:
        raise AssertionError("the wait-order recording reported nothing")
    return message


def check_recorder_reports() -> dict:
    """Hand-made misuses on the world group: the report of each, and a clean pattern's summary."""
    group = dist.group.WORLD
    rank = dist.get_rank(group)
    out = {}

    def fresh():
        return torch.arange(8, dtype=torch.float64) + 10 * rank, torch.empty(8, dtype=torch.float64)

    def read_recv_early():
        send, recv = fresh()
        pending = comm.ring_exchange(send, recv, group, "early_read")
        recv[:4].sum()  # the received shard read before its wait
        pending.wait()

    def write_send_early():
        send, recv = fresh()
        pending = comm.ring_exchange(send, recv, group, "early_write")
        send[6:].mul_(2)  # the shard on the wire written before its wait
        pending.wait()
        recv.sum()

    def reduce_root_early():
        buf = torch.ones(4, dtype=torch.float64)
        pending = comm.reduce_to(buf, 0, group)
        buf.add_(1) if rank == 0 else buf.sum()  # only the root's buffer is written
        pending.wait()
        buf.sum()

    def post_into_busy_buffer():
        send, recv = fresh()
        first = comm.ring_exchange(send, recv, group, "first")
        second = comm.ring_exchange(recv, send.clone(), group, "second")  # sends unreceived data
        first.wait()
        second.wait()

    out["read_recv"] = _reported(read_recv_early)
    out["write_send"] = _reported(write_send_early)
    out["reduce_root"] = _violations(reduce_root_early)  # the root's report only
    out["post_busy"] = _reported(post_into_busy_buffer)

    held = []

    def never_waited():
        held.append(comm.broadcast_from(torch.zeros(3), 0, group))

    out["never_waited"] = _reported(never_waited)
    held[0].wait()

    # clean: the send shard read and the next one computed while in flight, the received one
    # read after the wait; one received buffer never read is listed as unread
    with wait_order.recording():
        send, recv = fresh()
        pending = comm.ring_exchange(send, recv, group, "clean")
        (send * 2).sum()
        pending.wait()
        recv.sum()
        comm.broadcast_from(torch.zeros(3), 1, group).wait()
    out["clean"] = dict(wait_order.last)
    return out


# --------------------------------------------------------------------------------------------
# a planted weight ring: every hop waited one step late, after the GEMMs that read its shard


def _late_wait_shards(params, group, payload):
    from megatron_tsp.core.comm import FlatShard, done, ring_exchange

    size = dist.get_world_size(group)
    if size == 1:
        yield 0, list(params)
        return
    current = FlatShard.pack(params)
    spare = [FlatShard.like(current) for _ in range(min(size - 1, 2))]
    behind = done()
    for t in range(size):
        incoming, pending = None, done()
        if t < size - 1:
            incoming = spare[t % len(spare)]
            pending = ring_exchange(current.buffer, incoming.buffer, group, payload)
        yield t, current.views()
        behind.wait()  # the previous hop, whose shard was just used: one step late
        behind = pending
        if incoming is not None:
            current = incoming
    behind.wait()


@contextlib.contextmanager
def planted_late_ring_wait():
    """``weight_ring.shards`` (the MLP, vocabulary and expert rings' forward) replaced by
    ``_late_wait_shards``."""
    from megatron_tsp.core.layers import weight_ring

    original = weight_ring.shards
    weight_ring.shards = _late_wait_shards
    try:
        yield
    finally:
        weight_ring.shards = original


def check_planted_late_wait(d: int, seed: int) -> str:
    """The MLP parity check with the planted ring under the recording: the report (fails if none;
    the parity itself may pass on gloo, which has usually delivered the shard already)."""
    from tests import checks_layers

    def body():
        with planted_late_ring_wait():
            try:
                checks_layers.check_mlp(
                    d, seed, "float64", gated=False, bias=True, seq=8, batch=2, hidden=8,
                    ffn=16, activation="gelu", recompute_activation=False,
                )  # fmt: skip
            except AssertionError:
                pass  # a parity failure (an unfinished hop read) is not what is checked here

    return _reported(body)
