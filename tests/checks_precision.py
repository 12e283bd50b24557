"""bf16 accuracy of TSP vs Megatron TP+SP, both against an fp64 single-process reference.

Run inside every rank of a gloo pool. One fp64 stock GPTModel (TP=1) defines the exact loss and
gradients; the weights it uses are first rounded to bf16 so that the two bf16 runs (Megatron
TP=D + SP and TSP-D, same ranks, same batch) start from exactly the reference's weights and differ
from it only by their own bf16 arithmetic.
"""

from __future__ import annotations

import math
import statistics

import torch

from megatron_tsp.core import output_head, sharding, zigzag
from megatron_tsp.core.specs import get_gpt_block_local_sp_spec, get_gpt_block_tsp_spec
from tests.checks_gpt import _batch, _config, _model, _tp_group_info
from tests.common import (
    group_info,
    natural_order,
    reference_single_layer_spec,
    setup_megatron_tp,
    setup_tsp,
    zigzag_rows,
)


def _norm_rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in fp64 (Frobenius)."""
    expected = expected.double()
    diff = (actual.double() - expected).norm().item()
    scale = expected.norm().item()
    return diff / (scale if scale > 0 else 1.0)


def _capture_activations(model):
    """Forward hooks on the embedding, every transformer layer and the final norm: each module's
    (local) output tensor, detached, by name."""
    captured = {}

    def hook(name):
        def record(_module, _inputs, output):
            captured[name] = (output[0] if isinstance(output, tuple) else output).detach()

        return record

    modules = {"embedding": model.embedding}
    modules.update({f"layer{i}": layer for i, layer in enumerate(model.decoder.layers)})
    modules["final_norm"] = model.decoder.final_layernorm
    for name, module in modules.items():
        module.register_forward_hook(hook(name))
    return captured


def _token_losses_and_step(model, batch):
    """Like ``checks_gpt._step`` (Megatron path) but also returns the per-token losses [b, s]."""
    losses = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    mask = batch["loss_mask"].to(losses.dtype)
    loss = (losses * mask).sum() / mask.sum()
    loss.backward()
    return loss.detach(), losses.detach()


def _run_bf16(kind, d, style, full_params, data, dims, vocab, seq):
    """One bf16 step of TSP-d (``kind`` "tsp"; "tsp_kv_fp32": with the dK/dV reduce-scatter in
    fp32; "tsp_cp2" / "tsp_cp2_kv_fp32": TSP-d x CP=2) or Megatron TP=d+SP from
    ``full_params``: loss, per-token losses (natural order), local activations by module, the
    local-slice function and full grads."""
    a2a = kind.endswith("_a2a")  # dK/dV summed by an all-to-all (--tsp-kv-grad-all-to-all)
    kind = kind.removesuffix("_a2a")
    # the loss on the vocabulary ring (core.output_head; the Megatron-LM launcher's default)
    vocab_ring = kind.endswith("_vocab_ring")
    kind = kind.removesuffix("_vocab_ring")
    # activation sums in fp32 (--tsp-activation-sums-in-fp32)
    sums_fp32 = kind.endswith("_sums_fp32")
    kind = kind.removesuffix("_sums_fp32")
    if kind.startswith("tsp_cp2"):
        kv_fp32 = kind == "tsp_cp2_kv_fp32"
        return _run_bf16_tsp_cp(
            d, 2, style, full_params, data, dims, vocab, seq, kv_fp32, a2a, sums_fp32
        )
    kv_fp32 = kind == "tsp_kv_fp32"
    kind = "tsp" if kv_fp32 else kind
    if kind == "tsp":
        setup_tsp(d)
        group, size, _ = group_info()
        spec_fn, local = get_gpt_block_tsp_spec, zigzag.get_batch_on_this_tsp_rank(data, d)
    else:
        setup_megatron_tp(d)
        group, size, _ = _tp_group_info()
        spec_fn, local = get_gpt_block_local_sp_spec, data
    config = _config(d, torch.bfloat16, style, **dims)
    if kv_fp32:  # read by TSPSelfAttention (Megatron-LM: --tsp-kv-grad-reduce-in-fp32)
        config.tsp_kv_grad_reduce_in_fp32 = True
    config.tsp_kv_grad_all_to_all = a2a
    config.tsp_activation_sums_in_fp32 = sums_fp32
    model = _model(config, spec_fn(config), style, vocab, seq, parallel_output=True)
    if vocab_ring:
        output_head.install(model, policy="always")
    model.to(torch.bfloat16)  # Megatron's Float16Module casts the whole model (position table)
    sharding.load_full_state(
        model, {n: t.to(torch.bfloat16) for n, t in full_params.items()}, group
    )
    acts = _capture_activations(model)
    loss, token_losses = _token_losses_and_step(model, local)
    sharding.allreduce_sequence_parallel_grads(model, group)
    rank = torch.distributed.get_rank(group)
    if kind == "tsp":
        token_losses = natural_order(token_losses, d, dim=1)
        local_slice = lambda t: zigzag_rows(t, d, rank)  # noqa: E731
    else:
        local_slice = lambda t: t.chunk(d, dim=0)[rank]  # noqa: E731
    return (
        loss.double(),
        token_losses,
        acts,
        local_slice,
        group,
        sharding.gather_full_state(model, group, grads=True),
    )


def _run_bf16_tsp_cp(
    d, c, style, full_params, data, dims, vocab, seq, kv_fp32=False, a2a=False, sums_fp32=False
):
    """``_run_bf16`` for TSP-d x CP-c on d*c ranks: Megatron's CP batch split then the TSP
    zigzag (one permutation over the d*c sequence ranks), the loss normalised by the whole
    batch's mask count and summed over CP, gradients summed over CP (DDP's DP x CP reduction)
    then over TSP for the replicated ones."""
    import dataclasses

    import torch.distributed as dist

    from tests.checks_tsp_cp import setup_tsp_cp

    g = setup_tsp_cp(d, c, 0)
    config = dataclasses.replace(_config(d, torch.bfloat16, style, **dims), context_parallel_size=c)
    config.tsp_kv_grad_reduce_in_fp32 = kv_fp32
    config.tsp_kv_grad_all_to_all = a2a
    config.tsp_activation_sums_in_fp32 = sums_fp32
    model = _model(config, get_gpt_block_tsp_spec(config), style, vocab, seq, parallel_output=True)
    model.to(torch.bfloat16)
    sharding.load_full_state(
        model, {n: t.to(torch.bfloat16) for n, t in full_params.items()}, g["tp"]
    )
    acts = _capture_activations(model)
    local = zigzag.get_batch_on_this_tsp_rank(
        data, d, context_parallel_size=c, cp_rank=g["cp_rank"]
    )
    losses = model(
        local["tokens"], local["position_ids"], local["attention_mask"], labels=local["labels"]
    )
    mask = local["loss_mask"].to(losses.dtype)
    part = (losses * mask).sum() / data["loss_mask"].sum()
    part.backward()
    loss = part.detach().double()
    dist.all_reduce(loss, group=g["cp"])
    # Megatron's DDP for bf16: each rank's gradient is added to an fp32 main_grad, summed over
    # DP x CP in fp32 and handed to the optimizer in fp32 (never rounded back to bf16). The
    # parameters become fp32 after the step only so that .grad can hold the fp32 sum.
    for p in model.parameters():
        if p.grad is not None:
            summed = p.grad.float()
            dist.all_reduce(summed, group=g["cp"])
            p.data, p.grad = p.data.float(), summed
    sharding.allreduce_sequence_parallel_grads(model, g["tp"])
    # this CP rank's TSP group returns its tokens in gathered order; CP ranks' slices follow
    # one another in the gathered order of the d*c sequence ranks
    pieces = [torch.empty_like(losses) for _ in range(c)]
    dist.all_gather(pieces, losses.detach().contiguous(), group=g["cp"])
    token_losses = natural_order(torch.cat(pieces, dim=1), d * c, dim=1)
    q = g["q"]
    return (
        loss,
        token_losses,
        acts,
        lambda t: zigzag_rows(t, d * c, q),
        g["seq"],
        sharding.gather_full_state(model, g["tp"], grads=True),
    )


def _planted_bf16_accumulation(where):
    """Context manager that makes TSP's partial sums in ``where`` ('mlp', 'attention' or '')
    accumulate in the compute dtype (bf16), i.e. the regression the precision tests must catch."""
    import contextlib

    from megatron_tsp.core.layers import attention, mlp

    # the MLP's weight-gradient ring accumulator; attention's fp32 partial sums
    plants = {
        "mlp": [(mlp, "ring_grad_dtype", lambda params, into_main_grad: params[0].dtype)],
        "attention": [(attention, "accumulation_dtype", lambda dtype: dtype)],
        "": [],
    }[where]

    @contextlib.contextmanager
    def planted():
        saved = [getattr(module, name) for module, name, _ in plants]
        try:
            for module, name, replacement in plants:
                setattr(module, name, replacement)
            yield
        finally:
            for (module, name, _), original in zip(plants, saved):
                setattr(module, name, original)

    return planted()


def bf16_errors_vs_fp64(
    d,
    seed,
    style,
    layers=2,
    hidden=64,
    heads=8,
    ffn=128,
    vocab=256,
    batch=2,
    seq=64,
    plant_bf16_accumulation="",
    kinds=("tp_sp", "tsp"),
):
    """Loss, per-token loss, per-layer activation and per-parameter gradient errors of TSP-d and
    TP=d+SP (bf16) against fp64. ``plant_bf16_accumulation`` ('mlp' / 'attention') deliberately
    breaks TSP's fp32 accumulation there, to show that the criteria can fail. ``kinds``: the
    runs compared ("tp_sp", "tsp", "tsp_kv_fp32": TSP with its dK/dV reduce-scatter in fp32,
    "tsp_cp2": TSP-d x CP=2 on 2d ranks, "tsp_cp2_kv_fp32": with the dK/dV wire in fp32; a
    "_a2a" suffix: the dK/dV summed by an all-to-all, --tsp-kv-grad-all-to-all; "tsp_sums_fp32":
    TSP with its activation sums in fp32, --tsp-activation-sums-in-fp32; "tsp_vocab_ring": TSP
    with its loss on the vocabulary ring)."""
    dims = dict(layers=layers, hidden=hidden, heads=heads, ffn=ffn)
    setup_megatron_tp(1, seed)
    config64 = _config(1, torch.float64, style, **dims)
    # Megatron's stock TP=1 layer spec: no megatron_tsp code in the reference.
    reference = _model(
        config64, reference_single_layer_spec(config64), style, vocab, seq, parallel_output=True
    ).to(torch.float64)
    torch.manual_seed(seed)
    with torch.no_grad():  # bf16-representable weights, Megatron's init scale
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float64))
    full = {n: p.detach().clone() for n, p in reference.named_parameters()}
    data = _batch(seed, batch, seq, vocab)
    ref_acts = _capture_activations(reference)
    ref_loss, ref_token_losses = _token_losses_and_step(reference, data)
    ref_loss = ref_loss.double()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}

    out = {}
    for kind in kinds:
        with _planted_bf16_accumulation(plant_bf16_accumulation if kind != "tp_sp" else ""):
            loss, token_losses, acts, local_slice, group, grads = _run_bf16(
                kind, d, style, full, data, dims, vocab, seq
            )
        per_param = {n: _norm_rel(grads[n], g) for n, g in ref_grads.items()}
        out[kind] = {
            "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "token_losses": _norm_rel(token_losses, ref_token_losses),
            "activations": {
                n: _global_norm_rel(a, local_slice(ref_acts[n]), group) for n, a in acts.items()
            },
            "grad_median": statistics.median(per_param.values()),
            "grad_max": max(per_param.values()),
            "per_param": per_param,
        }
    return out


def _global_norm_rel(local_actual, local_expected, group) -> float:
    """Frobenius relative error of a tensor sharded over ``group`` by sequence rows (dim 0; each
    rank: its rows), independent of which rows each rank holds: per-row sums of squares are
    gathered and added in sorted order. TSP's zigzag and TP+SP's contiguous split of the same
    tensor then read the same error bit for bit; a plain per-rank sum then all-reduce differs
    in the last fp64 digit and made equal bf16 embeddings read "TSP > TP+SP" (a CI run,
    seed 475404881)."""
    import torch.distributed as dist

    def rows(t):
        return t.detach().double().contiguous().pow(2).flatten(1).sum(1)

    def total(local_rows):
        parts = [torch.empty_like(local_rows) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local_rows, group=group)
        return torch.cat(parts).sort().values.sum().item()

    diff = total(rows(local_actual.double() - local_expected.double()))
    return math.sqrt(diff / total(rows(local_expected)))


def split_error_reads_the_same(d, seed, tensors=32, seq=64, batch=2, hidden=64):
    """``_global_norm_rel`` of the same tensors split TSP's way (zigzag) and TP+SP's way
    (contiguous), ``tensors`` random pairs at bf16-like error sizes: both readings per pair, and
    an fp64 reading on the whole tensor (no split) for scale."""
    import torch.distributed as dist

    group, rank = dist.group.WORLD, dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(tensors):
        expected = torch.randn(seq, batch, hidden, generator=gen, dtype=torch.float64)
        actual = expected + 4e-3 * torch.randn(expected.shape, generator=gen, dtype=torch.float64)
        zigzag_read = _global_norm_rel(
            zigzag_rows(actual, d, rank), zigzag_rows(expected, d, rank), group
        )
        contiguous_read = _global_norm_rel(
            actual.chunk(d, dim=0)[rank], expected.chunk(d, dim=0)[rank], group
        )
        whole = _norm_rel(actual, expected)
        out.append((zigzag_read, contiguous_read, whole))
    return out


def mlp_bf16_errors_vs_fp64(d, seed, gated, bias, seq=64, batch=2, hidden=64, ffn=256):
    """One MLP layer, bf16: TSP-d and Megatron's MLP at TP=d+SP against an fp64 reference on the
    same (bf16-representable) weights, input and output gradient. Output, input-gradient and
    weight-gradient errors (Frobenius, relative)."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from megatron_tsp.core.layers.mlp import TSPMLP
    from tests.common import make_config, stock_mlp

    act = F.silu if gated else F.gelu
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for kind in ("tp_sp", "tsp"):
        (setup_tsp if kind == "tsp" else setup_megatron_tp)(d)
        group, size, rank = group_info() if kind == "tsp" else _tp_group_info()
        fields = dict(
            hidden_size=hidden,
            ffn_hidden_size=ffn,
            gated_linear_unit=gated,
            add_bias_linear=bias,
            activation_func=act,
        )
        config = make_config(d, torch.bfloat16, **fields)
        layer = (TSPMLP if kind == "tsp" else MLP)(config, submodules)
        if kind == "tp_sp":  # same full weights / data for both kinds
            gen.manual_seed(seed)
            full = {}
            for n, p in layer.named_parameters():
                sharded, dim, _ = sharding.sharding_of(p)
                shape = list(p.shape)
                if sharded:
                    shape[dim] *= size
                full[n] = (torch.randn(shape, generator=gen) * 0.1).to(torch.bfloat16).double()
            x_full = torch.randn(seq, batch, hidden, generator=gen).to(torch.bfloat16).double()
            dy_full = torch.randn(seq, batch, hidden, generator=gen).to(torch.bfloat16).double()
            # fp64 reference: megatron-core's stock MLP at TP=1 (its own activation and fusion
            # choice, not the TSP layer's ``make_activation``), on the same rounded weights
            reference = stock_mlp(make_config(1, torch.float64, **fields))
            with torch.no_grad():
                for n, p in reference.named_parameters():
                    p.copy_(full[n])
            ref = dict(reference.named_parameters())
            xr = x_full.clone().requires_grad_(True)
            yr, _ = reference(xr)
            yr.backward(dy_full)  # fc2 bias is added outside both layers
        sharding.load_full_state(layer, {n: t.to(torch.bfloat16) for n, t in full.items()}, group)
        if kind == "tsp":
            split = lambda t: zigzag_rows(t, size, rank)  # noqa: E731
        else:
            split = lambda t: t.chunk(size, dim=0)[rank]  # noqa: E731
        x = split(x_full).to(torch.bfloat16).requires_grad_(True)
        y, _ = layer(x)
        y.backward(split(dy_full).to(torch.bfloat16))
        grads = sharding.gather_full_state(layer, group, grads=True)
        out[kind] = {
            "output": _global_norm_rel(y, split(yr.detach()), group),
            "grad:input": _global_norm_rel(x.grad, split(xr.grad), group),
        }
        for n, g in grads.items():
            out[kind][f"grad:{n}"] = _norm_rel(g, ref[n].grad)
    return out
