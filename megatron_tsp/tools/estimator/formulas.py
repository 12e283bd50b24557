"""Closed-form communication and FLOP counts for one transformer layer.

Everything here is per rank and per micro-batch. Communication is counted as the bytes a rank
RECEIVES, with the conventions of :mod:`megatron_tsp.tools.comm_counter` (n = payload bytes of
the call, D = group size, f = (D-1)/D):

    all_gather  f * n_out       reduce_scatter  f * n_in       all_reduce  2 f * n
    broadcast / reduce  f * n (averaged over the ranks)         recv  n      send  0

so every formula below can be compared one-to-one with a ``CommCounter`` run.

Notation (``LayerShape``): B micro-batch, S full sequence length, h hidden, a heads,
g query groups (= a for MHA), hn = h / a, h_kv = g * hn, F ffn hidden.

Schedules (per layer, per rank, in elements):

TSP, group D (weights move, tokens stay): ``TSP_SCHEDULE``, one ``ScheduleRow`` per
    communication (phase, collective, what moves, received elements, wire dtype, overlap), the
    one statement of the layer schedule (docs/design.md's table is generated from it).
    W_attn = W_qkv (+ qkv bias) + W_proj;  W_mlp = W_fc1 (+ fc1 bias) + W_fc2.
    [grad] terms travel in the accumulation dtype (``accumulation_bytes``): fp32 when the model
    runs in bf16/fp16, so the D ranks' partial weight gradients are summed in fp32 like Megatron's
    single wgrad GEMM (layers/precision.py); f * W bytes at 4 instead of 2 per element.
    dK/dV: each rank sums its dK/dV over its two chunks in fp32 and rounds once into the
    send buffer, which travels in the compute dtype like TP+SP's activation-gradient
    reduce-scatters (f * 2BSh_kv at 2 bytes per element in bf16); with
    ``kv_grad_reduce_in_fp32`` (``--tsp-kv-grad-reduce-in-fp32``) it travels and is summed over
    the D ranks in the accumulation dtype and is cast once by the token owner (4 bytes).
    Head groups: min(D, g). With fewer K/V heads than ranks (g < D, megatron-core's TP layout:
    each group's block of the fused QKV weight spans D/g shards, K/V rows not replicated) the
    weights still move shard by shard (D broadcasts, D reduces) but each K/V head is gathered
    once for the D/g shards sharing it: the K/V terms keep f * 2BSh_kv in g calls.
    The proj / fc2 biases and the norms are replicated: their grads are all-reduced once per step
    by Megatron's finalize_model_grads (``replicated_grad_allreduce``), not per layer.

Megatron TP + sequence parallel, group D (megatron-core 0.16.1, tensor_parallel/layers.py)
    fwd: all-gather before QKV and fc1 (ColumnParallelLinear), reduce-scatter after proj and fc2
         (RowParallelLinear)                                                f * 4BSh
    bwd: ColumnParallelLinear re-all-gathers its saved local input (LinearWithGradAccumulation-
         AndAsyncCommunication.backward, async, before the dgrad GEMM) and reduce-scatters dgrad
         (async, overlapped with the wgrad GEMM); RowParallelLinear's reduce-scatter has an
         all-gather of the output grad as adjoint                            f * 6BSh

Hybrid, group D: TP+SP attention + TSP MLP (``--tsp-mlp``): the attention rows of TP+SP
(fwd f * 2BSh, bwd f * 3BSh) and the MLP rows of TSP (fwd f * W_mlp, bwd 2 f * W_mlp): the MLP's
f * 5BSh of activation traffic becomes f * 3W_mlp of weight / grad traffic, independent of S and
prefetchable. Forward crossover vs TP+SP: BS >= W_mlp / 2h (4h for a GELU MLP with F = 4h).

Megatron TP without SP: fwd 2 all-reduces of BSh (2f each) = f * 4BSh; bwd the two
ColumnParallelLinear dgrad all-reduces = f * 4BSh.

CP, group C, all-gather-K/V flavour: fwd all-gather K, V f * 2BSh_kv; bwd reduce-scatter dK, dV
f * 2BSh_kv plus a re-gather f * 2BSh_kv unless the gathered K/V is kept. (Megatron's default CP
through Transformer Engine passes K/V around a ring of P2P steps instead; it moves the same bytes
per rank - C-1 steps of 2B(S/C)h_kv forward, K/V plus dK/dV backward - but one peer per step.)
The data-parallel weight-grad reduce-scatter and parameter all-gather over the CP x DP group are per
step, not per layer: see ``dp_step_comm``.

TSP x CP, TSP group D (weights, inside a node) x CP of C (across nodes): the weight rows of TSP
over the D ranks of the TSP group (broadcasts, MLP ring, weight-grad reduces: bytes independent of
C), and each head group's K/V all-gathered over the D*C ranks of the sequence group (Megatron's
tensor-and-context-parallel group), dK/dV reduce-scattered over it:
    f_DC * 2BSh_kv per K/V collective, f_DC = (DC-1)/DC, S the full sequence
``kv_flavour="ring"`` is a WHAT-IF the layers do not implement: the TSP all-gather stays inside
the node and a P2P ring over the C nodes passes each node's K/V block on (Megatron's CP P2P ring
with one TSP gather per block): per K/V term f_D * 2BSh_kv intra-node (C blocks of BS/C tokens)
and (C-1)/(DC) * 2BSh_kv across nodes (each rank forwards its own share of a block, C-1 steps):
the same total, f_D + (C-1)/(DC) = f_DC, split over two kinds of link.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from megatron_tsp.core.model_shape import ModelShape

PHASES = ("attn_fwd", "attn_bwd", "mlp_fwd", "mlp_bwd")


# ---------------------------------------------------------------------------------------------
# shape
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LayerShape(ModelShape):
    """One transformer layer of a ``ModelShape`` and the micro-batch it processes (B x S tokens);
    dimensions and parameter counts are the model's."""

    batch: int
    seq: int
    num_layers: int = 1  # the formulas are per layer

    @classmethod
    def of(cls, model: ModelShape, batch: int, seq: int) -> "LayerShape":
        fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(ModelShape)}
        return cls(**fields, batch=batch, seq=seq)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def with_seq(self, seq: int) -> "LayerShape":
        return _replace(self, seq=seq)

    def with_batch(self, batch: int) -> "LayerShape":
        return _replace(self, batch=batch)


