"""Checks run inside every rank for the hybrid: Megatron's TP+SP attention + TSP's MLP ring
(``get_gpt_block_tsp_mlp_spec``, Megatron-LM ``--tsp-mlp``).

References are stock megatron-core: the TP=1 local spec (``reference_single_layer_spec``) and,
for the fp64 parity with TP=D+SP, ``reference_tp_sp_block_spec`` (stock local spec, norms from
their formula), not the package's own TP+SP spec, whose norm the hybrid shares. The bf16
comparison runs the package's TP+SP spec as the *baseline* (same norm implementation on both
sides, so only the MLP's arithmetic differs), against the stock fp64 reference."""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_block import TransformerBlock

from megatron_tsp.core import sharding
from megatron_tsp.core.specs import get_gpt_block_local_sp_spec, get_gpt_block_tsp_mlp_spec
from megatron_tsp.tools.comm_counter import CommCounter, label_modules
from megatron_tsp.tools.estimator import formulas as fm
from tests.checks_comm import _Trace
from tests.checks_gpt import (
    _batch,
    _config,
    _model,
    _norms_to,
    _step,
    _tp_group_info,
    reference_run,
)
from tests.common import (
    DTYPES,
    FUSIONS_OFF,
    MEGATRON_LM_FUSION_DEFAULTS,
    make_config,
    reference_single_layer_spec,
    reference_tp_sp_block_spec,
    rel_err,
    setup_megatron_tp,
)

# the bf16 runs: the hybrid and the package's TP+SP baseline (same norm class as the hybrid)
SPECS = {"hybrid": get_gpt_block_tsp_mlp_spec, "tp_sp": get_gpt_block_local_sp_spec}


def _hybrid_config(d, dtype, style, fusion, layers=2, hidden=32, heads=8, ffn=64):
    # make_config now defaults to Megatron-LM's fusions: ``fusion=False`` must switch them off
    # explicitly, or the unfused and fused variants of these tests would be the same test.
    config = _config(d, dtype, style, layers, hidden, heads, ffn)
    for key, value in (MEGATRON_LM_FUSION_DEFAULTS if fusion else FUSIONS_OFF).items():
        setattr(config, key, value)
    return config


@torch.no_grad()
def _copy_params(model, full_params):
    for name, param in model.named_parameters():
        param.copy_(full_params[name])


def _run(kind, d, seed, style, dtype, fusion, full_params, data, loss_path="exact"):
    """One step of ``kind`` (hybrid or tp_sp) on TP=d ranks from a full parameter dict: loss and
    the full (gathered, SP-reduced) gradients."""
    setup_megatron_tp(d, seed)
    group, _, _ = _tp_group_info()
    config = _hybrid_config(d, dtype, style, fusion)
    model = _model(
        config, SPECS[kind](config), style, 128, 32, parallel_output=loss_path == "megatron"
    )
    if dtype == torch.bfloat16:  # like Megatron-LM's Float16Module (position embedding is fp32)
        model.bfloat16()
    sharding.load_full_state(model, {k: v.to(dtype) for k, v in full_params.items()}, group)
    loss = _step(model, data, loss_path)
    sharding.allreduce_sequence_parallel_grads(model, group)
    return loss, sharding.gather_full_state(model, group, grads=True), model


