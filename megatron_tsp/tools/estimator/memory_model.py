"""The planner's peak-memory model of one GPU (``analytic_memory``): parameters, gradients and
optimizer state, what each layer saves for its backward, the backward's working set, the
output layer; each term as the layers allocate it (checked against the fake-tensor tool,
``tests/estimator/test_planner_memory.py``)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

from megatron_tsp.core.layers import weight_ring
from megatron_tsp.core.model_shape import ModelShape

from . import formulas as fm
from . import moe
from .formulas import LayerShape
from .planner_inputs import load_model
from .strategies import Options, Strategy, as_strategy, moe_schedule


def _layer_activation_bytes(
    shape: LayerShape, s: Strategy, o: Options, rope: bool = True
) -> Dict[str, float]:
    """Bytes one layer keeps for its backward on one rank (no full recompute), tensor by tensor,
    as the code saves them (measured with saved-tensor hooks and the fake-tensor tool).

    TSP (t = local tokens B*S/D, B*S/(D*C) under TSP x CP): the two norm inputs and outputs
    (the layer input, the attention Function's input, the residual, the MLP Function's input),
    the norms' statistics; saved attention backward: the rotated q and each head group's packed
    local K/V, the attention output (kept once, saved once) and fp32 log-sum-exp; the MLP its
    per-shard fc1 outputs (only its input with TSP's opt-in fc1 recompute,
    ``tsp_recompute_fc1=True``). The RoPE tables are per step (``_tsp_step_tables``).
    Megatron TP(+SP) / CP (t = B*S/C tokens, T = TP): norm inputs/outputs (1/T of t with SP), the
    QKV GEMM output (kept alive by the v view), the rotated q and k, the attention output, the
    fp32 log-sum-exp, unfused RoPE's cos/sin (two [t, hn] bf16 per rotated tensor), the MLP
    intermediates (fc1 output, activation output, and for GLUs the activated half)."""
    if shape.is_moe:  # the dense layer's attention, norms and residual, the MoE layer's MLP
        out = _layer_activation_bytes(moe.dense_layer(shape), s, o, rope)
        out = {k: v for k, v in out.items() if not k.startswith("mlp_")}
        return {**out, **moe.saved_bytes(shape, s.tp, moe_schedule(shape, s, o))}
    h, hkv, hn = shape.hidden, shape.kv_hidden, shape.head_dim
    b = shape.dtype_bytes
    F_, rows = shape.ffn_hidden, shape.fc1_rows
    bs = shape.tokens
    norm_stats = 2 if shape.normalization == "LayerNorm" else 1  # mean + rstd, or rstd
    if s.is_tsp:
        t = bs / s.degree  # TSP x CP: the tokens are spread over the D*C sequence ranks
        out = {
            # the layer input (saved by the input norm), the attention Function's input (the
            # norm output), the residual after attention and the MLP Function's input
            "norm_in_out": 4 * t * h * b,
            "norm_stats": 2 * norm_stats * t * b,
            # the RoPE tables are built once per step (``_tsp_step_tables``), not per layer
        }
        if not o.tsp_recompute_attn:
            out["attn_qkv"] = t * (h + 2 * hkv) * b
            out["attn_out"] = t * h * b  # saved once (the chunks' output rows)
            out["attn_lse"] = t * shape.heads * 4
        if not o.tsp_recompute_fc1:
            out["mlp_fc1_out"] = t * rows * b
        return out
    t = bs / s.cp
    sp = s.layout in ("tp_sp", "hybrid", "tp_cp", "cp")
    rep = t / s.tp if sp else t  # tensors in the residual-stream layout
    T = s.tp
    mid = rows + F_ + (F_ if shape.gated else 0)
    out = {
        "norm_in_out": 4 * rep * h * b,
        "norm_stats": 2 * norm_stats * rep * b,
        "qkv_gemm_out": t * (h + 2 * hkv) / T * b,
        "rotated_qk": t * (h + hkv) / T * b if rope else 0.0,
        "rope_cos_sin": 4 * t * hn * b if rope else 0.0,
        "attn_out": t * h / T * b,
        "attn_lse": t * shape.heads / T * 4,
        "mlp_mid": t * mid / T * b,
    }
    if s.kind == "fsdp_cp" and s.kv_flavour == "ring":
        # TE's P2P ring saves q and the last K/V block it received (one [t, 2 h_kv] copy), not
        # k and v: the QKV GEMM output (which the all-gather's saved v view keeps alive) and the
        # rotated k are freed after the forward (megatron-tsp memory --cp-comm-type p2p)
        out["qkv_gemm_out"] = 2 * t * hkv / T * b
        out["rotated_qk"] = t * h / T * b if rope else 0.0
    if s.kind == "hybrid":
        # The TSP MLP keeps only its (local) input, already counted in norm_in_out, unless it
        # keeps the per-shard fc1 outputs (B*S/D tokens x every shard's fc1 rows).
        out["mlp_mid"] = 0.0 if o.tsp_recompute_fc1 else (bs / s.tp) * rows * b
    return out


def _head_groups(shape: LayerShape, D: int) -> int:
    """Head groups TSP attention walks: D (one weight shard each), or the query-group count when
    there are fewer K/V heads than ranks (a group then spans D / groups shards: its step holds
    all of the group's np/ng query heads and its one K/V head, megatron-core's TP layout)."""
    return min(D, shape.groups)


def _tsp_comm_workspace(
    shape: LayerShape,
    D: int,
    kv_grad_fp32: bool = False,
    saved_attention: bool = True,
    grad_slots: Optional[int] = None,
    cp: int = 1,
    kv_flavour: str = "all_gather",
):
    """Bytes of TSP attention's persistent communication buffers (``comm.WORKSPACE``, shared by
    all layers, allocated on first use): (in forward, in backward). G: the head groups
    (``_head_groups``: D, or the query groups when fewer); a kind of buffer has one slot per
    head group in flight, min(2, G) slots. Forward, per slot: the gathered [S, b, 2 h_kv / G]
    K/V (``attention._post_kv_gather``: late chunks in owner order, then the early chunks, read
    as they arrive, then a copy of this rank's late chunk); with recomputed attention also the
    packed local K/V send buffers [S/D, b, 2 h_kv / G] (one per slot; saved attention keeps a
    fresh send buffer per head group instead, counted with the saved tensors). Backward adds,
    per slot, a dK/dV send buffer [S, b, 2 h_kv / G] and its receive buffer [S/D, ...] in the
    dK/dV wire dtype (the model dtype; the accumulation dtype with ``kv_grad_fp32``).
    ``grad_slots``: how many of the backward slots exist (default: all; the first layer's
    backward allocates them one head group at a time, see ``_tsp_backward_peak``). TSP x CP
    (``cp`` = C): the gathered buffers still span the whole sequence, the local ones are
    [S/(DC), ...]; the what-if ring (``kv_flavour="ring"``, not in the layers) holds two node
    blocks [S/C, ...] (the one attended and the one in flight) where the all-gather holds the
    whole sequence."""
    b = shape.dtype_bytes
    acc = fm.accumulation_bytes(b) if kv_grad_fp32 else b
    G = _head_groups(shape, D)
    slots = min(2, G)
    kv_full = 2 * shape.tokens * shape.kv_hidden / G
    kv_local = kv_full / (D * cp)
    if kv_flavour == "ring" and cp > 1:
        kv_full = 2 * kv_full / cp
        gathered = slots * kv_full + kv_full  # per slot the block in flight, one attended
    else:  # per slot the gathered K/V (``attention._post_kv_gather``: no reordered copy) and
        # the copy of this rank's late chunk after it (half its local K/V)
        gathered = slots * (kv_full + (kv_local / 2 if D * cp > 1 else 0))
    fwd = (gathered + (0 if saved_attention else slots * kv_local)) * b
    grad_slots = slots if grad_slots is None else grad_slots
    return fwd, fwd + grad_slots * (kv_full + kv_local) * acc


def _kernel_dkv_bytes(shape: LayerShape, D: int, kernel: str) -> float:
    """What the attention kernel's backward holds for the largest zigzag chunk (its keys span the
    whole sequence S), before ``TSPLayout.key_pieces`` are summed into the send buffer: the kernel's
    dK and dV over S keys for one head group. A top-left kernel runs the bottom-right chunk as a
    prefix block and a diagonal block and hands both parts over as they are (no concatenation,
    ``backward_parts``): S keys' worth, as one call would; te_fused holds contiguous copies of
    the chunk's K and V (as many bytes as its dK/dV) while its backward runs; a kernel without
    native GQA computes dK/dV per query head from K/V repeated to the query heads, then folds them
    to the key/value heads."""
    from megatron_tsp.core.layers import kernels

    try:
        backend = kernels.kernel_class(kernel)  # the facts below are the kernel class's
    except ValueError as exc:
        raise ValueError(f"Options.attn_kernel={kernel!r}: {exc}") from exc
    b = shape.dtype_bytes
    # K+V (or dK+dV) over S keys of one hidden unit, times the fraction of the heads one step has
    per_head_group = 2 * shape.tokens / _head_groups(shape, D) * b
    repeat = not backend.native_gqa and shape.heads != shape.groups
    width = shape.hidden if repeat else shape.kv_hidden  # heads the kernel computes dK/dV for
    out = per_head_group * width * (2 if backend.copies_kv else 1)
    if repeat:  # the repeated K/V inputs and the folded dK/dV
        out += per_head_group * (shape.hidden + shape.kv_hidden)
    return out


def _tsp_backward_working_sets(
    shape: LayerShape, s: Strategy, o: Options
) -> Tuple[Dict[str, float], Dict[str, float]]:
    """One TSP layer's backward working set beyond what it saved and the comm workspace, in its
    two phases (they do not overlap: the MLP backward runs first and frees its buffers):
    (MLP backward, attention backward), tensor by tensor as ``mlp.py`` / ``attention.py`` hold
    them at their largest."""
    b = shape.dtype_bytes
    acc = fm.accumulation_bytes(b)
    bs, h = shape.tokens, shape.hidden
    D = s.tp
    gb = acc if o.tsp_grad_comm_bytes is None else o.tsp_grad_comm_bytes
    sums = acc if o.tsp_activation_sums_fp32 else b  # ``precision.activation_sum_dtype``
    t = bs / s.degree  # local tokens (TSP x CP: over the D*C sequence ranks)
    F_, rows = shape.ffn_hidden, shape.fc1_rows
    G = _head_groups(shape, D)
    m = D // G  # weight shards per head group: fewer K/V heads than D read several at once
    if shape.is_moe:
        _, attn = _tsp_backward_working_sets(moe.dense_layer(shape), s, o)
        return moe.backward_working_set(shape, D, moe_schedule(shape, s, o)), attn
    # the MLP's activation backward: one kernel on a GPU (``activation_kernel``), torch ops
    # under autograd on the CPU (a fresh d(fc1 output) per shard, then copied into its slot)
    act_kernel = not _cpu_gemm_upcast(o)
    mlp = {
        "grad_out": t * h * b,  # the layer output's gradient, held through the layer
        # the one dgrad GEMM's operands (every shard's d(fc1 output) side by side, every
        # shard's fc1 weight) and its output
        "fc1_grad_all_shards": t * rows * b,
        "fc1_weight_all_shards": rows * h * b,
        "grad_x": t * h * sums,
        # the shard being read and the next one in flight (the packed own shard is let go)
        "weight_shard_buffers": min(2, D) * shape.w_mlp / D * b,
        # own shard and the two that alternate between accumulated onto and on the wire
        "grad_accumulators": (weight_ring.GRAD_SHARDS_HELD if D > 1 else 1) * shape.w_mlp / D * gb,
        # step t's activation output and its gradient (on the CPU also its fresh d(fc1
        # output)), while step t-1's activation output is still referenced (rebound only when
        # ``input_grads`` returns)
        "mlp_shard_mid": (3 * F_ + (0 if act_kernel else rows)) * t / D * b,
    }
    if o.tsp_recompute_fc1:
        mlp["mlp_shard_fc1_recomputed"] = t * rows / D * b
    if _cpu_gemm_upcast(o) and o.tsp_activation_sums_fp32:
        # ``precision.matmul_acc`` off CUDA: fp32 copies of the one dgrad GEMM's operands
        mlp["dx_gemm_fp32_operands"] = (t * rows + rows * h) * acc
    hold = 3 if o.tsp_recompute_attn else 2
    attn = {
        "grad_out": t * h * b,
        # every head group's QKV gradient side by side and every shard's QKV weight, the
        # operands of the one dgrad GEMM after the last group, and its output
        "qkv_grad_all_groups": t * shape.w_qkv / h * b,
        "qkv_weight_all_shards": shape.w_qkv * b,
        "grad_x": t * h * sums,
        "context_grad": t * h * b,  # d(context) [s/D, b, h] from the one projection GEMM
        # the packed own shard and the stream's spare buffers (``head_groups.GroupStream``)
        "weight_shard_buffers": (1 + min((hold + 1) * m, D)) * shape.w_attn / D * b,
        "weight_grad_partials": m * shape.w_attn / D * acc,  # one fp32 shard per weight shard
        # the first causal block's dK/dV (the kernel's output, up to half the sequence: rank
        # D-1's early chunk) kept while the second block's backward runs, until both are
        # summed into the send buffer
        "first_block_dkv": (bs * shape.kv_hidden / G) * b,
        "kernel_dkv_outputs": _kernel_dkv_bytes(shape, D, o.attn_kernel),
    }
    if _cpu_gemm_upcast(o) and o.tsp_activation_sums_fp32:
        attn["dx_gemm_fp32_operands"] = (t * shape.w_qkv / h + shape.w_qkv) * acc
    if s.kv_flavour == "ring":
        # what-if: the kernel sees one node block of S/C keys at a time
        attn["first_block_dkv"] /= s.cp
        attn["kernel_dkv_outputs"] /= s.cp
    if o.tsp_recompute_attn:
        # the head group's recomputed rotated q, attention output and fp32 log-sum-exp (its K/V
        # are recomputed into the workspace's send slots)
        attn["recomputed_q_out_lse"] = t * (2 * h * b + shape.heads * 4) / G
    return mlp, attn


def _tsp_step_tables(shape: LayerShape, s: Strategy, rope: bool) -> float:
    """Per-step tensors every TSP layer reads: Megatron's rotary frequencies [S, 1, 1, hn]
    (fp32, built by GPTModel; [S/C, ...] under CP, Megatron keeps this CP rank's chunks) and
    TSP's local RoPE tables (cos and the signed sines, [s/D, hn] in the model dtype, s/(DC)
    under CP, built once per step: ``rope.local_tables``)."""
    if not rope:
        return 0.0
    return shape.tokens / s.cp * shape.head_dim * 4 + 2 * shape.tokens / s.degree * (
        shape.head_dim * shape.dtype_bytes
    )


def _tsp_backward_peak(
    shape: LayerShape, s: Strategy, o: Options, num_layers: int, recompute: str, rope: bool
) -> float:
    """TSP's backward peak beyond params/grads/optimizer and the layers' stored activations
    (``num_layers`` x saved tensors, or x the layer input with full recompute), the largest of:
    the first backward layer (the last one) in its MLP and its attention phase, when the comm
    workspace holds only the forward buffers (its dK/dV buffers are allocated per head group
    as the attention backward reaches them), and a later layer in both phases, with the whole
    workspace but one layer less stored (its activations were freed)."""
    b = shape.dtype_bytes
    t = shape.tokens / s.degree
    saved = _layer_activation_bytes(shape, s, o, rope)
    full = sum(saved.values())
    # the MLP part of the saved tensors (freed by the time the attention backward runs): the
    # residual, the MLP Function's input with its norm statistics, the kept fc1 outputs
    mlp_part = 2 * t * shape.hidden * b + saved["norm_stats"] / 2
    mlp_part += sum(v for k, v in saved.items() if k.startswith(("mlp_", "moe_")))
    per_layer = full
    if recompute == "full":
        # the recomputed layer's saved tensors; its input is already stored (the checkpoint)
        full -= t * shape.hidden * b
        per_layer = t * shape.hidden * b
    mlp_work, attn_work = _tsp_backward_working_sets(shape, s, o)
    G = _head_groups(shape, s.tp)
    saved_attn = not o.tsp_recompute_attn
    ws = dict(cp=s.cp, kv_flavour=s.kv_flavour)
    _, ws_first_mlp = _tsp_comm_workspace(shape, s.tp, o.tsp_kv_grad_fp32, saved_attn, 0, **ws)
    # the first layer's attention: the kernel of the last group runs with the earlier groups'
    # send/receive slots allocated
    _, ws_first_attn = _tsp_comm_workspace(
        shape, s.tp, o.tsp_kv_grad_fp32, saved_attn, min(2, G - 1), **ws
    )
    _, ws_all = _tsp_comm_workspace(shape, s.tp, o.tsp_kv_grad_fp32, saved_attn, **ws)
    mlp_phase = full + sum(mlp_work.values())
    attn_phase = full - mlp_part + sum(attn_work.values())
    if recompute == "full":
        # the checkpoint's backward holds the recomputed layer output and its gradient until the
        # whole layer is done; the attention backward's incoming gradient (output gradient +
        # the MLP branch's) is then a second [s/D, b, h] tensor
        mlp_phase += t * shape.hidden * b
        attn_phase += 2 * t * shape.hidden * b
    # bytes beyond num_layers x per_layer: without recompute the current layer's saved tensors
    # are one of the stored layers; with full recompute its stored input is, and the recomputed
    # tensors (``full``) come on top
    offset = 0.0 if recompute == "full" else per_layer
    cands = [mlp_phase + ws_first_mlp - offset, attn_phase + ws_first_attn - offset]
    if num_layers > 1:  # a later layer: the layer after it (in forward order) was freed
        cands += [mlp_phase + ws_all - offset - per_layer, attn_phase + ws_all - offset - per_layer]
    extra = max(cands)
    if recompute == "full" and rope:
        extra += 3 * t * shape.head_dim * b  # the recomputed forward rebuilds the local tables
    return extra


def _layer_transient_bytes(shape: LayerShape, s: Strategy, o: Options) -> Dict[str, float]:
    """One layer's working set in its backward, beyond what it saved."""
    b = shape.dtype_bytes
    bs, h, hkv = shape.tokens, shape.hidden, shape.kv_hidden
    if s.is_tsp:
        mlp, attn = _tsp_backward_working_sets(shape, s, o)
        return mlp if sum(mlp.values()) >= sum(attn.values()) else attn
    t = bs / s.cp
    if s.kind == "hybrid":
        # attention: Megatron's gathered QKV input + dgrad; MLP: TSP's shard buffers, fp32
        # accumulators and one shard's intermediate
        D = s.tp
        gb = fm.accumulation_bytes(b) if o.tsp_grad_comm_bytes is None else o.tsp_grad_comm_bytes
        out = {
            "gathered_input_and_dgrad": 2 * t * h * b,
            "weight_shard_buffers": 2 * shape.w_mlp / D * b,
            "grad_accumulators": weight_ring.GRAD_SHARDS_HELD * shape.w_mlp / D * gb,
            "grad_x_accumulator": (bs / D)
            * h
            * (fm.accumulation_bytes(b) if o.tsp_activation_sums_fp32 else b),
        }
        mid = shape.ffn_hidden + (shape.fc1_rows if o.tsp_recompute_fc1 else 0)
        out["mlp_shard_mid"] = (bs / D) * mid / D * b
        return out
    if shape.is_moe:  # the MoE backward (no gathered input), then the attention's
        moe_work = moe.backward_working_set(shape, s.tp, moe_schedule(shape, s, o))
        attn_work = {"gathered_input_and_dgrad": 2 * t * h * b}
        return moe_work if sum(moe_work.values()) >= sum(attn_work.values()) else attn_work
    # the MLP backward holds the gradients of its saved intermediates next to them
    out = {"mlp_mid_grads": t * (shape.fc1_rows + shape.ffn_hidden) / s.tp * b}
    if s.layout in ("tp_sp", "tp_cp"):
        out["gathered_input_and_dgrad"] = 2 * t * h * b
    elif s.layout == "tp":
        out["row_output_before_allreduce"] = t * h * b
    if s.layout in ("cp", "tp_cp"):
        out["gathered_kv_and_dkv"] = 2 * (2 * bs * hkv / s.tp) * b
        if s.kind == "fsdp_cp" and s.kv_flavour == "ring":
            # TE's P2P ring: the K/V block attended and the one in flight, and as many dK/dV
            # blocks, each [S/N, b, 2 h_kv], instead of the whole sequence's K/V and dK/dV
            out["gathered_kv_and_dkv"] = 4 * (2 * bs * hkv / s.cp) * b
    return out