def _replace(shape: LayerShape, **kw) -> LayerShape:
    from dataclasses import replace

    return replace(shape, **kw)


def accumulation_bytes(dtype_bytes: int) -> int:
    """Bytes per element of TSP's partial-sum accumulators: fp32 (4) for bf16/fp16 (2), the
    compute dtype's size otherwise (mirrors ``layers.precision.accumulation_dtype``)."""
    return max(dtype_bytes, 4)


def ring_factor(d: int) -> float:
    """f = (D-1)/D."""
    if d < 1:
        raise ValueError(f"group size must be >= 1, got {d}")
    return (d - 1) / d


# ---------------------------------------------------------------------------------------------
# communication terms
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommTerm:
    """One communication pattern of a layer: ``nbytes`` received per rank.

    ``category``: weight (parameter shards), grad (weight-gradient shards) or activation.
    ``overlap``: what the term can hide behind - ``prefetch`` (data independent: any compute),
    ``pipelined`` (issued per head group: hidden behind the previous group's compute except the
    first of ``chunks``), ``async`` (issued asynchronously next to a GEMM of the same phase),
    ``attn_core`` (hidden only behind attention-core compute), ``critical`` (blocks the next op).
    ``link``: ``collective`` (uses all links of a full mesh) or ``p2p`` (one peer at a time).
    """

    phase: str  # one of PHASES
    op: str  # broadcast, all_gather, reduce_scatter, reduce, all_reduce, p2p
    category: str
    elements: float
    nbytes: float
    group: str  # tsp, tp, cp
    overlap: str
    link: str = "collective"
    chunks: int = 1  # pipeline stages (head groups, ring steps): the first or last is exposed
    # collective calls per chunk: the K/V all-gathers and dK/dV reduce-scatters issue two per head
    # group, one per zigzag half (``attention._post_kv_gather``, ``_KVGradScatter``)
    calls_per_chunk: int = 1
    what: str = ""


def _term(
    phase,
    op,
    category,
    elements,
    dtype_bytes,
    group,
    overlap,
    link="collective",
    chunks=1,
    what="",
    calls_per_chunk=1,
):
    return CommTerm(
        phase,
        op,
        category,
        elements,
        elements * dtype_bytes,
        group,
        overlap,
        link,
        chunks,
        calls_per_chunk,
        what,
    )


@dataclass(frozen=True)
class ScheduleRow:
    """One communication of a TSP layer: the layer schedule as data. ``tsp_layer_terms`` builds
    the planner's terms from ``TSP_SCHEDULE``, ``schedule_markdown`` the table in
    docs/design.md, and tests/test_comm.py counts the collectives the layers issue against the
    terms. ``elements``: what one rank receives, before the factor f = (D-1)/D; ``width``: the
    element's bytes (``compute``: the model's dtype; ``grad``: the weight-gradient wire,
    ``accumulation_bytes`` by default); ``chunks``: the pipeline stages the overlap class counts
    (D shards, the head groups, the D-1 ring hops); ``when``: the option the row needs;
    ``variant``: how an option changes it (and ``variant_text`` says so in the docs)."""

    phase: str
    op: str
    category: str
    moves: str
    formula: str
    elements: Callable[[LayerShape], float]
    width: str
    overlap: str
    chunks: str
    link: str = "collective"
    calls_per_chunk: int = 1
    when: Optional[str] = None
    variant: Optional[Callable[["ScheduleRow", dict], "ScheduleRow"]] = None
    variant_text: str = ""


def _kv(shape: LayerShape) -> float:
    return 2 * shape.tokens * shape.kv_hidden


def _rebroadcast(row: ScheduleRow, o: dict) -> ScheduleRow:
    if not o["recompute_attn"]:
        return row
    return dataclasses.replace(row, overlap="pipelined", moves=row.moves + " (first one exposed)")


def _regather(row: ScheduleRow, o: dict) -> ScheduleRow:
    # group 0's re-gather is posted by the TSP MLP backward of the layer (``layers.kv_prefetch``)
    # from the K/V the forward saved; with attention recompute there is nothing saved to send
    # (the QKV GEMM of shard 0 comes first) and without a TSP MLP (an MoE layer) nobody posts it
    # early: then the first one is exposed
    if o["regather_handoff"] and not o["recompute_attn"]:
        return row
    return dataclasses.replace(row, overlap="pipelined", moves="re-gather K,V (first one exposed)")


def _kv_grads(row: ScheduleRow, o: dict) -> ScheduleRow:
    a2a, fp32 = o["kv_grad_all_to_all"], o["kv_grad_reduce_in_fp32"]
    return dataclasses.replace(
        row,
        op="all_to_all" if a2a else row.op,
        width="accumulation" if fp32 else row.width,
        moves=("all-to-all" if a2a else "reduce-scatter")
        + " dK,dV to token owners"
        + (" (fp32 wire)" if fp32 else ""),
    )


