"""TSP MLP: the (fc1, fc2) weight shards circulate on a ring, tokens stay where they are.

Rank p holds tokens X_p ([s/D, b, h]) and the TP=D shard p of fc1 (rows; for gated units the
``[gate_p; up_p]`` block) and fc2 (columns). Forward, for t = 0..D-1, with j = (p - t) mod D:

    post send(shard_j -> p+1), recv(shard_{j-1} <- p-1)      # before computing: prefetch
    H_p[:, j] = X_p @ fc1_j^T + b1_j;  W2[:, j] = fc2_j        # one shard's fc1 block
    wait
then, once: Y_p = act(H_p) @ W2^T                             # the whole FFN width

No all-reduce: each rank owns different tokens and contracts the whole FFN width locally, in one
GEMM (its output rounded once, each shard's activation read once). The fc1 output H_p
[s/D, b, D, ffn/D] (shard order) is the bytes of TP+SP's fc1 output and is what the backward
keeps; the activation and the gathered fc2 weight [h, ffn] are transient (TP+SP's activation is
[S, b, ffn/D], the same size). Each weight hop hides behind the current shard's fc1 GEMM.
Backward runs the ring again from the kept fc1 output (no extra FLOPs), and a gradient
accumulator rides the ring behind the weights: rank p+t adds its contribution to shard p's
weight gradient at step t (its weight-gradient GEMMs accumulate onto the accumulator in the
buffer it arrived in), and the last hop lands on the owner, who holds the full gradient of
its shard exactly like a TP=D rank.

Recompute follows Megatron's flags, applied by Megatron itself: ``recompute_granularity=
"selective"`` with ``"mlp"`` in ``recompute_modules`` checkpoints this whole module in
``TransformerLayer`` (its forward, ring included, is re-run in backward), ``"full"`` checkpoints
whole layers. ``recompute_activation=True`` is TSP's own opt-in: keep only X_p and recompute each
shard's fc1 in backward (+2·T·P_fc1 FLOPs per layer, no fc1 outputs kept, no ring replay).

Precision: in bf16/fp16 the D ranks' partial weight gradients are summed in fp32
(``accumulation_dtype``), so the gradient accumulator rides the ring in fp32 and is cast once, when
handed to ``main_grad`` / autograd (three fp32 flat gradient shards, O(weights / D); its hops are 4
bytes/element instead of 2, ``formulas.tsp_layer_terms``). The output is one GEMM (fp32
accumulation inside, rounded once). The D ``grad_x`` contributions are accumulated in place by
the dgrad GEMMs in the compute dtype, one rounding of the running sum per shard
(``precision.activation_sum_dtype``; ``activation_sums_in_fp32``: an [s/D, b, h] fp32
accumulator instead).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.mlp import MLP

from megatron_tsp.core import rejections
from megatron_tsp.core.comm import FlatShard, labelled, weight_bias_views
from megatron_tsp.core.layers import activation_kernel, kv_prefetch, weight_ring
from megatron_tsp.core.layers.grads import weight_grad_output
from megatron_tsp.core.layers.module_hooks import run_forward_pre_hooks
from megatron_tsp.core.layers.precision import (
    activation_sum_dtype,
    matmul_acc,
    matmul_onto,
    ring_grad_dtype,
    sum_rows_onto,
)
from megatron_tsp.core.parallel_state import resolve_group

# Payload names of the ring's transfers (``comm.Pending.payload``, read by the trace tests).
WEIGHTS = "mlp.weights"
WEIGHT_GRADS = "mlp.weight_grads"


@dataclass(frozen=True)
class MLPActivation:
    """The activation of Megatron's ``MLP`` for a config, as a function of an fc1 output (its
    bias already added). ``kernel_kind``: the ``activation_kernel`` formula that is exactly this
    function ("gelu_tanh": Megatron's fused GeLU; "gelu": the exact GeLU; "swiglu": the fused
    SwiGLU or the unfused gated SiLU without clamp or offset), None where the kernel has none
    (GeGLU, other functions): the TSP MLP's backward then runs it under autograd."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    kernel_kind: Optional[str] = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def make_activation(config) -> MLPActivation:
    """The activation Megatron's ``MLP.forward`` applies for ``config``, as a function of one
    shard's fc1 output (the fc1 bias already added).

    Mirrors megatron-core's ``MLP`` (0.16 and 0.19 agree), so TSP equals TP=D+SP under the same
    flags:

    * ``bias_activation_fusion`` (Megatron-LM's default): ``F.gelu`` runs as Megatron's fused
      tanh-approximate GeLU (``bias_gelu_impl``; GeGLU ``bias_geglu_impl`` when gated) and gated
      ``F.silu`` as the fused SwiGLU (``bias_swiglu_impl``). Megatron's MLP has no fused form of
      any other activation; it fails at its first forward, TSP refuses at construction.
    * otherwise the exact ``activation_func`` (gated: Megatron's GLU with its clamp and offset).

    Megatron's fused kernels take the bias separately and add it first; here it is already in the
    input, so the fused GeLU gets a zero bias (``0 + x`` is exact) and the gated ones none. Like
    Megatron's, the fused GeGLU / SwiGLU ignore ``activation_func_clamp_value`` and
    ``glu_linear_offset`` (TransformerConfig refuses a non-zero offset with fusion).
    """
    act = config.activation_func
    if getattr(config, "use_te_activation_func", False):
        raise ValueError(
            "use_te_activation_func=True (--use-te-activation-func): TSP applies the MLP "
            "activation itself per weight shard and cannot use Transformer Engine's activation "
            f"module; drop the flag (activation_func={_name(act)} is then applied directly)"
        )
    if config.bias_activation_fusion:
        return _fused_activation(config, act)
    import torch.nn.functional as F

    if not config.gated_linear_unit:
        return MLPActivation(act, "gelu" if act is F.gelu else None)
    clamp = getattr(config, "activation_func_clamp_value", None)
    offset = getattr(config, "glu_linear_offset", 0.0) or 0.0

    def glu(x: torch.Tensor) -> torch.Tensor:
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)
        if clamp is not None:
            x_glu = x_glu.clamp(min=None, max=clamp)
            x_linear = x_linear.clamp(min=-clamp, max=clamp)
        return act(x_glu) * (x_linear + offset)

    plain_swiglu = act is F.silu and clamp is None and offset == 0.0
    return MLPActivation(glu, "swiglu" if plain_swiglu else None)


