"""MoE layers on shape-only tensors: megatron-core's token dispatch under uniform routing.

A fake-tensor run (``fake_run``) has shapes but no values, and an MoE layer's dispatch sizes its
tensors from values: the number of token copies each expert receives (``tolist`` of counts, the
all-to-all split sizes) and the rows a routing map selects (``masked_select``). This module runs
everything else of the MoE layer unchanged (router, aux losses, all-gathers / all-to-alls,
experts, the expert ring, unpermute, shared expert) and answers only those values with their
expectation under uniform routing:

* a rank's T local tokens make T*k token copies (top-k, no token dropping: TSP refuses capacity
  factors), so the permuted buffer has exactly T*k rows whatever the routing: the total is exact;
* each of the E experts receives T*k/E of them (the first ``T*k mod E`` one more), and of what a
  rank sends, the share for each EP rank is its experts' share: 1/EP each. Per-expert counts, and
  with EP > 1 the tokens that cross ranks, are the expectation (``estimator.moe`` gives the same
  expectation for the bytes; tests count the real routing's).

What is replaced (for the ``with`` block, on the classes; megatron-core 0.16 and 0.19 alike):

* ``MoEAllGatherTokenDispatcher.dispatch_postprocess`` (also the TSP expert ring's local
  dispatcher): the local experts' slice of the gathered routing map, its counts, and the permute
  by it, as one ``index_select`` of the same number of rows and the probabilities likewise;
* ``MoEAlltoAllTokenDispatcher.preprocess``: the split sizes and per-expert counts as host
  tensors (what the GPU's device-to-host copy gives), and its first ``permute`` by a synthetic
  index of the known T*k rows; the chunk sort by local expert then runs on the host counts.

The allocations are those of megatron-core's own unfused permute (an int64 index of the permuted
rows, the permuted tokens, the permuted probabilities); only which rows are copied differs.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import List

import torch

from megatron_tsp.megatron_lm import patches

DISPATCHERS = ("allgather", "alltoall")

_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"


def expert_counts(copies: int, num_experts: int) -> List[int]:
    """``copies`` token copies spread over ``num_experts`` experts as evenly as integers allow
    (the first ``copies mod E`` experts one more): the uniform-routing count of each expert."""
    base, extra = divmod(copies, num_experts)
    return [base + (1 if e < extra else 0) for e in range(num_experts)]


def _host(values) -> torch.Tensor:
    """A real int64 CPU tensor inside the fake mode (counts are host values on a GPU too)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return torch.tensor(values, dtype=torch.long)


def _permute_rows(tokens: torch.Tensor, probs_by_expert, rows: int):
    """megatron-core's unfused ``permute`` for ``rows`` selected copies, shape for shape: the
    int64 index of the permuted rows, ``tokens.index_select`` of them and, with
    ``probs_by_expert`` ([experts, tokens]), the selected probabilities (a fresh [rows] tensor)."""
    index = torch.arange(rows, device=tokens.device) % max(tokens.shape[0], 1)
    permuted = tokens.index_select(0, index)
    probs = None
    if probs_by_expert is not None:
        flat = torch.arange(rows, device=tokens.device)
        probs = probs_by_expert.reshape(-1).index_select(0, flat)
    return permuted, probs, index


def _allgather_dispatch_postprocess(self, hidden_states, probs):
    """The allgather dispatcher's local permute: the rows of the gathered tokens routed to this
    rank's experts, T_gathered * k * local / E of them under uniform routing."""
    self.hidden_shape_before_permute = hidden_states.shape
    lo, hi = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
    self.local_map = self.routing_map[:, lo:hi].contiguous()
    local_probs = probs[:, lo:hi].contiguous()
    copies = hidden_states.shape[0] * self.config.moe_router_topk
    counts = expert_counts(copies, self.config.num_moe_experts)[lo:hi]
    permuted, self.local_probs, self.reversed_local_input_permutation_mapping = _permute_rows(
        hidden_states, local_probs.T.contiguous(), sum(counts)
    )
    self.routing_map = None
    return permuted, _host(counts), self.local_probs