def check_hybrid_vs_single(d, seed, style, dtype_name="float64", fusion=False):
    """Hybrid GPTModel on TP=d ranks (full batch on every rank, Megatron's SP scatter) vs the
    single-process stock GPTModel: relative loss error and every full gradient's error."""
    dtype = DTYPES[dtype_name]
    ref_loss, ref_params, ref_grads, data = reference_run(
        style, seed, dtype, 2, 32, 8, 64, 128, 2, 32, "exact"
    )
    # The reference uses the same fusion setting (fused tanh-GeLU or the exact one): rebuilt
    # from stock megatron-core (Megatron's TP=1 local spec and norms) with that config.
    setup_megatron_tp(1, seed)
    config = _hybrid_config(1, dtype, style, fusion)
    model = _norms_to(
        _model(config, reference_single_layer_spec(config), style, 128, 32, False), dtype
    )
    _copy_params(model, ref_params)
    ref_loss = _step(model, data, "exact")
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss, grads, _ = _run("hybrid", d, seed, style, dtype, fusion, ref_params, data)
    missing = set(ref_grads) ^ set(grads)
    if missing:
        raise AssertionError(f"parameter names differ from the stock model: {sorted(missing)}")
    errors = {"loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())}
    for name, g in ref_grads.items():
        errors[f"grad:{name}"] = rel_err(grads[name], g)
    return errors


def check_hybrid_vs_tp_sp(d, seed, style, dtype_name="float64", fusion=False, loss_path="exact"):
    """Megatron TP=d+SP and the hybrid on the same ranks: the TP+SP model's ``state_dict``
    (Megatron-initialised) loads into the hybrid with ``strict=True``; same batch, same loss and
    gradient shards. Both initialise identically from the same seed, and the hybrid's state dict
    loads back into a fresh TP+SP model."""
    dtype = DTYPES[dtype_name]
    data = _batch(seed, 2, 32, 128)
    po = loss_path == "megatron"
    setup_megatron_tp(d, seed)
    group, _, _ = _tp_group_info()
    config = _hybrid_config(d, dtype, style, fusion)
    tp_model = _model(config, reference_tp_sp_block_spec(config), style, 128, 32, po)
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in tp_model.state_dict().items()}
    tp_loss = _step(tp_model, data, loss_path)
    sharding.allreduce_sequence_parallel_grads(tp_model, group)
    tp_grads = {n: p.grad.clone() for n, p in tp_model.named_parameters()}

    setup_megatron_tp(d, seed)
    hybrid = _model(config, get_gpt_block_tsp_mlp_spec(config), style, 128, 32, po)
    hybrid.load_state_dict(state, strict=True)
    loss = _step(hybrid, data, loss_path)
    sharding.allreduce_sequence_parallel_grads(hybrid, group)
    out = {"loss": abs(loss.item() - tp_loss.item()) / abs(tp_loss.item())}
    for name, param in hybrid.named_parameters():
        out[f"grad:{name}"] = rel_err(param.grad, tp_grads[name])

    init_seed = seed + 11
    setup_megatron_tp(d, init_seed)
    hybrid_init = _model(config, get_gpt_block_tsp_mlp_spec(config), style, 128, 32, po)
    setup_megatron_tp(d, init_seed)
    tp_init = _model(config, reference_tp_sp_block_spec(config), style, 128, 32, po)
    for (n1, p1), (n2, p2) in zip(hybrid_init.named_parameters(), tp_init.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), f"{n1}: hybrid init differs from TP=D init"
        for attr in (
            "tensor_model_parallel",
            "partition_dim",
            "partition_stride",
            "sequence_parallel",
        ):
            assert getattr(p1, attr, None) == getattr(p2, attr, None), (n1, attr)
    fresh = _model(config, reference_tp_sp_block_spec(config), style, 128, 32, po)
    fresh.load_state_dict(hybrid_init.state_dict(), strict=True)
    for (n1, p1), (_, p2) in zip(fresh.named_parameters(), hybrid_init.named_parameters()):
        assert torch.equal(p1, p2), n1
    return out