def _name(fn) -> str:
    module = getattr(fn, "__module__", None) or ""
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}".lstrip(".")


def _fused_activation(config, act) -> MLPActivation:
    """Megatron's fused bias-activation kernel for ``act`` (``MLP.forward``'s fused branch)."""
    import torch.nn.functional as F

    if act is F.gelu:
        if config.gated_linear_unit:
            from megatron.core.fusions.fused_bias_geglu import bias_geglu_impl

            return MLPActivation(lambda x: bias_geglu_impl(x, None))
        from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl

        def fused_gelu(x: torch.Tensor) -> torch.Tensor:
            return bias_gelu_impl(x, x.new_zeros(()))

        return MLPActivation(fused_gelu, "gelu_tanh")
    if act is F.silu and config.gated_linear_unit:
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

        fp8_store = bool(getattr(config, "activation_func_fp8_input_store", False))
        if fp8_store and config.add_bias_linear:
            raise ValueError(
                "activation_func_fp8_input_store=True with add_bias_linear=True: Megatron's fused "
                "SwiGLU stores the fc1 output rounded to float8 *before* adding the fc1 bias and "
                "differentiates at that rounded value plus the bias; the TSP MLP adds the bias in "
                "its fc1 GEMM, so the rounding would differ. Use it without linear biases "
                "(add_bias_linear=False, --disable-bias-linear)"
            )
        # The last argument only tags the saved input for Transformer Engine's activation
        # offloading (Megatron passes it with TE CPU offloading); it changes no value.
        # With the FP8 input store Megatron's backward reads the input rounded to float8_e4m3fn:
        # no kernel kind, so the backward runs Megatron's own function (the activation kernel
        # would differentiate at the unrounded input).
        return MLPActivation(
            lambda x: bias_swiglu_impl(x, None, fp8_store, False), None if fp8_store else "swiglu"
        )
    raise ValueError(
        f"activation_func={_name(act)} with gated_linear_unit={config.gated_linear_unit} has no "
        "fused bias-activation kernel in Megatron's MLP (it fuses only GeLU, GeGLU and SwiGLU): "
        "set bias_activation_fusion=False (--no-bias-gelu-fusion / --no-bias-swiglu-fusion) to "
        "use it under TSP"
    )


def _fc1(x, fc1_w, fc1_b):
    pre = torch.matmul(x, fc1_w.t())
    return pre + fc1_b if fc1_b is not None else pre


def _fc1_into(rows, fc1_w, fc1_b, out):
    """``out = rows @ fc1_w^T (+ fc1_b)``, written in place (``out``: a shard's column block of
    the fc1 output, row-strided, which a GEMM writes directly)."""
    if fc1_b is None:
        return torch.mm(rows, fc1_w.t(), out=out)
    return torch.addmm(fc1_b, rows, fc1_w.t(), out=out)


