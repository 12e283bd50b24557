"""MoE layers under TSP: what each schedule moves, where the expert ring wins, what it holds.

Two schedules run an MoE layer under TSP (docs/moe.md): experts folded onto the TSP axis (whole
experts on the expert-model-parallel ranks, megatron-core's token dispatcher moves tokens) and
the TSP expert ring (every expert sharded 1/D, the shards circulate, tokens stay). Per MoE layer
and rank, with E experts of ``w_expert`` weights each (``ModelShape.w_expert``), hidden h, top-k
k, T = S*b/D local tokens, D the TSP group, EP the expert-model-parallel size:

* ring (``ring_collectives``): D-1 forward hops of the packed all-experts shard (E*w_expert/D
  elements in the weight dtype), D-1 backward weight hops and D-1 gradient-accumulator hops
  (accumulation dtype), the router's all-reduce of E token counts. Independent of S and routing.
* folded, ``allgather`` dispatcher (``allgather_collectives``): all-gathers of the hidden states,
  probabilities and routing map over EP and a reduce-scatter of the output, and the transpose in
  backward; independent of routing.
* folded, ``alltoall`` dispatcher (``alltoall_received``): the token copies a rank sends to
  experts on other ranks and gets back, forward and backward; depends on the routing
  (``alltoall_expected_received``: its expectation under uniform routing, a copy staying local
  with probability 1/EP).

All three are the counted collectives (tests/test_moe.py counts them op by op; the alltoall
dispatcher's against its formula evaluated on the routing the run made).
The shared expert (Megatron's TP + SP ``SharedExpertMLP``) moves the same under both schedules
and is left out of the comparison.

``ring_crossover_seq`` is the sequence length from which the ring receives fewer bytes than the
alltoall dispatcher with EP = D; ``ring_buffers`` the ring's weight and accumulator buffers.

The planner's MoE layer (``memory_model.py`` and ``timing.py`` call these): ``layer_params``,
``backward_working_set`` (what megatron-core's MoE layer and the expert ring hold, within 5% of
the fake-tensor tool, which runs the real layers under uniform routing: ``uniform_routing.py``),
``comm_terms`` (the formulas above as the planner's terms) and ``choose_schedule``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_tsp.console.args import ToolParser, one_line, positive_int, positive_int_list
from megatron_tsp.core.layers import weight_ring
from megatron_tsp.core.model_shape import ModelShape, load_model
from megatron_tsp.tools.estimator.formulas import (
    CommTerm,
    LayerShape,
    _term,
    accumulation_bytes,
    ring_factor,
    tp_sp_layer_terms,
    weight_ring_terms,
)

Collectives = Dict[str, Dict[str, Tuple[int, int]]]  # phase -> op -> (calls, payload bytes)
INT64 = 8


def ring_collectives(
    d: int, num_experts: int, w_expert: int, weight_bytes: int, grad_bytes: int
) -> Collectives:
    """One MoE layer of the TSP expert ring, per rank: calls and payload bytes per op."""
    shard = num_experts * w_expert // d
    w, g, hops = shard * weight_bytes, shard * grad_bytes, d - 1
    out = {
        "fwd": {
            "isend": (hops, hops * w),
            "irecv": (hops, hops * w),
            "all_reduce": (1, INT64 * num_experts),
        },
        "bwd": {"isend": (2 * hops, hops * (w + g)), "irecv": (2 * hops, hops * (w + g))},
    }
    return {phase: {op: v for op, v in ops.items() if v[0]} for phase, ops in out.items()}


def allgather_collectives(
    tokens: int, hidden: int, num_experts: int, ep: int, act_bytes: int
) -> Collectives:
    """One MoE layer with megatron-core's allgather dispatcher over ``ep`` ranks, per rank:
    forward all-gathers of the hidden states [EP*T, h], the probabilities [EP*T, E] and the bool
    routing map, a reduce-scatter of the output [EP*T, h] and the all-reduce of the E token
    counts; backward the transpose (the probabilities' gradient reduce-scattered too)."""
    t, h, e = tokens, hidden, num_experts
    return {
        "fwd": {
            "all_gather_into_tensor": (3, ep * t * (h * act_bytes + e * act_bytes + e)),
            "reduce_scatter_tensor": (1, ep * t * h * act_bytes),
            "all_reduce": (1, e * INT64),
        },
        "bwd": {
            "all_gather_into_tensor": (1, ep * t * h * act_bytes),
            "reduce_scatter_tensor": (2, ep * t * (h + e) * act_bytes),
        },
    }


def received(collectives: Collectives, group: int) -> float:
    """Bytes one rank receives for ``collectives``, by ``CommCounter``'s rule per op."""
    # the counter patches torch.distributed (torch, megatron-core): the planner need not load it
    from megatron_tsp.tools.comm_counter import received_fraction

    return sum(
        received_fraction(op, group) * payload
        for ops in collectives.values()
        for op, (_, payload) in ops.items()
    )


def ring_received(m: ModelShape, d: int) -> float:
    """Bytes a rank receives for one MoE layer of the expert ring (weights and accumulators)."""
    w = m.dtype_bytes
    return received(ring_collectives(d, m.num_experts, m.w_expert, w, accumulation_bytes(w)), d)


def allgather_received(m: ModelShape, d: int, ep: int, tokens: int) -> float:
    """Bytes a rank receives for one folded MoE layer with the allgather dispatcher."""
    return received(allgather_collectives(tokens, m.hidden, m.num_experts, ep, m.dtype_bytes), ep)


def alltoall_received(
    copies_in: float,
    copies_out: float,
    hidden: int,
    num_experts: int,
    ep: int,
    dtype_bytes: int,
    prob_bytes: int = 4,
) -> Dict[str, Dict[str, float]]:
    """Bytes a rank receives for one folded MoE layer with the alltoall dispatcher, per phase and
    collective, given its routing: ``copies_in`` token copies that other EP ranks route to its
    experts, ``copies_out`` copies of its own tokens routed to experts on other ranks. Forward:
    the dispatch brings the incoming copies' hidden states and probabilities, the combine the
    outgoing copies' expert outputs, after an all-gather of every rank's E per-expert token
    counts (int64); backward the transposes (the outputs' gradients to the experts, then the
    inputs' and the probabilities' gradients back). Tests count it from the issued collectives."""
    hw = hidden * dtype_bytes
    return {
        "fwd": {
            "all_to_all_single": copies_in * (hw + prob_bytes) + copies_out * hw,
            "all_gather_into_tensor": (ep - 1) * num_experts * INT64,
        },
        "bwd": {"all_to_all_single": copies_in * hw + copies_out * (hw + prob_bytes)},
    }


def alltoall_expected_received(
    m: ModelShape, ep: int, tokens: int, prob_bytes: Optional[int] = None
) -> float:
    """``alltoall_received`` summed over ops and phases under uniform routing: of a rank's T*k
    token copies (EP-1)/EP go to other ranks, and by symmetry as many arrive. ``prob_bytes``:
    None is the activations' dtype, in which megatron-core's router returns the probabilities
    (without ``--moe-router-dtype``)."""
    prob_bytes = m.dtype_bytes if prob_bytes is None else prob_bytes
    copies = tokens * m.moe_topk * (ep - 1) / ep
    phases = alltoall_received(
        copies, copies, m.hidden, m.num_experts, ep, m.dtype_bytes, prob_bytes
    )
    return sum(v for ops in phases.values() for v in ops.values())


def ring_crossover_seq(
    m: ModelShape, d: int, micro_batch: int = 1, prob_bytes: Optional[int] = None
) -> float:
    """The sequence length S from which the expert ring receives fewer bytes per MoE layer than
    the alltoall dispatcher with EP = D (uniform routing; T = S*b/D). Both grow with (D-1)/D, so
    S* = D * E * w_expert * (2w + g) / (b * k * (4 h w + 2 p)), whatever D is beyond the
    factor D in T (``prob_bytes`` p: as ``alltoall_expected_received``'s)."""
    w = m.dtype_bytes
    prob_bytes = w if prob_bytes is None else prob_bytes
    ring = m.w_experts * (2 * w + accumulation_bytes(w))
    per_token = m.moe_topk * (4 * m.hidden * w + 2 * prob_bytes)
    return d * ring / (micro_batch * per_token)


def ring_buffers(m: ModelShape, d: int) -> Dict[str, float]:
    """The expert ring's buffers beyond the experts' own parameters, per MoE layer while it runs
    (``weight_ring``: the packed own shard and two spares forward; backward the packed own shard,
    two weight spares and ``weight_ring.GRAD_SHARDS_HELD`` gradient-accumulator shards)."""
    w = m.dtype_bytes
    shard = m.w_experts / d
    g = accumulation_bytes(w)
    spares = min(2, d - 1)
    return {
        "forward": (1 + spares) * shard * w,
        "backward": (1 + spares) * shard * w
        + (weight_ring.GRAD_SHARDS_HELD if d > 1 else 1) * shard * g,
    }


# --------------------------------------------------------------------------------------------
# one MoE layer for the planner (``memory_model.py``, ``timing.py``): per rank, t = B*S/D local
# tokens, C = t*k token copies, EP = D for the folded schedule (whole experts, E/D per rank),
# the ring's 1/D of each

SCHEDULES = ("folded", "ring")
DISPATCHERS = ("alltoall", "allgather")


def dense_layer(shape: LayerShape) -> LayerShape:
    """The same layer with the model's dense MLP: an MoE model's dense layers
    (``moe_dense_layers``), and the attention, norms and residual stream of its MoE layers."""
    return dataclasses.replace(
        shape, num_experts=None, moe_ffn=None, moe_shared_ffn=None, moe_dense_layers=0
    )


def choose_schedule(m: ModelShape, d: int, tokens: int, policy: str, dispatcher: str) -> str:
    """``policy`` "folded" / "ring", or "auto": the ring where it receives fewer bytes per MoE
    layer than the folded schedule with EP = D and ``dispatcher`` (``tokens`` per rank)."""
    if policy in SCHEDULES:
        return policy
    if policy != "auto":
        raise ValueError(f"moe schedule must be auto, folded or ring, got {policy!r}")
    folded = (
        alltoall_expected_received(m, d, tokens)
        if dispatcher == "alltoall"
        else allgather_received(m, d, d, tokens)
    )
    return "ring" if ring_received(m, d) < folded else "folded"


def layer_params(m: ModelShape, d: int) -> float:
    """Parameters of one MoE layer on one rank: attention 1/D, norms (and the projection bias)
    whole, the router [E, h] whole, 1/D of the routed experts (E/D whole ones folded, 1/D of each
    on the ring), 1/D of the shared expert (Megatron's TP)."""
    router = m.num_experts * m.hidden
    return (m.w_attn + m.w_experts + m.w_shared_expert) / d + m.norm_params + m.b_proj + router


def saved_bytes(shape: LayerShape, d: int, schedule: str) -> Dict[str, float]:
    """What the MLP part of one MoE layer keeps for its backward on one rank (megatron-core's
    router, dispatcher and experts; inventoried with saved-tensor hooks on the real layers):
    the router's fp32 scores [t, E], top-k indices and probabilities, the permutation's two int64
    indices and permuted probabilities [C], two [C, h] token buffers (the permuted input and the
    dispatched / expert-output copy; folded non-gated: one, and the [t, h] un-permuted input),
    and the experts' intermediates: folded SwiGLU the fc1 output [C, 2F] and four [C, F]
    (gate, up, activation, probability-scaled activation), folded GeLU three [C, F]; the ring
    only the per-shard fc1 outputs [C, rows] (the activation is recomputed from them). The shared
    expert is Megatron's TP + SP MLP over all B*S tokens (1/D of its width)."""
    b, h, k = shape.dtype_bytes, shape.hidden, shape.moe_topk
    t = shape.tokens / d
    copies = t * k
    F_ = shape.expert_ffn
    rows = (2 if shape.gated else 1) * F_
    if schedule == "ring":
        experts, tokens = copies * rows, 2 * copies
    elif shape.gated:
        experts, tokens = copies * (rows + 4 * F_), copies
    else:
        experts, tokens = copies * 3 * F_, copies
    out = {
        "moe_router": t * (4 * shape.num_experts + k * (8 + 8 + 4)) + 8 * shape.num_experts,
        "moe_permutation": copies * (2 * 8 + b),
        "moe_tokens": tokens * h * b,
        "moe_experts": experts * b,
    }
    if shape.moe_shared_ffn:
        fs = shape.moe_shared_ffn
        # as Megatron's TP+SP MLP (``planner``'s mlp_mid): fc1 output, activation output and,
        # gated, the activated half, 1/D of the width over all B*S tokens
        out["moe_shared_expert"] = (
            t * ((2 if shape.gated else 1) * fs + fs + (fs if shape.gated else 0)) * b
        )
    return out


def backward_working_set(shape: LayerShape, d: int, schedule: str) -> Dict[str, float]:
    """One MoE layer's MLP backward beyond what it saved, on one rank, at its largest (net of
    the saved tensors it has already let go; measured with the fake-tensor tracker around one
    MoE layer's backward): the layer output's gradient and the input-gradient result [t, h],
    one [C, h] gradient of the token copies, and one expert's (folded: ``SequentialMLP`` runs
    them one at a time, C*D/E copies each) or one ring step's (C copies, 1/D of the width)
    [*, F] activation gradient; the ring adds its weight and accumulator buffers
    (``ring_buffers``)."""
    b, h = shape.dtype_bytes, shape.hidden
    t = shape.tokens / d
    copies = t * shape.moe_topk
    F_ = shape.expert_ffn
    out = {"grad_out": 2 * t * h * b, "moe_token_grads": 2 * copies * h * b}
    if schedule == "ring":
        out["moe_expert_grads"] = copies * F_ / d * b
        out["moe_ring_buffers"] = ring_buffers(shape, d)["backward"]
    else:
        local_experts = max(shape.num_experts // d, 1)
        out["moe_expert_grads"] = copies / local_experts * F_ * b
    return out


def comm_terms(
    shape: LayerShape, d: int, schedule: str, dispatcher: str, group: str = "tsp"
) -> List[CommTerm]:
    """The MLP part of one MoE layer's communication on one rank, as the planner's terms
    (phases mlp_fwd / mlp_bwd; the attention's are the dense layer's): the ring's weight hops
    (prefetched behind the experts' GEMMs, as the dense MLP ring) and accumulator hops (the last
    one behind the last shard's dX GEMMs), or the folded dispatcher's token exchange over
    EP = D (critical: the experts wait for it), uniform routing; the router's all-reduce of E
    counts; the shared expert's TP + SP all-gathers and reduce-scatters
    (``formulas.tp_sp_layer_terms``' MLP terms)."""
    f = ring_factor(d)
    b, h, e = shape.dtype_bytes, shape.hidden, shape.num_experts
    t = shape.tokens / d
    terms = [
        _term(
            "mlp_fwd",
            "all_reduce",
            "activation",
            2 * f * e,
            INT64,
            group,
            "critical",
            what="router: all-reduce of the E token counts (aux loss)",
        )
    ]
    if schedule == "ring":
        terms += weight_ring_terms(shape, d, shape.w_experts, label="expert ring", group=group)
    elif dispatcher == "alltoall":
        copies = t * shape.moe_topk * f  # uniform routing: (EP-1)/EP of the copies leave
        for phase in ("mlp_fwd", "mlp_bwd"):
            terms += [
                _term(
                    phase,
                    "all_to_all",
                    "activation",
                    2 * copies * h,
                    b,
                    group,
                    "critical",
                    what="alltoall dispatcher: token copies out and back",
                ),
                _term(
                    phase,
                    "all_to_all",
                    "activation",
                    copies,
                    b,
                    group,
                    "critical",
                    what="alltoall dispatcher: the copies' probabilities",
                ),
            ]
        terms.append(
            _term(
                "mlp_fwd",
                "all_gather",
                "activation",
                f * d * e,
                INT64,
                group,
                "critical",
                what="alltoall dispatcher: every rank's expert counts",
            )
        )
    else:
        x = d * t  # the EP group's tokens
        terms += [
            _term(
                "mlp_fwd",
                "all_gather",
                "activation",
                f * x * (h + e),
                b,
                group,
                "critical",
                what="allgather dispatcher: tokens and probabilities",
            ),
            _term(
                "mlp_fwd",
                "all_gather",
                "activation",
                f * x * e,
                1,
                group,
                "critical",
                what="allgather dispatcher: routing map",
            ),
            _term(
                "mlp_fwd",
                "reduce_scatter",
                "activation",
                f * x * h,
                b,
                group,
                "critical",
                what="allgather dispatcher: expert outputs back",
            ),
            _term(
                "mlp_bwd",
                "all_gather",
                "activation",
                f * x * h,
                b,
                group,
                "critical",
                what="allgather dispatcher: output gradients",
            ),
            _term(
                "mlp_bwd",
                "reduce_scatter",
                "activation",
                f * x * (h + e),
                b,
                group,
                "critical",
                what="allgather dispatcher: input and probability gradients",
            ),
        ]
    if shape.moe_shared_ffn:
        terms += [
            dataclasses.replace(term, what="shared expert: " + term.what)
            for term in tp_sp_layer_terms(shape, d)
            if term.phase.startswith("mlp")
        ]
    return terms


# --------------------------------------------------------------------------------------------
# report


def report_rows(m: ModelShape, d: int, seqs: Sequence[int], micro_batch: int = 1) -> List[dict]:
    """Per sequence length: per MoE layer and rank, received bytes of the ring, the alltoall
    dispatcher (expected, uniform routing) and the allgather dispatcher, EP = D."""
    if not m.is_moe:
        raise ValueError(f"model {m.name or '?'} is dense (no num_experts)")
    rows = []
    for s in seqs:
        if s % d:
            raise ValueError(f"--seq-lengths: S={s} is not divisible by D={d}")
        tokens = s * micro_batch // d
        rows.append(
            {
                "seq": s,
                "tokens_per_rank": tokens,
                "ring": ring_received(m, d),
                "alltoall": alltoall_expected_received(m, d, tokens),
                "allgather": allgather_received(m, d, d, tokens),
            }
        )
    return rows


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def render(m: ModelShape, d: int, seqs: Sequence[int], micro_batch: int = 1) -> str:
    rows = report_rows(m, d, seqs, micro_batch)
    layers = m.moe_layers
    buffers = ring_buffers(m, d)
    lines = [
        f"{m.name}: {m.num_experts} experts (FFN {m.expert_ffn}, top-{m.moe_topk}), "
        f"{layers} MoE layers of {m.num_layers}; TSP D = {d}, EP = D for the folded schedule, "
        f"micro-batch {micro_batch}, {8 * m.dtype_bytes}-bit weights / activations",
        "",
        "GB received per rank, per MoE layer (per step: x "
        f"{layers}); alltoall: expectation under uniform routing",
        "",
        "| S | tokens / rank | expert ring | folded, alltoall | folded, allgather "
        "| ring / alltoall |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seq']} | {r['tokens_per_rank']} | {_gb(r['ring'])} | {_gb(r['alltoall'])} "
            f"| {_gb(r['allgather'])} | {r['ring'] / r['alltoall']:.2f} |"
        )
    cross = ring_crossover_seq(m, d, micro_batch)
    lines += [
        "",
        f"Crossover: the ring receives fewer bytes than the alltoall dispatcher from S = "
        f"{cross:,.0f} tokens (micro-batch {micro_batch}, D = {d}).",
        f"Expert weights per rank (both schedules, EP = D or 1/D shards): "
        f"{_gb(m.w_experts / d * m.dtype_bytes)} GB per MoE layer; the ring's buffers while a "
        f"layer runs: {_gb(buffers['forward'])} GB forward, {_gb(buffers['backward'])} GB "
        "backward (one layer at a time).",
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = ToolParser(
        prog="megatron-tsp moe",
        description="MoE under TSP: bytes of the expert ring vs the folded schedule's token "
        "dispatch, the crossover, the ring's buffers (analytic; see the module docstring)",
    )
    p.add_argument("--model", default="mixtral-8x7b", help="an MoE model name or JSON path")
    p.add_argument("--tsp", type=positive_int, default=8, help="D, the TSP group size")
    p.add_argument("--seq-lengths", type=positive_int_list, default="32768,131072")
    p.add_argument("--micro-batch", type=positive_int, default=1)
    args = p.parse_args(argv)
    try:
        m = load_model(args.model)
        seqs = args.seq_lengths
        if args.tsp < 2:
            raise ValueError(f"--tsp {args.tsp}: D must be >= 2")
        print(render(m, args.tsp, seqs, args.micro_batch))
    except ValueError as exc:
        print(one_line("megatron-tsp moe", exc), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