def check_bf16_accuracy(d, seed, style):
    """bf16 hybrid and bf16 TP=d+SP from the same weights, both against the fp64 single-process
    model: relative loss error and the median / max over parameters of the gradient errors."""
    ref_loss, ref_params, ref_grads, data = reference_run(
        style, seed, torch.float64, 2, 32, 8, 64, 128, 2, 32, "megatron"
    )
    # both runs start from the bf16-rounded weights; the reference from the same rounded values
    rounded = {k: v.to(torch.bfloat16).to(torch.float64) for k, v in ref_params.items()}
    setup_megatron_tp(1, seed)
    config = _hybrid_config(1, torch.float64, style, False)
    model = _norms_to(
        _model(config, reference_single_layer_spec(config), style, 128, 32, True), torch.float64
    )
    _copy_params(model, rounded)
    ref_loss = _step(model, data, "megatron")
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    out = {}
    for kind in ("tp_sp", "hybrid"):
        loss, grads, _ = _run(
            kind, d, seed, style, torch.bfloat16, False, rounded, data, loss_path="megatron"
        )
        errs = [rel_err(grads[n].double(), g) for n, g in ref_grads.items()]
        out[kind] = {
            "loss": abs(loss.double().item() - ref_loss.item()) / abs(ref_loss.item()),
            "grad_median": statistics.median(errs),
            "grad_max": max(errs),
        }
    return out


# ---------------------------------------------------------------------------------------------
# communication of one hybrid layer
# ---------------------------------------------------------------------------------------------
def _hybrid_block(d, dtype, gated, bias, hidden, heads, groups, ffn, layers=1):
    config = make_config(
        d,
        dtype,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=ffn,
        gated_linear_unit=gated,
        add_bias_linear=bias,
        activation_func=F.silu if gated else F.gelu,
    )
    return config, TransformerBlock(config, get_gpt_block_tsp_mlp_spec(config))


def measure_hybrid_layer(
    d,
    seq=32,
    batch=2,
    hidden=32,
    heads=8,
    groups=4,
    ffn=64,
    gated=False,
    bias=True,
    dtype_name="float32",
):
    """One hybrid TransformerLayer (plus the block's final norm) forward + backward on
    [s/d, b, h] local tokens under a CommCounter, collectives labelled by module: per phase and
    module the ops and received bytes, and the formula's bytes for the same shape."""
    dtype = DTYPES[dtype_name]
    setup_megatron_tp(d)
    _, block = _hybrid_block(d, dtype, gated, bias, hidden, heads, groups, ffn)
    label_modules(block, {SelfAttention: "attn", MLP: "mlp"})
    x = torch.randn(seq // d, batch, hidden, dtype=dtype, requires_grad=True)
    with CommCounter() as counter:
        out = block(x, attention_mask=None)
        out.backward(torch.randn_like(out))
    counted = {}
    for module in ("attn", "mlp"):
        for phase in ("fwd", "bwd"):
            counted[f"{module}_{phase}"] = {
                "ops": sorted(set(counter.ops(phase=phase, scope=module))),
                "recv": counter.recv_bytes(phase=phase, scope=module),
            }
    counted["unlabelled"] = [
        r.op for r in counter.records if not r.scope.startswith(("attn", "mlp"))
    ]
    shape = fm.LayerShape(
        batch=batch,
        seq=seq,
        hidden=hidden,
        heads=heads,
        query_groups=groups,
        ffn=ffn,
        gated=gated,
        bias=bias,
        dtype_bytes=torch.empty((), dtype=dtype).element_size(),
    )
    formula = fm.hybrid_layer_comm(shape, d)
    return {"counted": counted, "formula": formula}


def trace_hybrid_mlp(d, seq=32, batch=2, hidden=32):
    """Event order (collectives and matmuls) inside the hybrid layer's MLP, forward and
    backward, with the attention's events left out."""
    setup_megatron_tp(d)
    _, block = _hybrid_block(d, torch.float32, False, False, hidden, 4, 4, 2 * hidden)
    mlp = block.layers[0].mlp
    trace = _Trace()
    x = torch.randn(seq // d, batch, hidden, requires_grad=True)
    with CommCounter(on_record=lambda r: trace.events.append(r.op)):
        with trace:
            out, _ = mlp(x)
        fwd = list(trace.events)
        trace.events.clear()
        with trace:
            out.backward(torch.randn_like(out))
        bwd = list(trace.events)
    return {"fwd": fwd, "bwd": bwd}