TSP_SCHEDULE: Tuple[ScheduleRow, ...] = (
    ScheduleRow(
        "attn_fwd",
        "broadcast",
        "weight",
        "owner broadcasts qkv w/b + proj w shard (first one exposed)",
        "f·W_attn",
        lambda s: s.w_attn,
        "compute",
        "pipelined",
        "D",
    ),
    ScheduleRow(
        "attn_fwd",
        "all_gather",
        "activation",
        "all-gather K,V of one head group",
        "f·2BSh_kv",
        _kv,
        "compute",
        "pipelined",
        "head groups",
        calls_per_chunk=2,
    ),
    ScheduleRow(
        "mlp_fwd",
        "p2p",
        "weight",
        "ring of fc1 w/b + fc2 w shards",
        "f·W_mlp",
        lambda s: s.w_mlp,
        "compute",
        "prefetch",
        "D-1",
        link="p2p",
    ),
    ScheduleRow(
        "attn_bwd",
        "broadcast",
        "weight",
        "re-broadcast attention weight shards",
        "f·W_attn",
        lambda s: s.w_attn,
        "compute",
        "prefetch",
        "D",
        variant=_rebroadcast,
        variant_text="attention recompute: pipelined, the first one exposed",
    ),
    ScheduleRow(
        "attn_bwd",
        "all_gather",
        "activation",
        "re-gather K,V (the first posted behind the MLP backward's dgrad GEMM)",
        "f·2BSh_kv",
        _kv,
        "compute",
        "prefetch",
        "head groups",
        calls_per_chunk=2,
        when="regather_kv_bwd",
        variant=_regather,
        variant_text="only with regather_kv_bwd; attention recompute or no TSP MLP after the "
        "attention (MoE layer): pipelined, the first one exposed",
    ),
    ScheduleRow(
        "attn_bwd",
        "reduce_scatter",
        "activation",
        "reduce-scatter dK,dV to token owners",
        "f·2BSh_kv",
        _kv,
        "compute",
        "pipelined",
        "head groups",
        calls_per_chunk=2,
        variant=_kv_grads,
        variant_text="--tsp-kv-grad-reduce-in-fp32: accumulation dtype; --tsp-kv-grad-all-to-all: "
        "an all-to-all",
    ),
    ScheduleRow(
        "attn_bwd",
        "reduce",
        "grad",
        "reduce weight-grad shard to owner (the last one behind the one dgrad GEMM)",
        "f·W_attn",
        lambda s: s.w_attn,
        "grad",
        "prefetch",
        "D",
    ),
    ScheduleRow(
        "mlp_bwd",
        "p2p",
        "weight",
        "ring of weight shards again",
        "f·W_mlp",
        lambda s: s.w_mlp,
        "compute",
        "prefetch",
        "D-1",
        link="p2p",
    ),
    ScheduleRow(
        "mlp_bwd",
        "p2p",
        "grad",
        "grad accumulator one hop behind (the last behind the one dgrad GEMM)",
        "f·W_mlp",
        lambda s: s.w_mlp,
        "grad",
        "prefetch",
        "D-1",
        link="p2p",
    ),
)


def tsp_layer_terms(
    shape: LayerShape,
    D: int,
    *,
    grad_dtype_bytes: Optional[int] = None,
    regather_kv_bwd: bool = True,
    recompute_attn: bool = False,
    kv_grad_reduce_in_fp32: bool = False,
    kv_grad_all_to_all: bool = False,
    regather_handoff: bool = True,
) -> List[CommTerm]:
    """Every communication of one TSP layer, ``TSP_SCHEDULE`` evaluated (module docstring).
    ``grad_dtype_bytes``: bytes per element of the weight-gradient traffic; None =
    ``accumulation_bytes`` (what the layers do). ``kv_grad_reduce_in_fp32``: the dK/dV
    reduce-scatter in the accumulation dtype instead of the compute dtype (the layers'
    ``kv_grad_reduce_in_fp32``). ``kv_grad_all_to_all``: the dK/dV sum as an all-to-all of the
    partials (the layers' ``kv_grad_all_to_all``): the same bytes, another collective.
    ``regather_handoff``: the layer's MLP is the TSP MLP, whose backward posts the attention's
    first K/V re-gather (``layers.kv_prefetch``; False for an MoE layer).

    Overlap, as the layers issue them: the attention weight broadcasts are prefetched one head
    group ahead, so only the first (pipeline fill) is waited on with nothing to hide behind; the
    reduce-to-owner of the weight gradients hides behind the next group's work and the last one
    behind the one dgrad GEMM; the MLP ring hides every weight hop behind a shard's GEMMs, and
    its gradient accumulator every hop, the last behind the one dgrad GEMM. The K/V all-gathers
    and dK/dV reduce-scatters are posted one head group ahead (only fill/drain exposed), except
    the backward's first re-gather, which the TSP MLP backward of the layer posts behind its one
    dgrad GEMM (``layers.kv_prefetch``: the K/V are saved, so it needs no gradient) and which is
    then hidden like a prefetch (with attention recompute, or an MoE layer, it stays the exposed
    fill). The backward's first weight re-broadcast hides behind the first head group's
    attention backward from saved q/k/v (nothing blocks: tests/test_overlap.py); with attention
    recompute (``recompute_attn``) the QKV GEMM needs shard 0 at once, so the first is
    exposed."""
    options = dict(
        regather_kv_bwd=regather_kv_bwd,
        recompute_attn=recompute_attn,
        kv_grad_reduce_in_fp32=kv_grad_reduce_in_fp32,
        kv_grad_all_to_all=kv_grad_all_to_all,
        regather_handoff=regather_handoff,
    )
    b = shape.dtype_bytes
    width = {
        "compute": b,
        "grad": grad_dtype_bytes or accumulation_bytes(b),
        "accumulation": accumulation_bytes(b),
    }
    chunks = {"D": D, "head groups": min(D, shape.groups), "D-1": max(D - 1, 1)}
    f = ring_factor(D)
    terms = []
    for row in TSP_SCHEDULE:
        if row.when and not options[row.when]:
            continue
        row = row.variant(row, options) if row.variant else row
        terms.append(
            _term(
                row.phase,
                row.op,
                row.category,
                f * row.elements(shape),
                width[row.width],
                "tsp",
                row.overlap,
                link=row.link,
                chunks=chunks[row.chunks],
                what=row.moves,
                calls_per_chunk=row.calls_per_chunk,
            )
        )
    return terms