def activation_backward(
    activation: MLPActivation,
    pre: torch.Tensor,
    d_hidden: torch.Tensor,
    lead_shape,
    d_pre_out: Optional[torch.Tensor] = None,
):
    """One shard's activation recomputed from its fc1 output ``pre`` [tokens, fc1 rows] and its
    backward for ``d_hidden`` [tokens, ffn rows]; returns ``(activation output [tokens, ffn
    rows], d(pre))``, d(pre) written into ``d_pre_out`` (a strided slot) when given. On CUDA,
    where the kernel has the activation's formula: one launch of ``activation_kernel``;
    otherwise Megatron's own functions under autograd (on ``lead_shape`` + [fc1 rows] views, as
    Megatron's MLP applies them), the gradient copied into ``d_pre_out``."""
    if activation.kernel_kind is not None and activation_kernel.available(pre.device, pre.dtype):
        hidden = torch.empty(d_hidden.shape, dtype=d_hidden.dtype, device=d_hidden.device)
        if d_pre_out is None:
            d_pre_out = torch.empty(pre.shape, dtype=pre.dtype, device=pre.device)
        activation_kernel.act_backward_into(
            activation.kernel_kind, pre, d_hidden, hidden, d_pre_out
        )
        return hidden, d_pre_out
    rows_shape = pre.shape
    with torch.enable_grad():
        pre = pre.detach().view(*lead_shape, rows_shape[-1]).requires_grad_(True)
        hidden = activation(pre)
        d_out = d_hidden.view(*lead_shape, d_hidden.shape[-1])
        (d_pre,) = torch.autograd.grad(hidden, [pre], d_out)
    d_pre = d_pre.reshape(rows_shape)
    if d_pre_out is not None:
        d_pre = d_pre_out.copy_(d_pre)
    return hidden.detach().reshape(d_hidden.shape), d_pre