def head_shape(shape: LayerShape, s, seq: int) -> LayerShape:
    """The micro-batch the output layer sees: under CP, this CP rank's S/C tokens."""
    return shape if s.cp == 1 else shape.with_seq(seq // s.cp)


def _cpu_gemm_upcast(o) -> bool:
    """Whether a GEMM with an fp32 result copies its bf16 operands to fp32 first
    (``Options.cpu_gemm_upcast``)."""
    return o.cpu_gemm_upcast if o.cpu_gemm_upcast is not None else o.attn_kernel == "cpu_flash"


def _vocab_ring_head_bytes(m: ModelShape, local_tokens: float, T: int, vpad: int, o) -> float:
    """The vocabulary ring's working set (``core.layers.vocab_ring``), the larger of its forward
    and its backward: the fp32 logits of the rank's own tokens over the whole vocabulary (the
    softmax and then its gradient, in place), one shard's GEMM output / gradient in the compute
    dtype, the weight ring's packed shard and spares, and in backward its fp32
    gradient-accumulator shards and the dX accumulator."""
    b = m.dtype_bytes
    shard = vpad / T * m.hidden
    logits = local_tokens * vpad * fm.accumulation_bytes(b)  # fp32 (fp64 models: fp64)
    step = local_tokens * vpad / T * b
    weights = (1 + min(T - 1, 2)) * shard * b if T > 1 else 0.0
    forward = logits + step + weights
    sums = fm.accumulation_bytes(b) if o.tsp_activation_sums_fp32 else b
    grads = (weight_ring.GRAD_SHARDS_HELD if T > 1 else 1) * shard * fm.accumulation_bytes(b)
    backward = logits + step + weights + grads + local_tokens * m.hidden * sums
    if _cpu_gemm_upcast(o):  # the weight-gradient GEMM's fp32 operand copies (CPU)
        backward += (local_tokens * vpad / T + local_tokens * m.hidden) * 4
    return max(forward, backward)


def analytic_memory(
    model: Union[str, ModelShape],
    strategy: Union[str, Strategy],
    seq: int,
    micro_batch: int = 1,
    *,
    degree: Optional[int] = None,
    dp: int = 1,
    recompute: str = "none",
    distributed_optimizer: bool = True,
    options: Optional[Options] = None,
) -> Dict[str, float]:
    """Peak-memory model of one GPU in BYTES, by category (sum the values for the total).

    params      bf16 weights held by the rank (1/T of the sharded matrices and vocab-parallel
                embeddings, replicated norms / row biases; CP holds everything)
    grads       fp32 main grads for the local params (4 B/param)
    optimizer   fp32 master params + Adam m, v (12 B/param), divided over the data-parallel
                group (DP, or DP x CP for CP) when ``distributed_optimizer``
    activations tensors every layer keeps for its backward (``recompute='full'``: only each
                layer's input in the residual-stream layout)
    transient   (backward peak only) one layer's working set: TSP: two weight-shard buffers
                (current + prefetched), the ring's fp32 gradient-accumulator shards, the grad_x
                accumulator, one head group's full-sequence K/V and dK/dV, one MLP shard's
                intermediate; TP+SP: gathered input + full dgrad; CP: gathered K/V and dK/dV;
                with full recompute also the recomputed layer's activations
    logits      (forward peak only) the all-gathered final hidden state, the output-layer logits
                [tokens, vocab/T] bf16 and the fp32 copy kept by the cross-entropy
    The peak is the larger of forward (activations + logits) and backward (activations +
    transient); the category not at the peak is 0.
    Not counted: dropout masks (dropout 0), softmax statistics, RNG state, allocator
    fragmentation, framework/NCCL workspaces, the embedding's own output.
    """
    m = load_model(model)
    o = options or Options()
    s = as_strategy(strategy, degree)
    shape = LayerShape.of(m, micro_batch, seq)
    b = m.dtype_bytes
    T = s.weight_shards
    vpad = m.padded_vocab(T)
    moe_schedule(shape, s, o)  # an MoE model under a strategy without MoE layers: refused
    dense = moe.dense_layer(shape)
    sharded = dense.w_qkv + dense.b_qkv + dense.w_proj + dense.w_fc1 + dense.b_fc1 + dense.w_fc2
    n_moe = m.moe_layers
    layer_params = (m.num_layers - n_moe) * (sharded / T + dense.replicated_params)
    if n_moe:
        layer_params += n_moe * moe.layer_params(m, T)
    emb = vpad * m.hidden * (1 if m.tied_embeddings else 2)
    held = 0.0  # gathered (unsharded) weight and gradient buffers of fsdp_cp / gtp, bytes
    if s.kind == "gtp":
        # GTP_remat keeps 1/R of every linear weight's TP slice (and its gradient)
        lin = fm.gtp_linear_weights(dense) / T
        layer_params -= m.num_layers * lin * (1 - 1 / s.remat)
        # one weight gathered and the next in flight (model dtype after the gather), and the
        # two wgrad ring slots (graph_wgrad_ring_size = 2) of the largest weight, bf16
        big = max(dense.w_qkv, dense.w_proj, dense.w_fc1, dense.w_fc2) / T
        held = 2 * big * b + 2 * big * 2
    local_params = layer_params + emb / T + m.final_norm_params()
    if s.kind == "fsdp_cp":
        # ZeRO-3 over N = D*C: 1/N of every parameter (the gathered weights: _fsdp_cp_peak)
        local_params /= s.cp
    dp_opt = dp * (s.cp if s.kind in ("cp", "tp_cp", "tsp_cp", "gtp") else 1)
    opt_div = dp_opt if distributed_optimizer else 1

    # an MoE model's layers are dense first (``moe_dense_layers``), MoE after: the layer whose
    # backward runs first, and the largest, is an MoE layer
    layer_act = sum(_layer_activation_bytes(shape, s, o, m.rope).values())
    dense_act = sum(_layer_activation_bytes(dense, s, o, m.rope).values()) if n_moe else 0.0
    transient = sum(_layer_transient_bytes(shape, s, o).values())
    if recompute == "full":
        resid = shape.tokens / (s.degree if s.kind != "tp" else 1) * m.hidden * b
        activations = m.num_layers * resid
        backward_extra = layer_act + transient  # the recomputed layer and its backward
    elif recompute == "none":
        activations = (m.num_layers - n_moe) * (dense_act if n_moe else layer_act)
        activations += n_moe * layer_act
        backward_extra = transient
    else:
        raise ValueError(f"recompute must be none or full, got {recompute!r}")
    # Forward peak: every layer's saved tensors plus the output layer's: the final hidden state
    # (all-gathered over TP/TSP) and the bf16 logits [tokens, vocab/T] with the fp32 copy the
    # unfused cross-entropy keeps. Backward peak: the saved tensors plus one layer's working set
    # (the logits are gone by then). The peak is the larger of the two.
    head_tokens = shape.tokens / s.cp
    stream_tokens = head_tokens if s.kind == "tp" else head_tokens / T  # residual-stream layout
    vocab_ring = s.is_tsp and fm.vocab_ring_taken(head_shape(shape, s, seq), T, o.tsp_vocab_ring)
    if vocab_ring:
        head = _vocab_ring_head_bytes(m, head_tokens / T, T, vpad, o)
    else:
        head = (
            head_tokens * vpad / T * (b + 4)  # bf16 logits + the cross-entropy's fp32 copy
            + head_tokens * m.hidden * b  # final hidden state all-gathered for the GEMM
        )
    logits = (
        head
        # last layer's output, final-norm output, the norm's normalised intermediate
        + 3 * stream_tokens * m.hidden * b
        # per-token ids/labels/positions (int64), loss and the cross-entropy's max,
        # sum-exp, predicted logit (fp32), target index (int64), mask: ~47 B
        + 47 * head_tokens
    )
    if s.is_tsp:
        ws_fwd, _ = _tsp_comm_workspace(
            shape,
            s.tp,
            o.tsp_kv_grad_fp32,
            saved_attention=not o.tsp_recompute_attn,
            cp=s.cp,
            kv_flavour=s.kv_flavour,
        )
        tables = _tsp_step_tables(shape, s, m.rope)
        logits += ws_fwd + tables
        backward_extra = (
            _tsp_backward_peak(shape, s, o, m.num_layers, recompute, m.rope)
            + tables
            # Megatron's global memory buffer keeps the output layer's all-gathered input
            # [tokens, b, h] (sequence-parallel GEMM) through the backward; the vocabulary
            # ring gathers nothing
            + (0.0 if vocab_ring else head_tokens * m.hidden * b)
        )
    if s.kind == "fsdp_cp":
        return _fsdp_cp_peak(m, shape, s, o, local_params, vpad, recompute, activations, logits)
    forward_peak = logits >= backward_extra
    out = {
        "params": local_params * b,
        "grads": local_params * 4,
        "optimizer": local_params * 12 / opt_div,
        "activations": activations,
        "transient": 0.0 if forward_peak else backward_extra,
        "logits": logits if forward_peak else 0.0,
    }
    if s.kind == "gtp":
        out["gathered_weights"] = held  # resident through forward and backward
    return out


def _fsdp_cp_peak(
    m: ModelShape,
    shape: LayerShape,
    s: Strategy,
    o: Options,
    local_params: float,
    vpad: int,
    recompute: str,
    activations: float,
    logits: float,
) -> Dict[str, float]:
    """FSDP x CP (``fsdp_cp``): ZeRO-3 over the N = D*C sequence group as torch FSDP2 runs it
    (``fully_shard`` per layer and root, ``reshard_after_forward=True``, bf16 param / reduce
    policy), checked against ``megatron-tsp memory --scheme fsdp_cp``
    (``tests/estimator/test_memory_fsdp_cp.py``).

    Static: the 1/N shards in fp32 (FSDP2 keeps the sharded parameters in their dtype: they are
    the master weights) and Adam's m, v; no gradient between steps (the shards' ``.grad`` are
    set by each unit's reduce-scatter in backward and freed after the step). Megatron-FSDP's
    default (``optim_grads_params``, ``preserve_fp32_weights``, bf16 reduce) keeps a bf16 weight
    shard and a bf16 gradient shard besides: 4 B per local parameter more.

    Forward peak (the output layer): every layer's saved tensors, the output layer's logits and
    the root unit's gathered weights (embedding, output layer, final norm; the layers resharded
    after their forward). Backward peak, the larger of the first layer's (the last one's) two
    phases, with the root's gathered weights and its unsharded output-layer weight gradient
    (reduce-scattered with the embedding's at the end of backward), the layer's weights and the
    next one's (implicit backward prefetch) whole in the model dtype and the layer's unsharded
    weight gradient: its MLP (the MLP intermediates' gradients on top of every layer's saved
    tensors) and its attention (the layer's MLP tensors freed; the CP stand-in's K/V gathered
    over the whole sequence, the kernel's dK/dV outputs for the largest chunk and the dK/dV
    accumulator [S, b, 2 h_kv] in the accumulation dtype, then reduce-scattered; TE's P2P ring,
    ``fsdp_cp_ring`` (the tool's ``--cp-comm-type p2p``), holds K/V and dK/dV blocks of S/N
    tokens instead, and saves one K/V block rather than k and v). With full recompute the
    recomputed layer's saved tensors come on top of the stored inputs."""
    b = shape.dtype_bytes
    acc = fm.accumulation_bytes(b)
    g = o.fsdp_grad_reduce_bytes or b
    dense = moe.dense_layer(shape)
    W = dense.layer_params
    root = vpad * m.hidden * (1 if m.tied_embeddings else 2) + m.final_norm_params()
    saved = _layer_activation_bytes(shape, s, o, m.rope)
    layer_act = sum(saved.values())
    mlp_saved = saved["mlp_mid"]
    t = shape.tokens / s.cp
    kv_full = 2 * shape.tokens * shape.kv_hidden
    mlp_phase = t * (shape.fc1_rows + shape.ffn_hidden) * b  # mlp_mid_grads
    backward_weights = root * b + vpad * m.hidden * g + 2 * W * b + W * g
    if s.kv_flavour == "ring":
        # TE's P2P ring (megatron-tsp memory --cp-comm-type p2p, KVRingAttention), at its last
        # step (the diagonal block, the largest: t queries x t keys): the two [K/V, dK/dV]
        # buffers TE allocates, four blocks [S/N, b, 2 h_kv] in the model dtype (dK/dV are
        # summed in the buffer that travels: no fp32 accumulator), the kernel's dK/dV of the
        # step (one block more); the incoming output gradient, dq and the kernel's dq of the
        # step, [t, h] each. The layer's weight gradient is whole but for the QKV GEMM's, which
        # its backward writes after the ring.
        attn_phase = 5 * kv_full / s.cp * b + 3 * t * m.hidden * b - mlp_saved - dense.w_qkv * g
        # the MLP's backward runs before attention's: the attention weights' gradients are not
        # written yet (with the all-gather the attention phase is the larger one anyway)
        mlp_phase -= (dense.w_qkv + dense.w_proj) * g
    else:
        attn_phase = (
            # the gathered K/V, the dK/dV accumulator, the kernel's dK/dV of the largest chunk
            kv_full * (b + acc)
            + _kernel_dkv_bytes(shape, 1, o.attn_kernel)
            # the incoming output gradient [t, h], and for the largest chunk (t/2 tokens) the
            # kernel's dq in the accumulation dtype and its contiguous q / out / dout copies
            + t * m.hidden * (b + acc / 2 + 3 * b / 2)
            - mlp_saved
        )
    # full recompute: the recomputed layer's saved tensors (its input is one of the stored
    # inputs, and the checkpoint holds the recomputed output's gradient as many bytes again)
    extra = layer_act if recompute == "full" else 0.0
    backward = activations + extra + max(mlp_phase, attn_phase) + backward_weights
    forward = activations + logits + root * b
    forward_peak = forward >= backward
    return {
        "params": local_params * acc,
        "grads": 0.0,
        "optimizer": local_params * 2 * acc,
        "activations": activations,
        "transient": 0.0 if forward_peak else backward - activations,
        "logits": forward - activations if forward_peak else 0.0,
    }
