"""The first backward K/V re-gather of a TSP attention, posted by the MLP backward of its layer.

The attention backward re-gathers each head group's K/V from what the forward saved (the packed
local K/V send buffer), which does not depend on the gradient. Group r+1's re-gather is posted
before group r's attention backward and hides behind it, but group 0's has only the two GEMMs of
group 0 in front of it (its output-projection wgrad and d_ctx). Over a sequence group that spans
nodes (TSP x CP: 64 ranks at Llama-2-70B / 128k on 8 x 8 H100s) that gather takes longer than
those two GEMMs, so part of it is exposed in every layer.

In a ``TransformerLayer`` the MLP's backward runs right before the attention's, with nothing in
between that touches the K/V workspace. So the attention forward leaves a ``Handoff`` (how to
post its group-0 re-gather) in a one-entry slot; the TSP MLP forward that follows takes it into
its autograd context; the MLP backward posts the gather right after its one dgrad GEMM is queued
(the longest kernel of its backward; queue order: behind the ring's drain, which that GEMM
covers, so nothing waits for the gather); the attention backward takes the posted gather instead
of posting one. The transfer, its bytes, buffer and group are exactly those the attention
backward would post: only the post moves earlier.

Every decision depends only on the order in which the layers run, which is the same on every rank
of the group, so all ranks post the same collectives in the same order:

* ``arm``: every TSP attention forward replaces the slot's content (a handoff, or nothing);
* ``take``: every TSP MLP forward empties the slot; it keeps the handoff only if it was armed in
  the same autograd phase (the plain forward, or the same backward's recompute: a layer
  recomputed by Megatron's checkpointing re-arms it) and on the same TSP group, and will be
  differentiated (grad mode on);
* a handoff is posted at most once, and the attention backward posts its own gather when the
  handoff was never posted (no TSP MLP after the attention, an MLP recomputed in a later phase).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron_tsp.core.comm import Pending


def _phase() -> int:
    """The autograd graph task running now (-1 outside a backward): a recomputed forward runs
    inside the backward's task, the plain forward outside any."""
    return torch._C._current_graph_task_id()


class Handoff:
    """How to post one attention's group-0 K/V re-gather, and the posted transfer."""

    def __init__(self, post: Callable[[], Pending], group):
        self._post: Optional[Callable[[], Pending]] = post
        self.group, self.phase = group, _phase()
        self.pending: Optional[Pending] = None

    def post(self) -> None:
        """Post the re-gather (the MLP backward calls this once, after its dgrad GEMM)."""
        if self._post is not None:
            self.pending, self._post = self._post(), None

    def take(self) -> Optional[Pending]:
        """The posted re-gather, or None if it was not posted (the attention backward then posts
        its own); a handoff is read once."""
        pending, self.pending, self._post = self.pending, None, None
        return pending


_slot: Optional[Handoff] = None


def arm(handoff: Optional[Handoff]) -> None:
    """A TSP attention forward: leave ``handoff`` (or nothing) for the MLP that follows."""
    global _slot
    _slot = handoff


def take(group) -> Optional[Handoff]:
    """A TSP MLP forward on ``group``: empty the slot; the handoff if it is this layer's
    (module docstring), else None."""
    global _slot
    handoff, _slot = _slot, None
    if handoff is None or not torch.is_grad_enabled():
        return None
    if handoff.group is not group or handoff.phase != _phase():
        return None
    return handoff