class _TSPMLPFunction(torch.autograd.Function):
    """Forward: D-1 ring steps (isend to rank+1 / irecv from rank-1) of the flat (fc1 w, fc1 b,
    fc2 w) shard, each posted before the current shard's GEMMs. Backward: the same D-1 weight
    steps, each posted after the dX GEMMs, plus D-1 steps of the (fp32 in bf16 runs) gradient
    accumulator one hop behind, each posted after the weight-gradient GEMMs that accumulate onto
    it in place (queue order: ``weight_ring``, shared with the TSP expert ring and the vocabulary
    ring); its own traffic has no collectives. Behind its one dgrad GEMM the backward posts the
    first K/V re-gather (an all-gather over the sequence group) of the TSP attention that ran
    before it in the forward, for that attention's backward (``kv_prefetch``).

    Forward compute: each shard's fc1 GEMM writes its block of one fc1 output [tokens, D, fc1
    rows per shard] (shard order), the fc2 shard is copied into its columns of the fc2 weight;
    after the ring, one activation over every shard and one fc2 GEMM over the whole FFN width:
    the output is rounded once (no per-shard running sum) and the GEMM reads each shard's
    activation once. The fc1 output is what the backward keeps (``save_for_backward``)."""

    @staticmethod
    def forward(
        ctx,
        x,
        fc1_w,
        fc1_b,
        fc2_w,
        group,
        activation,
        accumulate_into_main_grad,
        recompute_activation,
        sums_in_fp32,
        kv_handoff,
    ):
        params = [fc1_w] + ([fc1_b] if fc1_b is not None else []) + [fc2_w]
        has_bias = fc1_b is not None
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = x.reshape(-1, x.shape[-1])
        pre = torch.empty(
            (rows.shape[0], size, fc1_w.shape[0]), dtype=x.dtype, device=x.device
        )  # every shard's fc1 output, shard j in pre[:, j]
        width = fc2_w.shape[1]
        fc2_full = torch.empty((fc2_w.shape[0], size, width), dtype=fc2_w.dtype, device=x.device)
        with labelled("tsp_mlp"):
            for t, views in weight_ring.shards(params, group, WEIGHTS):
                j = (rank - t) % size
                w1, b1, w2 = weight_bias_views(views, has_bias)
                _fc1_into(rows, w1, b1, pre[:, j])
                fc2_full[:, j].copy_(w2)
            hidden = activation(pre)  # [tokens, D, width]: each shard's activation
            out = torch.matmul(
                hidden.reshape(rows.shape[0], -1), fc2_full.view(-1, size * width).t()
            )
        out = out.view(*x.shape[:-1], out.shape[-1])
        # Everything the backward reads goes through save_for_backward (the fc1 output too),
        # so saved-tensor hooks (activation offloading) see and can move all of it.
        saved_pre = [] if recompute_activation else [pre]
        ctx.save_for_backward(x, fc1_w, fc1_b, fc2_w, *saved_pre)
        ctx.group, ctx.activation = group, activation
        ctx.accumulate_into_main_grad = accumulate_into_main_grad
        ctx.sums_in_fp32 = sums_in_fp32
        ctx.kv_handoff = kv_handoff
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, fc1_w, fc1_b, fc2_w, *saved_pre = ctx.saved_tensors
        group, activation = ctx.group, ctx.activation
        has_bias = fc1_b is not None
        params = [fc1_w] + ([fc1_b] if has_bias else []) + [fc2_w]
        grad_out = grad_out.contiguous()

        acc_dtype = activation_sum_dtype(x.dtype, ctx.sums_in_fp32)
        grad_dtype = ring_grad_dtype(params, ctx.accumulate_into_main_grad)
        tokens_x = x.reshape(-1, x.shape[-1])
        tokens_dy = grad_out.reshape(-1, grad_out.shape[-1])

        size, rank = dist.get_world_size(group), dist.get_rank(group)
        fc1_rows = fc1_w.shape[0]
        # the one dgrad GEMM's operands, filled shard by shard in shard order: every shard's
        # d(fc1 output) side by side and every shard's fc1 weight
        d_pre_all = x.new_empty((tokens_x.shape[0], size, fc1_rows))
        fc1_all = fc1_w.new_empty((size * fc1_rows, fc1_w.shape[1]))

        def input_grads(views, step):
            """This shard's activation backward, its d(fc1 output) written into its columns of
            ``d_pre_all`` and its fc1 weight into its rows of ``fc1_all``. Returns ``(d_pre
            rows, hidden rows)``; needs no gradient accumulator, so it runs while the previous
            hop is in flight."""
            j = (rank - step) % size
            w1, b1, w2 = weight_bias_views(views, has_bias)
            fc1_all.narrow(0, j * fc1_rows, fc1_rows).copy_(w1)
            if saved_pre:  # shard j's block, [tokens, fc1 rows]
                pre = saved_pre[0][:, j]
            else:
                pre = _fc1(x, w1, b1).view(tokens_x.shape[0], -1)
            d_hidden = torch.matmul(tokens_dy, w2)
            d_rows = d_pre_all[:, j]
            hidden, _ = activation_backward(activation, pre, d_hidden, x.shape[:-1], d_rows)
            return d_rows, hidden

        def weight_grads(kept, out: FlatShard, accumulate: bool) -> None:
            """This rank's tokens' partial weight gradients of the shard, in ``out``'s dtype
            (fp32 in bf16 runs): written, or added in place by the GEMMs (``accumulate``)."""
            d_rows, hidden = kept
            g_w1, g_b1, g_w2 = weight_bias_views(out.views(), has_bias)
            matmul_onto(d_rows.t(), tokens_x, g_w1, accumulate)
            if has_bias:
                sum_rows_onto(d_rows, g_b1, accumulate)
            matmul_onto(tokens_dy.t(), hidden, g_w2, accumulate)

        grad_x = None
        handoff = ctx.kv_handoff

        def input_grad() -> None:
            """The input gradient: one GEMM over the whole FFN width (rounded once), issued
            while the ring's last hop is in flight; then the post of this layer's attention's
            first K/V re-gather (``kv_prefetch``), which the GEMM's remaining time covers."""
            nonlocal grad_x
            grad_x = matmul_acc(d_pre_all.view(tokens_x.shape[0], -1), fc1_all, dtype=acc_dtype)
            if handoff is not None:
                handoff.post()

        with labelled("tsp_mlp"):  # the schedule and its queue order: ``weight_ring``
            own = weight_ring.backward(
                params,
                group,
                grad_dtype,
                input_grads,
                weight_grads,
                (WEIGHTS, WEIGHT_GRADS),
                cover_drain=input_grad,
            )
        g_w1, g_b1, g_w2 = weight_bias_views(own.views(), has_bias)
        accumulate = ctx.accumulate_into_main_grad
        return (
            grad_x.to(x.dtype).view(x.shape),
            weight_grad_output(fc1_w, g_w1, accumulate),
            weight_grad_output(fc1_b, g_b1, accumulate),
            weight_grad_output(fc2_w, g_w2, accumulate),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def tsp_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: Optional[torch.Tensor],
    fc2_weight: torch.Tensor,
    group,
    activation: MLPActivation,
    accumulate_into_main_grad: bool = False,
    recompute_activation: bool = False,
    activation_sums_in_fp32: bool = False,
) -> torch.Tensor:
    """``sum_j act(x @ fc1_j^T + b1_j) @ fc2_j^T`` over the D shards of the group, on a ring.

    ``recompute_activation``: keep the per-shard fc1 outputs from the forward (False, the
    default: no extra GEMM, TP+SP-sized memory), or recompute each shard's fc1 output in backward
    (True, an explicit opt-in: saves only x). Without grad mode (inference, prefill) no backward
    will read them, so none are kept whatever ``recompute_activation`` says.
    ``activation_sums_in_fp32``: the ``grad_x`` sum over the shards in fp32 instead of the
    compute dtype (``precision.activation_sum_dtype``; the output is one GEMM either way).
    ``activation``: ``make_activation(config)``, or ``MLPActivation(fn)`` for any function of the
    fc1 output (its backward then runs under autograd).

    Takes the preceding TSP attention's ``kv_prefetch.Handoff`` (every call empties the slot):
    the backward posts that attention's first K/V re-gather behind its one dgrad GEMM."""
    kv_handoff = kv_prefetch.take(group)
    return _TSPMLPFunction.apply(
        x,
        fc1_weight,
        fc1_bias,
        fc2_weight,
        group,
        activation,
        accumulate_into_main_grad,
        recompute_activation or not torch.is_grad_enabled(),
        activation_sums_in_fp32,
        kv_handoff,
    )