def _alltoall_preprocess(self, routing_map):
    """The alltoall dispatcher's metadata under uniform routing: this rank's T*k copies, 1/EP of
    them to each EP rank, as many from each; each local expert T*k/E copies from every rank.
    Split sizes and chunk orders are numpy arrays, as the GPU's device-to-host copy leaves them
    (an op on a real tensor inside the fake mode would give a value-less fake one); the counts
    the experts read are a host tensor."""
    import numpy as np
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    if self.drop_and_pad:
        raise ValueError("the fake-tensor run has no uniform-routing answer for token dropping")
    tokens, ep, tp, local = routing_map.shape[0], self.ep_size, self.tp_size, self.num_local_experts
    copies = tokens * self.config.moe_router_topk
    per_expert = expert_counts(copies, self.config.num_moe_experts)
    mine = per_expert[self.local_expert_indices[0] : self.local_expert_indices[-1] + 1]
    self.num_out_tokens = copies
    if ep > 1 or tp > 1:
        # megatron-core's all-gather of every rank's per-expert counts (issued for its bytes;
        # the values it would bring are the uniform ones below)
        gather_from_sequence_parallel_region(routing_map.sum(dim=0).long(), group=self.tp_ep_group)
        sent = [sum(per_expert[r * local : (r + 1) * local]) for r in range(ep)]
        self.input_splits = np.array(sent)
        self.output_splits = np.array([sum(mine)] * ep)
        self.output_splits_tp = np.array([sum(mine) * ep] * tp)
    self.num_global_tokens_per_local_expert = np.array([mine] * (tp * ep))
    chunks = np.arange(local * tp * ep)
    self.sort_input_by_local_experts = chunks.reshape(-1, local).T.ravel()
    self.restore_output_by_local_experts = chunks.reshape(local, -1).T.ravel()
    return _host([tp * ep * c for c in mine])


def _shape_only_permute(original):
    """The alltoall dispatcher's first permute for ``num_out_tokens`` (T*k) rows; megatron-core
    0.19's ``permute`` (which can pad per expert) returns two more values, unused here."""
    padded_returns = "align_size" in inspect.signature(original).parameters

    def permute(tokens, routing_map, probs=None, num_out_tokens=None, *args, **kwargs):
        by_expert = probs.T.contiguous() if probs is not None else None
        out = _permute_rows(tokens, by_expert, int(num_out_tokens))
        return (*out, None, None) if padded_returns else out

    return permute


def _fake_run(target, reason, params) -> patches.Patch:
    return patches.row(patches.FAKE_RUN, f"{_DISPATCHER}:{target}", reason, params)


# each dispatcher patch and its uniform-routing answer
_ANSWERS = {
    _fake_run(
        "MoEAllGatherTokenDispatcher.dispatch_postprocess",
        "counts the local experts' token copies and permutes by the routing map's values; "
        "shape-only tensors take the uniform-routing counts (tools/estimator/uniform_routing.py)",
        ("self", "hidden_states", "probs"),
    ): _allgather_dispatch_postprocess,
    _fake_run(
        "MoEAlltoAllTokenDispatcher.preprocess",
        "all-to-all split sizes from the routing map's values; shape-only tensors take the "
        "uniform-routing splits as host tensors",
        ("self", "routing_map"),
    ): _alltoall_preprocess,
}
_PERMUTE = _fake_run(
    "permute",
    "masked_select by the routing map has a value-dependent size; shape-only tensors select "
    "the known T*k rows",
    ("tokens", "routing_map", "probs", "num_out_tokens"),
)
patches.declare([*_ANSWERS, _PERMUTE])


@contextlib.contextmanager
def uniform_routing():
    """For the ``with`` block: megatron-core's token dispatchers answer their value-dependent
    sizes with the uniform-routing expectation (module docstring), and the alltoall dispatcher
    has the CPU runner's answers for its side stream and host copies (shape-only tensors live on
    the CPU). Enter it before the model is built (the dispatcher makes its side stream then)."""
    from megatron_tsp.megatron_lm import cpu_runner

    with contextlib.ExitStack() as stack:
        stack.enter_context(cpu_runner.alltoall_dispatcher_on_cpu())
        for patch, replacement in _ANSWERS.items():
            stack.enter_context(patches.applied(patch.mode, patch.target, replacement))
        stack.enter_context(
            patches.applied(_PERMUTE.mode, _PERMUTE.target, make=_shape_only_permute)
        )
        yield
