"""The first backward K/V re-gather of a TSP attention is posted by the MLP backward of its layer
(``megatron_tsp.core.layers.kv_prefetch``): where it is posted and waited in the issue order of
one attention + MLP forward and backward, that nothing else changes (same transfers, same
numbers bit for bit), and the slot's rules. ~30 s."""

import pytest
import torch

from megatron_tsp.core.layers import kv_prefetch
from tests import checks_kv_prefetch
from tests.checks_kv_prefetch import GATHER


def _index(order, pred, start=0):
    return next(i for i in range(start, len(order)) if pred(order[i]))


@pytest.mark.parametrize("d", [2, 4])
def test_first_regather_posted_behind_the_mlp_dgrad(pool4, d):
    res = pool4.run(checks_kv_prefetch.trace_layer, d, "saved")[0]
    order = res["order"]
    grads = [e for e in order if e[0] == "post" and e[1] != GATHER]
    drain = grads[-1]  # the MLP ring's last gradient hop
    i_drain = order.index(drain)
    i_gather = _index(order, lambda e: e[0] == "post" and e[1] == GATHER)
    i_drain_wait = order.index(("wait", drain[1], drain[2]))
    # posted inside the MLP backward: after the drain's post and at least one kernel (the one
    # dgrad GEMM), before the drain's wait (the attention backward has not started)
    assert i_drain < i_gather < i_drain_wait, order
    assert any(e[0] == "kernel" for e in order[i_drain:i_gather]), order
    first = order[i_gather]
    i_wait = order.index(("wait", GATHER, first[2]))
    # waited in the attention backward with the rest of the MLP backward and the attention's
    # group-0 GEMMs in between
    assert sum(e[0] == "kernel" for e in order[i_gather:i_wait]) >= 2, order
    # one re-gather per step (d steps: 4 query groups, d <= 4): the attention posted no second
    # group-0 gather
    assert sum(e[0] == "post" and e[1] == GATHER for e in order) == d, order
    # nothing waited without a kernel between post and wait; no kernel queued behind a dK/dV
    # reduce-scatter that is not needed yet (test_overlap.test_attention_queue_order's check)
    assert res["stalls"] == [] and res["blocking"] == [], res


def test_recompute_mode_posts_its_own_gather(pool4):
    """Attention recompute (no saved K/V): no hand-off; the attention backward posts every
    re-gather after the MLP backward has finished."""
    res = pool4.run(checks_kv_prefetch.trace_layer, 4, "recompute")[0]
    order = res["order"]
    drain = [e for e in order if e[0] == "post" and e[1] != GATHER][-1]
    i_drain_wait = order.index(("wait", drain[1], drain[2]))
    i_gather = _index(order, lambda e: e[0] == "post" and e[1] == GATHER)
    assert i_gather > i_drain_wait, order


@pytest.mark.parametrize("d,backward", [(2, "saved"), (4, "saved"), (4, "recompute")])
def test_handoff_changes_no_number(pool4, d, backward):
    res = pool4.run(checks_kv_prefetch.handoff_numerics, d, backward)
    for r in res:
        assert r["taken"] == [backward == "saved"] * 2, r
        assert r["max_diff"] == 0.0 and r["tensors"] >= 6, r


class _Pending:
    def __init__(self):
        self.waited = False


def test_slot_rules():
    """Taken only by the next MLP forward in the same autograd phase, on the same group, under
    grad mode; every MLP forward empties the slot; posted once; read once."""
    group, other = object(), object()
    posts = []

    def make():
        return kv_prefetch.Handoff(lambda: posts.append(1) or _Pending(), group)

    kv_prefetch.arm(make())
    assert kv_prefetch.take(other) is None  # another group: dropped
    assert kv_prefetch.take(group) is None  # the slot was emptied
    kv_prefetch.arm(make())
    with torch.no_grad():
        assert kv_prefetch.take(group) is None  # nothing will be differentiated
    h = make()
    kv_prefetch.arm(h)
    kv_prefetch.arm(None)  # a later attention forward replaces it
    assert kv_prefetch.take(group) is None
    kv_prefetch.arm(h)
    assert kv_prefetch.take(group) is h
    h.post()
    h.post()
    assert len(posts) == 1
    p = h.take()
    assert isinstance(p, _Pending) and h.take() is None
    h.post()  # after the attention read it: nothing more is posted
    assert len(posts) == 1
    unposted = make()
    assert unposted.take() is None  # never posted: the attention posts its own
    unposted.post()
    assert posts == [1]