_MLP_INIT_PARAMS = set(inspect.signature(MLP.__init__).parameters)


class TSPMLP(MLP):
    """Drop-in for Megatron's ``MLP`` under TSP.

    Parameters are Megatron's own Column/RowParallelLinear (built by ``MLP.__init__`` for TP=D), so
    names, shapes, slices, initialisation, ``tensor_model_parallel`` attributes and
    ``sharded_state_dict`` are exactly those of a TP=D + SP run; only ``forward`` differs.
    Returns ``(output, fc2_bias)`` like ``MLP`` (the replicated fc2 bias is added by the caller's
    bias-dropout-add).

    ``recompute_activation`` (default False): TSP's opt-in fc1 recompute (module docstring);
    Megatron's own recompute flags need nothing from this class.
    """

    def __init__(
        self,
        config,
        submodules,
        is_expert: bool = False,
        input_size=None,
        ffn_hidden_size=None,
        tp_group=None,
        pg_collection=None,
        recompute_activation: bool = False,
        **kwargs,
    ):
        if is_expert:
            raise rejections.TSPRejection(
                "TSPMLP built as an expert (is_expert=True): it is the dense MLP; MoE layers "
                "under TSP are megatron-core's MoELayer (get_gpt_layer_tsp_spec(num_experts=...))"
            )
        group = resolve_group(pg_collection, tp_group)
        if ffn_hidden_size is None:
            ffn_hidden_size = config.ffn_hidden_size
        rejections.check_config(
            config,
            dist.get_world_size(group),
            layer="mlp",
            overrides={"ffn_hidden_size": ffn_hidden_size},
        )
        # Newer cores pass extra keywords (name, is_mtp_layer, ...): forward those MLP accepts.
        extra = {k: v for k, v in kwargs.items() if k in _MLP_INIT_PARAMS}
        super().__init__(
            config,
            submodules,
            is_expert=False,
            input_size=input_size,
            ffn_hidden_size=ffn_hidden_size,
            tp_group=group,
            **extra,
        )
        self.tsp_group = group
        self.tsp_activation = make_activation(config)
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.recompute_activation = recompute_activation
        # --tsp-activation-sums-in-fp32 (not a TransformerConfig field: set by the spec)
        self.activation_sums_in_fp32 = bool(getattr(config, "tsp_activation_sums_in_fp32", False))

    def forward(self, hidden_states, per_token_scale=None, padding_mask=None, **kwargs):
        if per_token_scale is not None:
            raise ValueError("TSP MLP does not support per_token_scale (MoE routing)")
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        # fc1 / fc2 are not called: fire their pre-hooks (DDP param-gather waits).
        run_forward_pre_hooks(fc1)
        run_forward_pre_hooks(fc2)
        out = tsp_mlp(
            hidden_states,
            fc1.weight,
            fc1.bias,
            fc2.weight,
            self.tsp_group,
            self.tsp_activation,
            self.gradient_accumulation_fusion,
            self.recompute_activation,
            self.activation_sums_in_fp32,
        )
        return out, fc2.bias
