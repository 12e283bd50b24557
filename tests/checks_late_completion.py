"""Rank-side checks of the late-completion wrapper itself (``tests/late_completion.py``): each
posts transfers through ``megatron_tsp.core.comm`` on the world group, misuses a buffer the way a
GPU punishes, and returns what the wrapper reported. They enter the mode themselves, so the pool
runs them with ``late_completion=False``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_tsp.core import comm
from tests import late_completion
from tests.late_completion import LateCompletionError


def _world():
    group = dist.group.WORLD
    return group, dist.get_world_size(group), dist.get_rank(group)


def _reported(body) -> str:
    """The violation report of running ``body`` in late-completion mode (fails if none)."""
    try:
        with late_completion.enabled():
            body()
    except LateCompletionError as error:
        return str(error)
    raise AssertionError("late completion reported nothing")


def _rows(size: int, rank: int, dtype=torch.float64) -> torch.Tensor:
    """[2 * size] values distinct per rank and position."""
    return torch.arange(2 * size, dtype=dtype) * 10 + rank


def check_send_written_before_wait() -> dict:
    """A send buffer written between post and wait: reported naming the transfer and its post
    site, and the message carries the written values (a GPU reads it at completion). The same
    sequence with the write after the wait reports nothing and sums the unwritten values."""
    group, size, rank = _world()
    got = {}

    def early_write():
        full = _rows(size, rank)
        pending = comm.post_reduce_scatter(full, group, purpose="lc_send")
        full.add_(1000)  # the bug: the reduce-scatter may not have read it yet
        got["early"] = pending.wait().clone()

    message = _reported(early_write)
    total = sum(_rows(size, r) for r in range(size))
    expected = (total + 1000 * size)[2 * rank : 2 * rank + 2]
    assert torch.equal(got["early"], expected), (got["early"], expected)

    with late_completion.enabled():
        full = _rows(size, rank)
        pending = comm.post_reduce_scatter(full, group, purpose="lc_send")
        result = pending.wait().clone()
        full.add_(1000)  # after the wait: allowed
    assert torch.equal(result, total[2 * rank : 2 * rank + 2]), result
    return {"message": message}


def check_recv_garbage_until_wait() -> dict:
    """Every receive buffer (all-gather output, broadcast on a non-root, reduce on its root, ring
    receive, integer all-gather) reads as garbage between post and wait, also after a synchronous
    collective made the transfers run; the transfer is not complete before its wait; after the
    waits (in another order than the posts) every buffer holds the right values."""
    group, size, rank = _world()
    seen = {}
    nxt, prv = comm.ring_neighbours(group)
    with late_completion.enabled():
        local = _rows(size, rank)[:2].clone()
        gather = comm.post_all_gather(local, group, purpose="lc_recv")
        gathered = comm.WORKSPACE.get("lc_recv", 0, (2 * size,), local.dtype, local.device)
        seen["all_gather"] = bool(gathered.isnan().all())
        seen["all_gather_complete"] = gather.works[0].is_completed()

        bcast = torch.full((3,), float(rank), dtype=torch.float64)
        b_pending = comm.broadcast_from(bcast, 1, group)
        seen["broadcast"] = bool(bcast.isnan().all()) if rank != 1 else bool((bcast == 1).all())

        red = torch.full((3,), float(rank + 1), dtype=torch.float64)
        r_pending = comm.reduce_to(red, 0, group)
        seen["reduce"] = bool(red.isnan().all()) if rank == 0 else bool((red == rank + 1).all())

        send = torch.full((4,), float(rank), dtype=torch.float32)
        recv = torch.zeros(4, dtype=torch.float32)
        ring = comm.ring_exchange(send, recv, group)
        seen["ring"] = bool(recv.isnan().all())

        ints = torch.full((2,), rank, dtype=torch.int64)
        i_pending = comm.post_all_gather(ints, group, purpose="lc_recv_int")
        i_out = comm.WORKSPACE.get("lc_recv_int", 0, (2 * size,), torch.int64, ints.device)
        seen["int_sentinel"] = bool((i_out == torch.iinfo(torch.int64).max).all())

        # a synchronous collective runs every queued transfer first (one queue), yet their
        # results still land only at their waits
        seq = comm.all_gather_seq(torch.full((1,), float(rank)), group)
        assert torch.equal(seq, torch.arange(size, dtype=seq.dtype)), seq
        seen["all_gather_after_sync"] = bool(gathered.isnan().all())

        # waited in another order than posted: the transfers still run in post order
        ring.wait()
        i_result = i_pending.wait()
        r_pending.wait()
        b_pending.wait()
        result = gather.wait()
        seen["all_gather_complete_after_wait"] = gather.works == []  # Pending drops waited works
    expected = torch.cat([_rows(size, r)[:2] for r in range(size)])
    assert torch.equal(result, expected), (result, expected)
    assert torch.equal(bcast, torch.full((3,), 1.0, dtype=torch.float64)), bcast
    want_red = sum(range(1, size + 1)) if rank == 0 else rank + 1
    assert torch.equal(red, torch.full((3,), float(want_red), dtype=torch.float64)), red
    assert torch.equal(recv, torch.full((4,), float((rank - 1) % size))), recv
    assert torch.equal(i_result, torch.arange(size).repeat_interleave(2)), i_result
    return seen


def check_never_waited() -> dict:
    """A transfer never waited is named with its post site when the mode closes; it still runs
    then, so the ranks stay in step (a collective afterwards gives the right sum)."""
    group, size, rank = _world()

    def forget():
        buf = torch.full((2,), float(rank), dtype=torch.float64)
        with comm.labelled("lc_label"):
            comm.broadcast_from(buf, 0, group)  # never waited

    message = _reported(forget)
    total = torch.ones(1)
    dist.all_reduce(total, group=group)
    assert total.item() == size, total
    return {"message": message}


def check_buffer_reused_in_flight() -> dict:
    """Two reduce-scatters from one WORKSPACE slot, the second posted before the first is waited
    (the planted attention bug in small): reported naming both transfers."""
    group, size, rank = _world()

    def reuse():
        first = comm.post_reduce_scatter(_rows(size, rank), group, purpose="lc_reuse", slot=0)
        second = comm.post_reduce_scatter(_rows(size, rank), group, purpose="lc_reuse", slot=0)
        first.wait()
        second.wait()

    return {"message": _reported(reuse)}


def check_recv_written_before_wait() -> dict:
    """A receive buffer written (here: zeroed) between post and wait: reported."""
    group, size, rank = _world()

    def early_zero():
        send = torch.full((4,), float(rank))
        recv = torch.empty(4)
        pending = comm.ring_exchange(send, recv, group)
        recv.zero_()  # races with the incoming message on a GPU
        pending.wait()

    return {"message": _reported(early_zero)}


def last_posted() -> int:
    """Transfers the wrapper emulated in this rank's last late-completion context."""
    return late_completion.last_posted