def weight_ring_terms(
    shape: LayerShape,
    D: int,
    weights: float,
    *,
    label: str,
    group: str = "tsp",
    grad_dtype_bytes: Optional[int] = None,
) -> List[CommTerm]:
    """``TSP_SCHEDULE``'s weight-ring rows (the P2P ones: weights forward, weights again and the
    gradient accumulator backward) for another ring over ``weights`` elements per layer (the
    expert ring: every expert's shards, its drain covered by the last shard's dX GEMMs as the
    dense MLP's is by its one dgrad GEMM)."""
    b = shape.dtype_bytes
    width = {"compute": b, "grad": grad_dtype_bytes or accumulation_bytes(b)}
    terms = []
    for row in TSP_SCHEDULE:
        if row.link != "p2p":
            continue
        terms.append(
            _term(
                row.phase,
                row.op,
                row.category,
                ring_factor(D) * weights,
                width[row.width],
                group,
                row.overlap,
                link=row.link,
                chunks=max(D - 1, 1),
                what=f"{label}: {row.moves}",
            )
        )
    return terms


def schedule_markdown() -> str:
    """``TSP_SCHEDULE`` as the table docs/design.md shows (a test keeps the page current)."""
    lines = [
        "| phase | collective | what moves | received per rank | wire | overlap (stages) "
        "| option |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in TSP_SCHEDULE:
        option = r.variant_text or (f"only with {r.when}" if r.when else "")
        lines.append(
            f"| {r.phase} | {r.op} ({r.link}) | {r.moves} | {r.formula} | {r.width} | "
            f"{r.overlap} ({r.chunks}) | {option} |"
        )
    return "\n".join(lines)


SCHEDULE_BEGIN = "<!-- TSP layer schedule: generated by formulas.schedule_markdown() -->"
SCHEDULE_END = "<!-- end of the TSP layer schedule -->"


def schedule_doc_block() -> str:
    return f"{SCHEDULE_BEGIN}\n{schedule_markdown()}\n{SCHEDULE_END}"


def tp_sp_layer_terms(shape: LayerShape, D: int) -> List[CommTerm]:
    """Megatron TP + sequence parallel (ColumnParallelLinear / RowParallelLinear with SP)."""
    f = ring_factor(D)
    b = shape.dtype_bytes
    x = shape.tokens * shape.hidden
    out = []
    for blk, col, row in (("attn", "qkv", "proj"), ("mlp", "fc1", "fc2")):
        out += [
            _term(
                f"{blk}_fwd",
                "all_gather",
                "activation",
                f * x,
                b,
                "tp",
                "critical",
                what=f"all-gather before {col}",
            ),
            _term(
                f"{blk}_fwd",
                "reduce_scatter",
                "activation",
                f * x,
                b,
                "tp",
                "critical",
                what=f"reduce-scatter after {row}",
            ),
            _term(
                f"{blk}_bwd",
                "all_gather",
                "activation",
                f * x,
                b,
                "tp",
                "critical",
                what=f"all-gather of {row} output grad",
            ),
            _term(
                f"{blk}_bwd",
                "all_gather",
                "activation",
                f * x,
                b,
                "tp",
                "async",
                what=f"{col} re-gathers its saved input (async, before dgrad GEMM)",
            ),
            _term(
                f"{blk}_bwd",
                "reduce_scatter",
                "activation",
                f * x,
                b,
                "tp",
                "async",
                what=f"{col} dgrad reduce-scatter (async, behind wgrad GEMM)",
            ),
        ]
    return out


def hybrid_layer_terms(
    shape: LayerShape, D: int, *, grad_dtype_bytes: Optional[int] = None
) -> List[CommTerm]:
    """TP+SP attention + TSP MLP (``--tsp-mlp``): Megatron's attention collectives, TSP's MLP ring.

    attn fwd   all-gather before QKV, reduce-scatter after proj                  f * 2BSh
    attn bwd   AG of proj's output grad, QKV's re-gather of its input, QKV dgrad RS  f * 3BSh
    mlp fwd    ring of (fc1 w, fc1 b, fc2 w) shards                              f * W_mlp
    mlp bwd    ring again + gradient accumulator one hop behind                 2 f * W_mlp
    """
    attention = [t for t in tp_sp_layer_terms(shape, D) if t.phase.startswith("attn")]
    mlp = [
        t
        for t in tsp_layer_terms(shape, D, grad_dtype_bytes=grad_dtype_bytes)
        if t.phase.startswith("mlp")
    ]
    return attention + mlp


def tp_layer_terms(shape: LayerShape, D: int) -> List[CommTerm]:
    """Megatron TP without sequence parallelism."""
    f = ring_factor(D)
    b = shape.dtype_bytes
    x = shape.tokens * shape.hidden
    out = []
    for blk, col, row in (("attn", "qkv", "proj"), ("mlp", "fc1", "fc2")):
        out += [
            _term(
                f"{blk}_fwd",
                "all_reduce",
                "activation",
                2 * f * x,
                b,
                "tp",
                "critical",
                what=f"all-reduce after {row}",
            ),
            _term(
                f"{blk}_bwd",
                "all_reduce",
                "activation",
                2 * f * x,
                b,
                "tp",
                "async",
                what=f"{col} dgrad all-reduce (async, behind wgrad GEMM)",
            ),
        ]
    return out


def cp_layer_terms(
    shape: LayerShape, C: int, *, regather_kv_bwd: bool = True, kv_shard: int = 1
) -> List[CommTerm]:
    """Context parallelism, all-gather-K/V flavour. ``kv_shard``: TP degree sharding the heads."""
    f = ring_factor(C)
    b = shape.dtype_bytes
    kv = 2 * shape.tokens * shape.kv_hidden / kv_shard
    t = [
        _term(
            "attn_fwd",
            "all_gather",
            "activation",
            f * kv,
            b,
            "cp",
            "attn_core",
            what="all-gather K,V",
        )
    ]
    if regather_kv_bwd:
        t.append(
            _term(
                "attn_bwd",
                "all_gather",
                "activation",
                f * kv,
                b,
                "cp",
                "attn_core",
                what="re-gather K,V",
            )
        )
    t.append(
        _term(
            "attn_bwd",
            "reduce_scatter",
            "activation",
            f * kv,
            b,
            "cp",
            "attn_core",
            what="reduce-scatter dK,dV",
        )
    )
    return t


def tp_cp_layer_terms(
    shape: LayerShape,
    T: int,
    C: int,
    *,
    sequence_parallel: bool = True,
    regather_kv_bwd: bool = True,
) -> List[CommTerm]:
    """TP (x SP) of size T inside each CP rank's B*S/C tokens, plus CP over C."""
    local = (
        shape.with_seq(shape.seq // C) if shape.seq % C == 0 else _replace(shape, seq=shape.seq / C)
    )
    tp = tp_sp_layer_terms(local, T) if sequence_parallel else tp_layer_terms(local, T)
    return tp + cp_layer_terms(shape, C, regather_kv_bwd=regather_kv_bwd, kv_shard=T)


def tsp_cp_layer_terms(
    shape: LayerShape,
    D: int,
    C: int,
    *,
    kv_flavour: str = "all_gather",
    **tsp_kw,
) -> List[CommTerm]:
    """TSP of D (weight axis, group ``tsp``) x CP of C: every weight term of ``tsp_layer_terms``
    unchanged, the K/V terms over the D*C sequence group (group ``seq``), as the layers issue them
    (``kv_flavour="all_gather"``).

    ``kv_flavour="ring"`` is a what-if the layers do not implement: each K/V term becomes one
    ``ring`` term (group ``cp_ring``) of f_D * 2BSh_kv received inside the node (the TSP gather /
    reduce-scatter of each of the C node blocks) plus (C-1)/(DC) * 2BSh_kv across nodes (C-1 P2P
    hops, each rank forwarding its own share of a block), hidden behind attention compute like
    Megatron's CP ring (``attn_core``). ``ring_split`` gives the two parts."""
    if kv_flavour not in ("all_gather", "ring"):
        raise ValueError(f"kv_flavour must be 'all_gather' or 'ring', got {kv_flavour!r}")
    terms = tsp_layer_terms(shape, D, **tsp_kw)
    if C == 1:
        return terms
    kv = 2 * shape.tokens * shape.kv_hidden
    out = []
    for t in terms:
        if t.category != "activation":  # weights and weight grads stay inside the TSP group
            out.append(t)
            continue
        fp32_wire = t.op in ("reduce_scatter", "all_to_all") and tsp_kw.get(
            "kv_grad_reduce_in_fp32", False
        )
        per_elem = accumulation_bytes(shape.dtype_bytes) if fp32_wire else shape.dtype_bytes
        if kv_flavour == "all_gather":
            n = ring_factor(D * C) * kv
            out.append(dataclasses.replace(t, elements=n, nbytes=n * per_elem, group="seq"))
            continue
        n = sum(ring_split(D, C)) * kv
        out.append(
            dataclasses.replace(
                t,
                op="ring",
                elements=n,
                nbytes=n * per_elem,
                group="cp_ring",
                overlap="attn_core",
                link="p2p",
                chunks=t.chunks * C,
                what=t.what + " (what-if: CP ring across nodes, TSP gather per node block)",
            )
        )
    return out


def fsdp_cp_layer_terms(
    shape: LayerShape,
    N: int,
    *,
    kv_flavour: str = "all_gather",
    grad_reduce_bytes: Optional[int] = None,
    regather_kv_bwd: bool = True,
) -> List[CommTerm]:
    """ZeRO-3 x CP over one sequence group of N ranks (Megatron-FSDP ``optim_grads_params`` with
    ``--context-parallel-size N``, or FSDP2 + CP), DP = 1 inside it. Every rank holds 1/N of
    every parameter (norms included) and works on B*S/N tokens with whole weights.

    weights  the whole layer (``layer_params``) all-gathered before its forward and again before
             its backward, in the model dtype: f_N * W_layer each (group ``fsdp``), prefetched one
             layer ahead (Megatron-FSDP's and FSDP2's default), so hidden behind the previous
             layer's compute (``prefetch``; the first layer's gather per micro-batch, 1 of L, is
             not charged)
    grads    the layer's weight gradient reduce-scattered after its backward, f_N * W_layer in
             ``grad_reduce_bytes`` (None: the model dtype, Megatron-LM's default), hidden behind
             the next layer's backward
    K/V      CP over N (``cp_layer_terms``): ``all_gather`` (``--cp-comm-type all_gather``) K/V
             f_N * 2BSh_kv forward, re-gather + dK/dV reduce-scatter backward; ``ring``
             (``p2p``, TE's default): N-1 P2P steps of one K/V block forward, K/V + dK/dV blocks
             backward (the same bytes per rank, one peer per step); both hidden only behind
             attention compute."""
    if kv_flavour not in ("all_gather", "ring"):
        raise ValueError(f"kv_flavour must be 'all_gather' or 'ring', got {kv_flavour!r}")
    f = ring_factor(N)
    b = shape.dtype_bytes
    w = shape.layer_params
    g = grad_reduce_bytes or b
    out = [
        _term(
            "attn_fwd",
            "all_gather",
            "weight",
            f * w,
            b,
            "fsdp",
            "prefetch",
            what="all-gather the layer's weights (one layer ahead)",
        ),
        _term(
            "attn_bwd",
            "all_gather",
            "weight",
            f * w,
            b,
            "fsdp",
            "prefetch",
            what="all-gather the layer's weights again (one layer ahead)",
        ),
        _term(
            "attn_bwd",
            "reduce_scatter",
            "grad",
            f * w,
            g,
            "fsdp",
            "prefetch",
            what="reduce-scatter the layer's weight gradient",
        ),
    ]
    kv = cp_layer_terms(shape, N, regather_kv_bwd=regather_kv_bwd)
    if kv_flavour == "ring":
        kv = [
            dataclasses.replace(
                t,
                op="p2p",
                link="p2p",
                chunks=max(N - 1, 1),
                what=t.what + " (P2P ring, N-1 steps)",
            )
            for t in kv
        ]
    return out + kv


def gtp_linear_weights(shape: LayerShape) -> float:
    """The weights GTP shards and gathers per layer: the four linear weights (biases and norms
    stay whole)."""
    return shape.w_qkv + shape.w_proj + shape.w_fc1 + shape.w_fc2


def gtp_layer_terms(
    shape: LayerShape,
    T: int,
    C: int,
    R: int,
    *,
    wire_bytes: float = 2.0,
    grad_reduce_bytes: float = 2.0,
    regather_kv_bwd: bool = True,
) -> List[CommTerm]:
    """Megatron-LM's Generalized Tensor Parallelism (GTP = TP(T) x GTP_remat(R)) on TP+SP over T
    (x CP over C): TP+SP's and CP's terms (``tp_cp_layer_terms``, ``tp_sp_layer_terms`` at C = 1)
    and, over the R GTP_remat ranks (group ``gtp``, drawn from the data-parallel axis: each runs
    its own micro-batch), each linear weight's TP slice all-gathered before its forward GEMM and
    again before its backward GEMMs, f_R * W_lin / T each at ``wire_bytes`` per element (bf16 2,
    MXFP8 1.03125, NVFP4 0.5625), and its weight gradient reduce-scattered, f_R * W_lin / T at
    ``grad_reduce_bytes`` (bf16). One weight at a time, prefetched one weight ahead, the
    reduce-scatter finalised one weight later: all behind the neighbouring GEMMs (``prefetch``)."""
    f = ring_factor(R)
    w = gtp_linear_weights(shape) / T
    base = (
        tp_cp_layer_terms(shape, T, C, regather_kv_bwd=regather_kv_bwd)
        if C > 1
        else tp_sp_layer_terms(shape, T)
    )
    out = []
    for blk, share in (("attn", shape.w_qkv + shape.w_proj), ("mlp", shape.w_fc1 + shape.w_fc2)):
        frac = share / gtp_linear_weights(shape)
        out += [
            CommTerm(
                f"{blk}_fwd",
                "all_gather",
                "weight",
                f * w * frac,
                f * w * frac * wire_bytes,
                "gtp",
                "prefetch",
                what="GTP_remat all-gather of each weight (one weight ahead)",
            ),
            CommTerm(
                f"{blk}_bwd",
                "all_gather",
                "weight",
                f * w * frac,
                f * w * frac * wire_bytes,
                "gtp",
                "prefetch",
                what="GTP_remat all-gather again for the backward GEMMs",
            ),
            CommTerm(
                f"{blk}_bwd",
                "reduce_scatter",
                "grad",
                f * w * frac,
                f * w * frac * grad_reduce_bytes,
                "gtp",
                "prefetch",
                what="GTP_remat wgrad reduce-scatter (finalised one weight later)",
            ),
        ]
    return base + out


def ring_split(D: int, C: int) -> tuple:
    """The what-if CP ring of ``tsp_cp_layer_terms``: (inside the node, across nodes) fractions
    of 2BSh_kv one rank receives per K/V term."""
    return ring_factor(D), (C - 1) / (D * C)


def sum_terms(terms: List[CommTerm], by: str = "phase") -> Dict[str, float]:
    """Received bytes summed by ``phase`` (always the four PHASES keys), ``category`` or ``op``."""
    out: Dict[str, float] = {p: 0.0 for p in PHASES} if by == "phase" else {}
    for t in terms:
        key = getattr(t, by)
        out[key] = out.get(key, 0.0) + t.nbytes
    return out


def split_terms(terms: List[CommTerm]) -> Dict[str, Dict[str, float]]:
    """{phase: {category: bytes}} with categories weight, grad, activation (zeros included)."""
    out = {p: {"weight": 0.0, "grad": 0.0, "activation": 0.0} for p in PHASES}
    for t in terms:
        out[t.phase][t.category] += t.nbytes
    return out


def tsp_layer_comm(shape: LayerShape, D: int, **kw) -> Dict[str, float]:
    """Bytes received per rank: {attn_fwd, attn_bwd, mlp_fwd, mlp_bwd} (see ``tsp_layer_split``)."""
    return sum_terms(tsp_layer_terms(shape, D, **kw))


def tsp_layer_split(shape: LayerShape, D: int, **kw) -> Dict[str, Dict[str, float]]:
    """{phase: {weight, grad, activation}} in bytes received per rank."""
    return split_terms(tsp_layer_terms(shape, D, **kw))


def tp_sp_layer_comm(shape: LayerShape, D: int) -> Dict[str, float]:
    return sum_terms(tp_sp_layer_terms(shape, D))


def hybrid_layer_comm(shape: LayerShape, D: int, **kw) -> Dict[str, float]:
    return sum_terms(hybrid_layer_terms(shape, D, **kw))


def tp_layer_comm(shape: LayerShape, D: int) -> Dict[str, float]:
    return sum_terms(tp_layer_terms(shape, D))


def cp_layer_comm(shape: LayerShape, C: int, **kw) -> Dict[str, float]:
    return sum_terms(cp_layer_terms(shape, C, **kw))


def tp_cp_layer_comm(shape: LayerShape, T: int, C: int, **kw) -> Dict[str, float]:
    return sum_terms(tp_cp_layer_terms(shape, T, C, **kw))


def tsp_cp_layer_comm(shape: LayerShape, D: int, C: int, **kw) -> Dict[str, float]:
    return sum_terms(tsp_cp_layer_terms(shape, D, C, **kw))


def fwd(comm: Dict[str, float]) -> float:
    return comm["attn_fwd"] + comm["mlp_fwd"]


def bwd(comm: Dict[str, float]) -> float:
    return comm["attn_bwd"] + comm["mlp_bwd"]


def total(comm: Dict[str, float]) -> float:
    return fwd(comm) + bwd(comm)


def replicated_grad_allreduce(
    shape: LayerShape, D: int, num_layers: int = 1, extra_params: int = 0, grad_dtype_bytes: int = 4
) -> float:
    """Per STEP: finalize_model_grads all-reduces the grads of params tagged sequence_parallel
    (norms, proj/fc2 biases; ``extra_params`` e.g. the final norm) over the TSP / TP+SP group."""
    n = num_layers * shape.replicated_params + extra_params
    return 2 * ring_factor(D) * n * grad_dtype_bytes


def head_comm(
    shape: LayerShape,
    D: int,
    strategy: str = "tsp",
    *,
    logits_dtype_bytes: int = 4,
    vocab_ring: str = "auto",
) -> Dict[str, float]:
    """Embedding, output layer and cross-entropy (per micro-batch, not per layer).

    The embedding is Megatron's for every strategy: TSP and TP+SP reduce-scatter its output
    f*BSh forward and all-gather the gradient f*BSh backward; plain TP all-reduces 2f*BSh
    forward. The output layer and loss:

    * TSP on the vocabulary ring (``core.layers.vocab_ring``): the output weight's vocabulary
      shards ride the weight ring, f*V*h weight bytes forward, again backward, plus the fp32
      (accumulation-dtype) gradient accumulator f*V*h*4; the per-token losses are all-gathered,
      f*BS fp32. No activation bytes. ``vocab_ring``: the policy (``output_head.POLICIES``);
      "auto", the default, takes the ring where it receives fewer bytes, by the rule the layer
      applies (``output_head.ring_receives_fewer_bytes``).
    * TP+SP (and TSP without the ring): output-layer all-gather f*BSh forward, re-gather f*BSh
      + dgrad reduce-scatter f*BSh backward, three all-reduces of [B*S] fp32 in the
      cross-entropy (max, predicted logit, sum-exp).
    * plain TP: output-layer dgrad all-reduce 2f*BSh backward, the same cross-entropy.
    * CP: the head is replicated over the CP group (no communication).

    V is the vocabulary padded for D ranks (``ModelShape.padded_vocab``)."""
    f = ring_factor(D)
    b = shape.dtype_bytes
    x = shape.tokens * shape.hidden
    ce = 3 * 2 * f * shape.tokens * logits_dtype_bytes
    if strategy == "tsp" and vocab_ring_taken(shape, D, vocab_ring):
        weights = f * shape.padded_vocab(D) * shape.hidden
        losses = f * shape.tokens * 4
        grads = weights * accumulation_bytes(b)
        return {"fwd": f * x * b + weights * b + losses, "bwd": f * x * b + weights * b + grads}
    if strategy in ("tsp", "tp_sp"):
        return {"fwd": 2 * f * x * b + ce, "bwd": 3 * f * x * b}
    if strategy == "tp":
        return {"fwd": 2 * f * x * b + ce, "bwd": 2 * f * x * b}
    if strategy == "cp":
        return {"fwd": 0.0, "bwd": 0.0}
    raise ValueError(strategy)


def vocab_ring_taken(shape: LayerShape, D: int, policy: str) -> bool:
    """Whether TSP's loss runs on the vocabulary ring for micro-batches of ``shape`` under
    ``policy`` (the layer's own decision, ``output_head.ring_taken``)."""
    from megatron_tsp.core.output_head import ring_taken

    b = shape.dtype_bytes
    return ring_taken(
        policy, shape.tokens, shape.padded_vocab(D), shape.hidden, b, accumulation_bytes(b)
    )


def dp_step_comm(
    local_params: float,
    dp: int,
    *,
    distributed_optimizer: bool = True,
    grad_dtype_bytes: int = 4,
    param_dtype_bytes: int = 2,
) -> Dict[str, float]:
    """Per STEP data-parallel traffic per rank over a group of ``dp`` ranks that each hold
    ``local_params`` parameters: distributed optimizer = grad reduce-scatter + param all-gather,
    otherwise a grad all-reduce."""
    f = ring_factor(dp)
    if distributed_optimizer:
        return {
            "grad_reduce": f * local_params * grad_dtype_bytes,
            "param_gather": f * local_params * param_dtype_bytes,
        }
    return {"grad_reduce": 2 * f * local_params * grad_dtype_bytes, "param_gather": 0.0}


# ---------------------------------------------------------------------------------------------
# crossover
# ---------------------------------------------------------------------------------------------
_BASELINES = {"tp_sp": tp_sp_layer_comm, "tp": tp_layer_comm}


def _select(comm: Dict[str, float], direction: str) -> float:
    if direction == "fwd":
        return fwd(comm)
    if direction == "bwd":
        return bwd(comm)
    if direction in ("total", "fwd+bwd"):
        return total(comm)
    raise ValueError(f"direction must be fwd, bwd or total, got {direction!r}")


_CANDIDATES = {"tsp": tsp_layer_comm, "hybrid": hybrid_layer_comm}


def crossover_seq_length(
    shape: LayerShape,
    D: int,
    direction: str = "fwd",
    baseline: str = "tp_sp",
    candidate: str = "tsp",
    **tsp_kw,
) -> float:
    """Smallest S (real number) with the candidate's bytes (TSP, or the ``hybrid`` TP+SP
    attention + TSP MLP) <= baseline bytes for ``shape.batch``.

    Both counts are affine in S (TSP: weights + a*S, baseline: b*S), so S* = weights / (b - a);
    ``math.inf`` if TSP's per-token traffic is not below the baseline's. Multiply by the batch
    for the B*S crossover; ``crossover_seq_length(...) * B / h`` is the constant in "B*S >= c*h".
    """
    base = _BASELINES[baseline]
    s1, s2 = shape.with_seq(1), shape.with_seq(2)
    cand = _CANDIDATES[candidate]
    t1, t2 = (_select(cand(s, D, **tsp_kw), direction) for s in (s1, s2))
    b1, b2 = (_select(base(s, D), direction) for s in (s1, s2))
    a_t, c_t = t2 - t1, t1 - (t2 - t1)  # slope, intercept
    a_b, c_b = b2 - b1, b1 - (b2 - b1)
    if D == 1:
        return 0.0
    if a_b <= a_t:
        return math.inf
    return max((c_t - c_b) / (a_b - a_t), 0.0)


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------
def layer_flops(
    shape: LayerShape,
    *,
    recompute_fc1: bool = False,
    recompute_attn_core: bool = False,
    full_recompute: bool = False,
    causal_fraction: float = 0.5,
    bwd_factor: float = 2.0,
) -> Dict[str, float]:
    """FLOPs of one layer over all B*S tokens (divide by the group size for per-rank work).

    fwd matmul 2*B*S*(W_qkv + W_proj + W_fc1 + W_fc2) (an MoE layer: k experts' fc1 / fc2 per
    token, the router and the shared expert); attention core 2 GEMMs (QK^T, PV) of
    2*B*S^2*h each times ``causal_fraction``; backward = ``bwd_factor`` x forward; recompute in the
    backward: TSP's per-shard fc1 GEMM (``recompute_fc1``) and attention-core forward
    (``recompute_attn_core``), or a whole forward (``full_recompute``, Megatron's
    --recompute-granularity full). Element-wise ops, norms, softmax and biases are not counted."""
    bs = shape.tokens
    gemm = {
        "qkv": 2 * bs * shape.w_qkv,
        "proj": 2 * bs * shape.w_proj,
        "fc1": 2 * bs * shape.w_fc1,
        "fc2": 2 * bs * shape.w_fc2,
    }
    if shape.is_moe:
        # an MoE layer (both schedules do the same work): each token's k expert copies through
        # one expert's fc1 / fc2, the router GEMM [E, h], the shared expert over every token
        expert_fc2 = shape.expert_ffn * shape.hidden
        gemm["fc1"] = 2 * bs * shape.moe_topk * (shape.w_expert - expert_fc2)
        gemm["fc2"] = 2 * bs * shape.moe_topk * expert_fc2
        gemm["router"] = 2 * bs * shape.num_experts * shape.hidden
        gemm["shared_expert"] = 2 * bs * shape.w_shared_expert
    attn = 2 * 2 * bs * shape.seq * shape.hidden * causal_fraction
    matmul_fwd = sum(gemm.values())
    fwd_ = matmul_fwd + attn
    if full_recompute:
        recompute = fwd_
    else:
        recompute = (gemm["fc1"] if recompute_fc1 else 0.0) + (attn if recompute_attn_core else 0.0)
    out = {
        "fwd": fwd_,
        "fwd_matmul": matmul_fwd,
        "fwd_attn_core": attn,
        "bwd": bwd_factor * fwd_,
        "bwd_attn_core": bwd_factor * attn,
        "recompute": recompute,
        "recompute_attn_core": attn if (recompute_attn_core or full_recompute) else 0.0,
    }
    out["total"] = out["fwd"] + out["bwd"] + out["recompute"]
    return out


def head_flops(shape: LayerShape, vocab: int, bwd_factor: float = 2.0) -> Dict[str, float]:
    """Output-layer logits GEMM (embedding lookup is free): fwd 2*B*S*h*V."""
    f_ = 2 * shape.tokens * shape.hidden * vocab
    return {"fwd": f_, "bwd": bwd_factor * f_, "total": (1 + bwd_factor) * f_}


# ---------------------------------------------------------------------------------------------
# the paper's "B*S > 8h"
# ---------------------------------------------------------------------------------------------
def crossover_analysis(shape: LayerShape, D: int) -> Dict[str, float]:
    """Crossover constants c (B*S >= c*h) from the counted bytes, and what the paper's 8h needs.

    Counted forward: f(W + 2BSh_kv) <= f*4BSh  <=>  BS >= W / (4h - 2h_kv).
    For MHA, F = 4h, no gating / bias: W = 12h^2, h_kv = h  ->  BS >= 6h.
    ``weights_for_8h`` is the per-layer moved weight count that would make the constant 8."""
    h = shape.hidden
    out = {}
    for name, direction, baseline in (
        ("fwd_vs_tp_sp", "fwd", "tp_sp"),
        ("fwd_vs_tp", "fwd", "tp"),
        ("total_vs_tp_sp", "total", "tp_sp"),
        ("total_vs_tp", "total", "tp"),
    ):
        out[name] = crossover_seq_length(shape.with_batch(1), D, direction, baseline) / h
    out["weights_over_h2"] = shape.w_layer / h**2
    # hypothesis: weights counted in full (D shards incl. the own one) instead of (D-1)/D of them
    f = ring_factor(D)
    out["fwd_weights_without_f"] = out["fwd_vs_tp_sp"] / f if f else math.inf
    out["weights_for_8h_over_h2"] = 8 * h * (4 * h - 2 * shape.kv_hidden) / h**2
    return out
