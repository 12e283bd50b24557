"""MoE GPTModel checks run inside every rank (experts folded onto the TSP axis).

The model under test is a ``GPTModel`` built from ``get_gpt_block_tsp_spec``: TSP attention and,
in the layers ``moe_layer_freq`` marks, megatron-core's own ``MoELayer`` (top-k router with aux
and z losses, allgather / alltoall dispatcher, ``SequentialMLP`` SwiGLU experts, optionally a
shared expert) with expert-model-parallel size ``ep`` and expert-tensor-parallel size 1.
References are stock megatron-core only:

* single process: Megatron's own ``get_gpt_decoder_block_spec`` (local modules, CPU norms) at
  TP=1, EP=1, every rank running the whole model on the whole batch;
* TP=D+SP with the same EP: Megatron's ``get_gpt_decoder_layer_specs`` (local modules) with the
  norms written from their formula (``tests.common.FormulaNorm``).

The experts are perturbed per global expert id after initialisation (expert ``e`` gets
``+ 0.01 * (e + 1)`` on every weight, in every model), so experts differ even where
``use_cpu_initialization`` made them equal, and a model that put expert ``e``'s weights on the
wrong rank or applied them to the wrong tokens would fail.

The TSP expert ring (``check_moe_ring``, ``check_moe_ring_traffic``,
``check_expert_ring_zero_tokens``): ``tsp_moe_ring`` with expert-tensor-parallel size D and
expert-model-parallel size 1, against the same single-process model and Megatron TP=D+SP with
ETP=D, EP=1 (allgather dispatcher).
"""

from __future__ import annotations

import copy
import dataclasses
import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
)

from megatron_tsp.core import parallel_state as tsp_state
from megatron_tsp.core import sharding, zigzag
from megatron_tsp.core.specs import get_gpt_block_tsp_spec
from tests import common
from tests.checks_gpt import _batch, _model, _norms_to
from tests.common import DTYPES, FormulaNorm, assert_close, make_config

# (style overrides, MoE overrides) per case; all SwiGLU experts (Llama style), 4 experts, top-2.
CASES = {
    "moe": dict(layers=2, moe=dict()),
    "shared": dict(layers=2, moe=dict(moe_shared_expert_intermediate_size=32)),
    "dense_then_moe": dict(layers=2, moe=dict(moe_layer_freq=[0, 1])),
}
# One option at a time, outside the CASES grid every layout runs (tests/test_moe.py):
# * "probs_on_input": top-1 with the router probability applied to the experts' input
#   (``moe_apply_probs_on_input``; megatron-core's expert MLPs then do not scale their output;
#   top-1 needs ``moe_router_pre_softmax``, else the probability is 1 and has no gradient);
# * "empty_experts": experts without tokens on a rank. 8 tokens, top-1: at D=4 a ring rank routes
#   its 2 tokens to at most 2 of the 4 experts, and expert ``starve`` gets no token anywhere
#   (``_starve``), so a rank of the folded schedule holds an expert without tokens too (at EP=2
#   the first of its two: tokens_per_expert [0, n]).
OPTION_CASES = {
    "probs_on_input": dict(
        layers=2,
        moe=dict(moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True),
    ),
    "empty_experts": dict(
        layers=2,
        moe=dict(moe_router_topk=1, moe_router_pre_softmax=True),
        batch=1,
        seq=8,
        starve=2,
    ),
}
NUM_EXPERTS = 4
STARVE_FEATURE = 0  # the hidden feature ``_starve`` makes constant
ROUTING_MARGIN = 0.01  # relative to the router logits' standard deviation
ROUTING_MARGIN_DRAWS = 60


def _ensure_groups(tp: int, ep: int, etp: int = 1) -> None:
    """Megatron groups with tensor-parallel size ``tp``, expert-model-parallel size ``ep`` and
    expert-tensor-parallel size ``etp`` (1: experts whole; ``tp``: the expert ring's layout);
    ``tests.common``'s cache is invalidated so the next dense check re-creates its own groups."""
    if common._current == ("moe", tp, ep, etp):
        return
    tsp_state.destroy_model_parallel()
    tsp_state.initialize_model_parallel(
        tensor_sequence_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        create_gloo_process_groups=False,
    )
    common._current = ("moe", tp, ep, etp)


def _setup(tp: int, ep: int, seed: int, tsp: bool, etp: int = 1) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    _ensure_groups(tp, ep, etp)
    tsp_state._TSP_SIZE = tp if tsp else None
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def _case(case: str) -> dict:
    return CASES[case] if case in CASES else OPTION_CASES[case]


def _shape(case: str):
    """(vocab, sequence length, micro-batch) of a case's batch."""
    spec = _case(case)
    return 128, spec.get("seq", 32), spec.get("batch", 2)


@torch.no_grad()
def _starve(model, case: str) -> None:
    """Route no token to expert ``starve`` of the case (if any), in any layout (the word
    embeddings are sharded by vocabulary rows, the router is whole on every rank): every word
    embedding's feature ``STARVE_FEATURE`` is set to 0.1 (5x the other entries' init std), so
    every token's normalised router input carries that feature at about +4, and the routers' column
    of it is -2 for the starved expert, 0 for the others: its logit sits ~8 below theirs."""
    expert = _case(case).get("starve")
    if expert is None:
        return
    for name, p in model.named_parameters():
        if name.endswith("word_embeddings.weight"):
            p[:, STARVE_FEATURE] = 0.1
        elif name.endswith("mlp.router.weight"):
            p[:, STARVE_FEATURE] = 0.0
            p[expert, STARVE_FEATURE] = -2.0


def _count_tokens(model, ep_rank: int, ep: int, out: list):
    """Forward pre-hooks on the experts (``SequentialMLP``, the ring's ``TSPRingExperts``):
    append, per MoE layer call, ``{global expert id: tokens it receives on this rank}``."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    def record(module, args):
        counts = args[1].tolist()
        out.append({ep_rank * (NUM_EXPERTS // ep) + i: int(c) for i, c in enumerate(counts)})

    return [
        m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, SequentialMLP)
    ]


def _config(d, ep, dtype, case, dispatcher, etp=1, ring=False):
    """``ring``: the TSP expert ring (``config.tsp_moe_ring``), with ``etp`` = D and ``ep`` = 1."""
    spec = _case(case)
    moe = {"moe_router_topk": 2, **spec["moe"]}  # a case's MoE fields win
    config = make_config(
        d,
        dtype,
        num_layers=spec["layers"],
        hidden_size=32,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        num_moe_experts=NUM_EXPERTS,
        moe_ffn_hidden_size=32,
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
        moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        **moe,
    )
    config.tsp_moe_ring = ring
    return config


def _single_spec(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")


def _tp_sp_spec(config):
    """Megatron's local decoder layers (dense / MoE per ``moe_layer_freq``) with formula norms."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layers = []
    for spec in get_gpt_decoder_layer_specs(config, False, "RMSNorm"):
        spec = copy.deepcopy(spec)
        spec.submodules.input_layernorm = FormulaNorm
        spec.submodules.pre_mlp_layernorm = FormulaNorm
        layers.append(spec)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=FormulaNorm)


_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def _global_expert(name: str, ep_rank: int, ep: int):
    """Global expert id of a SequentialMLP parameter name, from this rank's local index."""
    m = _LOCAL_EXPERT.search(name)
    return None if m is None else ep_rank * (NUM_EXPERTS // ep) + int(m.group(1))


def _perturb_experts(model, ep_rank: int, ep: int) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            e = _global_expert(name, ep_rank, ep)
            if e is not None:
                p.add_(0.01 * (e + 1))


def _full_name(name: str, ep_rank: int, ep: int) -> str:
    """The single-process (EP=1) name of a parameter: local expert index -> global id."""
    e = _global_expert(name, ep_rank, ep)
    if e is None:
        return name
    return _LOCAL_EXPERT.sub(f".mlp.experts.local_experts.{e}.", name)


def _step(model, batch, mask_count=None, z_loss_group=None):
    """Masked mean token loss (fp64-exact path: vocab-gathered logits) plus the MoE aux losses
    the router attached to its activations, backward; returns (loss, aux losses by name).
    ``mask_count``: the normaliser when ``batch`` is one CP rank's part of the batch (the whole
    batch's mask count; default: this batch's). ``z_loss_group``: the ranks whose tokens the
    logged z-loss is averaged over (default: the tensor-parallel group)."""
    clear_aux_losses_tracker()
    logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
    losses = (
        -torch.log_softmax(logits, dim=-1).gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    )
    mask = batch["loss_mask"].to(losses.dtype)
    loss = (losses * mask).sum() / (mask.sum() if mask_count is None else mask_count)
    loss.backward()
    aux = {}
    for name, entry in get_moe_layer_wise_logging_tracker().items():
        values = entry["values"].clone()
        group = entry.get("reduce_group")
        if group is not None:  # what Megatron's logging does before reporting
            dist.all_reduce(values, group=group)
        else:
            # z_loss is logged without a reduce group: each rank's value is the mean over its own
            # tokens (Megatron logs TP rank 0's under TP+SP; a TSP rank holds other tokens, so
            # that one number differs between the two). Its mean over the tensor-parallel group
            # is the mean over all tokens, the same under TP=1, TP+SP and TSP.
            tp = z_loss_group or mpu.get_tensor_model_parallel_group()
            dist.all_reduce(values, group=tp)
            values /= dist.get_world_size(tp)
        aux[name] = values
    return loss.detach(), aux


def _single_reference(seed, case, data, dispatcher):
    """The single-process stock model (TP=1, EP=1, fp64, experts perturbed per global id) on the
    whole batch: ``(parameters, loss, aux losses, gradients)``, by name."""
    dtype = DTYPES["float64"]
    vocab, seq = 128, data["tokens"].shape[1]
    _setup(1, 1, seed, tsp=False)
    config = _config(1, 1, dtype, case, dispatcher)
    ref = _norms_to(_model(config, _single_spec(config), "llama", vocab, seq, False), dtype)
    _perturb_experts(ref, 0, 1)
    _starve(ref, case)
    params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    loss, aux = _step(ref, data)
    return params, loss, aux, {n: p.grad.clone() for n, p in ref.named_parameters()}


def _expert_and_grads(model, ep_rank, ep, group):
    """Every gradient at full (single-process) size and name: TP-sharded parameters gathered over
    the tensor-parallel group (the expert ring's experts too: expert-TP is that group), whole
    experts (EP > 1) gathered over the expert-model-parallel group."""
    dense = {}
    experts = {}
    for name, p in model.named_parameters():
        if _global_expert(name, ep_rank, ep) is None or ep == 1:
            continue
        experts[name] = p.grad
    full = sharding.gather_full_state(model, group, grads=True)
    for name in list(full):
        if name not in experts:
            dense[name] = full[name]
    ep_group = mpu.get_expert_model_parallel_group()
    for name, g in experts.items():
        parts = [torch.empty_like(g) for _ in range(ep)]
        dist.all_gather(parts, g.contiguous(), group=ep_group)
        for r, part in enumerate(parts):
            dense[_full_name(name, r, ep)] = part
    return dense


def _run(model, batch, group, ep, sum_sp=True):
    loss, aux = _step(model, batch)
    if sum_sp:
        sharding.allreduce_sequence_parallel_grads(model, group)
    return loss, aux


def check_moe_vs_single(d, ep, seed, case, dispatcher="allgather", rtol=1e-10, tokens=None):
    """TSP-D with experts over EP=``ep`` vs the single-process (TP=1, EP=1) stock model: loss, aux
    losses (logged values) and every gradient at full size. ``tokens``: a list that receives the
    TSP model's tokens per expert on this rank (``_count_tokens``)."""
    dtype = DTYPES["float64"]
    vocab, seq, batch = _shape(case)
    data = _batch(seed, batch, seq, vocab)

    ref_params, ref_loss, ref_aux, ref_grads = _single_reference(seed, case, data, dispatcher)

    _setup(d, ep, seed, tsp=True)
    group = tsp_state.get_tensor_sequence_parallel_group()
    ep_rank = mpu.get_expert_model_parallel_rank()
    config = _config(d, ep, dtype, case, dispatcher)
    model = _model(config, get_gpt_block_tsp_spec(config), "llama", vocab, seq, False)
    _load_full(model, ref_params, group, ep_rank, ep)
    if tokens is not None:
        _count_tokens(model, ep_rank, ep, tokens)
    local = zigzag.get_batch_on_this_tsp_rank(data, d)
    loss, aux = _run(model, local, group, ep)
    _reduce_expert_grads(model, ep_rank, ep)
    grads = _expert_and_grads(model, ep_rank, ep, group)
    actual = {"loss": loss, **{f"grad:{n}": g for n, g in grads.items()}}
    expected = {"loss": ref_loss, **{f"grad:{n}": g for n, g in ref_grads.items()}}
    what = f"TSP MoE ({case}, D={d}, EP={ep}, {dispatcher}) vs single-process stock GPTModel"
    return _compare(actual, expected, aux, ref_aux, rtol, f"{what}, seed={seed}")


def _compare(actual, expected, aux, ref_aux, rtol, what):
    """Loss and gradients at ``rtol``; the logged aux losses at 1e-6: megatron-core's tracker
    keeps them in an fp32 buffer whatever the model's dtype (the aux losses' effect on training,
    their gradients, is part of the fp64 gradient comparison)."""
    errors = assert_close(actual, expected, rtol=rtol, what=what)
    if set(ref_aux) != {"load_balancing_loss", "z_loss"}:
        raise AssertionError(f"{what}: expected the aux and z losses logged, got {sorted(ref_aux)}")
    errors.update(
        assert_close(
            {f"aux:{k}": v for k, v in aux.items()},
            {f"aux:{k}": v for k, v in ref_aux.items()},
            rtol=1e-6,
            what=what + " (logged aux losses)",
        )
    )
    return errors


@torch.no_grad()
def _load_full(model, full_params, group, ep_rank, ep):
    """Load single-process parameters: experts by global id, the rest as their TP shards."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    etp_size = mpu.get_expert_tensor_parallel_world_size()
    etp_rank = mpu.get_expert_tensor_parallel_rank()
    for name, p in model.named_parameters():
        # experts by global id, sharded over the expert-TP group (1 rank when folded, the TSP
        # group under the expert ring)
        expert = _global_expert(name, ep_rank, ep) is not None
        value = full_params[_full_name(name, ep_rank, ep)]
        sharded, dim, stride = sharding.sharding_of(p)
        if sharded:
            value = sharding.shard(
                value, dim, stride, etp_size if expert else size, etp_rank if expert else rank
            )
        p.copy_(value)


def _reduce_expert_grads(model, ep_rank, ep):
    """Sum each expert's gradient over the ranks of the TSP group holding a copy of it (EP < D:
    the expert-data-parallel group), what DDP does: sum over the expert-data-parallel group,
    divided by the data-parallel replicas that ran the same batch."""
    group = mpu.get_expert_data_parallel_group()
    replicas = mpu.get_data_parallel_world_size()
    for name, p in model.named_parameters():
        if _global_expert(name, ep_rank, ep) is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(replicas)


def check_moe_vs_tp_sp(d, ep, seed, case, dispatcher="allgather", rtol=1e-10, tokens=None):
    """Megatron TP=D+SP with EP=``ep`` and TSP-D with the same EP on the same ranks: the TP+SP
    model's state dict (this rank's shards and experts) loads into the TSP model with
    ``strict=True``; loss, aux losses and every local gradient equal. ``tokens``: as
    ``check_moe_vs_single``'s."""
    dtype = DTYPES["float64"]
    vocab, seq, batch = _shape(case)
    data = _batch(seed, batch, seq, vocab)

    _setup(d, ep, seed, tsp=False)
    group = mpu.get_tensor_model_parallel_group()
    ep_rank = mpu.get_expert_model_parallel_rank()
    config = _config(d, ep, dtype, case, dispatcher)
    tp_model = _model(config, _tp_sp_spec(config), "llama", vocab, seq, False)
    _perturb_experts(tp_model, ep_rank, ep)
    _starve(tp_model, case)
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in tp_model.state_dict().items()}
    tp_loss, tp_aux = _run(tp_model, data, group, ep)
    # EP < D: an expert's copies see the tokens of their own expert-model-parallel group, which
    # are other tokens under TSP (zigzag chunks) than under TP+SP (blocks); only their sum over
    # the copies (what DDP reduces) is the model's gradient.
    _reduce_expert_grads(tp_model, ep_rank, ep)
    tp_grads = {n: p.grad.clone() for n, p in tp_model.named_parameters()}

    _setup(d, ep, seed, tsp=True)
    tsp_model = _model(config, get_gpt_block_tsp_spec(config), "llama", vocab, seq, False)
    tsp_model.load_state_dict(state, strict=True)
    if tokens is not None:
        _count_tokens(tsp_model, ep_rank, ep, tokens)
    loss, aux = _run(tsp_model, zigzag.get_batch_on_this_tsp_rank(data, d), group, ep)
    _reduce_expert_grads(tsp_model, ep_rank, ep)
    actual = {"loss": loss}
    expected = {"loss": tp_loss}
    for name, p in tsp_model.named_parameters():
        actual[f"grad:{name}"] = p.grad
        expected[f"grad:{name}"] = tp_grads[name]
    what = f"TSP vs Megatron TP={d}+SP MoE ({case}, EP={ep}, {dispatcher}), seed={seed}"
    return _compare(actual, expected, aux, tp_aux, rtol, what)


def check_moe_ring(d, seed, case, rtol=1e-10, tokens=None):
    """The TSP expert ring (``tsp_moe_ring``: every expert sharded 1/D per rank, ETP=D, EP=1) vs
    the single-process stock model (full-size gradients by name) and vs Megatron TP=D+SP with
    ETP=D, EP=1 and the allgather dispatcher (its state dict loads into the ring model with
    ``strict=True``; local gradients), all three on the same weights (the single model's,
    experts perturbed per global id): loss, logged aux losses, every gradient. Returns
    ``{"single": errors, "tp_sp": errors}``. ``tokens``: a list that receives the ring model's
    tokens per expert on this rank (``_count_tokens``)."""
    dtype = DTYPES["float64"]
    vocab, seq, batch = _shape(case)
    data = _batch(seed, batch, seq, vocab)

    ref_params, ref_loss, ref_aux, ref_grads = _single_reference(seed, case, data, "allgather")

    _setup(d, 1, seed, tsp=False, etp=d)
    group = mpu.get_tensor_model_parallel_group()
    config = _config(d, 1, dtype, case, "allgather", etp=d)
    tp_model = _model(config, _tp_sp_spec(config), "llama", vocab, seq, False)
    _load_full(tp_model, ref_params, group, 0, 1)
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in tp_model.state_dict().items()}
    tp_loss, tp_aux = _run(tp_model, data, group, 1)
    tp_grads = {n: p.grad.clone() for n, p in tp_model.named_parameters()}

    _setup(d, 1, seed, tsp=True, etp=d)
    ring_config = _config(d, 1, dtype, case, "allgather", etp=d, ring=True)
    model = _model(ring_config, get_gpt_block_tsp_spec(ring_config), "llama", vocab, seq, False)
    from megatron_tsp.core.layers.moe_ring import TSPRingExperts

    if not any(isinstance(m, TSPRingExperts) for m in model.modules()):
        raise AssertionError("tsp_moe_ring=True built no TSPRingExperts")
    model.load_state_dict(state, strict=True)
    if tokens is not None:
        _count_tokens(model, 0, 1, tokens)
    loss, aux = _run(model, zigzag.get_batch_on_this_tsp_rank(data, d), group, 1)
    what = f"TSP expert ring ({case}, D={d}) vs"
    actual = {"loss": loss}
    expected = {"loss": tp_loss}
    for name, p in model.named_parameters():
        actual[f"grad:{name}"] = p.grad
        expected[f"grad:{name}"] = tp_grads[name]
    errors = {
        "tp_sp": _compare(
            actual, expected, aux, tp_aux, rtol, f"{what} Megatron TP={d}+SP ETP={d} EP=1"
        )
    }
    grads = _expert_and_grads(model, 0, 1, group)
    actual = {"loss": loss, **{f"grad:{n}": g for n, g in grads.items()}}
    expected = {"loss": ref_loss, **{f"grad:{n}": g for n, g in ref_grads.items()}}
    errors["single"] = _compare(
        actual, expected, aux, ref_aux, rtol, f"{what} single-process stock GPTModel, seed={seed}"
    )
    return errors


def check_moe_ring_cp(d, c, seed, case, rtol=1e-10):
    """The TSP expert ring under TSP x CP (``d`` * ``c`` sequence ranks: Megatron's CP split then
    the TSP zigzag; every expert sharded over the ``d`` TSP ranks and replicated over CP) vs the
    single-process stock model: loss (normalised by the whole batch's mask count, summed over
    CP), logged aux losses, every gradient (summed over CP as DDP does, replicated ones over TSP,
    gathered to full size)."""
    import dataclasses

    from tests.checks_tsp_cp import _sum_over_cp, setup_tsp_cp

    dtype = DTYPES["float64"]
    vocab, seq, batch = 128, 32, 2
    data = _batch(seed, batch, seq, vocab)

    ref_params, ref_loss, ref_aux, ref_grads = _single_reference(seed, case, data, "allgather")

    g = setup_tsp_cp(d, c, seed, expert_tensor_parallel_size=d)
    tp, cp, seq_group = g["tp"], g["cp"], g["seq"]
    config = _config(d, 1, dtype, case, "allgather", etp=d)
    config = dataclasses.replace(config, context_parallel_size=c)
    config.tsp_moe_ring = True
    model = _model(config, get_gpt_block_tsp_spec(config), "llama", vocab, seq, False)
    _load_full(model, ref_params, tp, 0, 1)
    local = zigzag.get_batch_on_this_tsp_rank(
        data, d, context_parallel_size=c, cp_rank=g["cp_rank"]
    )
    loss, aux = _step(
        model, local, mask_count=data["loss_mask"].sum(), z_loss_group=seq_group
    )  # this CP rank's part of the loss
    dist.all_reduce(loss, group=cp)
    _sum_over_cp(model, cp)
    sharding.allreduce_sequence_parallel_grads(model, tp)
    grads = _expert_and_grads(model, 0, 1, tp)
    actual = {"loss": loss, **{f"grad:{n}": g for n, g in grads.items()}}
    expected = {"loss": ref_loss, **{f"grad:{n}": g for n, g in ref_grads.items()}}
    what = f"TSP expert ring x CP ({case}, D={d}, C={c}) vs single-process stock GPTModel"
    return _compare(actual, expected, aux, ref_aux, rtol, f"{what}, seed={seed}")


def check_moe_option(d, ep, seed, case, ring):
    """An ``OPTION_CASES`` case under one schedule against both references (fp64): the folded
    schedule (EP=``ep``) vs the single-process model and vs Megatron TP=D+SP with the same EP,
    or the TSP expert ring (``ring``; ETP=D, EP=1) vs both. Returns ``{"single": errors,
    "tp_sp": errors, "tokens": {run: [{global expert: tokens on this rank}, per MoE layer]}}``
    (the folded schedule runs TSP twice, on the single model's and on TP+SP's weights)."""
    if ring:
        tokens = {"ring": []}
        errors = check_moe_ring(d, seed, case, tokens=tokens["ring"])
    else:
        tokens = {"vs single": [], "vs tp_sp": []}
        errors = {
            "single": check_moe_vs_single(d, ep, seed, case, tokens=tokens["vs single"]),
            "tp_sp": check_moe_vs_tp_sp(d, ep, seed, case, tokens=tokens["vs tp_sp"]),
        }
    return {**errors, "tokens": tokens}


def worst(per_rank_errors) -> dict:
    """The largest relative error over the ranks, per kind (loss / aux losses / gradients)."""
    out = {}
    for errors in per_rank_errors:
        for key, err in errors.items():
            kind = key.split(":")[0] if ":" in key else key
            if kind == "aux":
                kind = key
            out[kind] = max(out.get(kind, 0.0), err)
    return {k: float(f"{v:.2e}") for k, v in out.items()}


def check_moe_traffic_equals_tp_sp(d, ep, seed, case="moe"):
    """The collectives megatron-core's MoE layers issue (forward and backward, counted by
    ``CommCounter`` inside ``MoELayer`` modules) under TSP equal those under TP=D+SP with the
    same EP, op by op: calls and bytes (the dispatcher sees S/D tokens per rank either way), and
    equal the allgather dispatcher's formula below. Returns the per-op counts."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_tsp.tools.comm_counter import CommCounter, label_modules

    dtype = DTYPES["float64"]
    vocab, seq, batch = 128, 32, 2
    data = _batch(seed, batch, seq, vocab)
    counted = {}
    for name, tsp in (("tp_sp", False), ("tsp", True)):
        _setup(d, ep, seed, tsp=tsp)
        config = _config(d, ep, dtype, case, "allgather")
        spec = get_gpt_block_tsp_spec(config) if tsp else _tp_sp_spec(config)
        model = _model(config, spec, "llama", vocab, seq, False)
        label_modules(model, {MoELayer: "moe"})
        local = zigzag.get_batch_on_this_tsp_rank(data, d) if tsp else data
        with CommCounter() as counter:
            _step(model, local)
        counted[name] = {phase: counter.by_op(scope="moe", phase=phase) for phase in ("fwd", "bwd")}
    if counted["tsp"] != counted["tp_sp"]:
        raise AssertionError(
            f"MoE traffic differs (D={d}, EP={ep}): TSP {counted['tsp']} vs TP+SP "
            f"{counted['tp_sp']}"
        )
    # The allgather dispatcher's volume does not depend on the routing: the package's formula
    # (``estimator.moe.allgather_collectives``), T = S*b/D tokens per rank, fp64 (8 bytes).
    from megatron_tsp.tools.estimator import moe as moe_model

    layers = sum(_moe_pattern(config))
    t, h = seq * batch // d, config.hidden_size
    formula = _times(moe_model.allgather_collectives(t, h, NUM_EXPERTS, ep, 8), layers)
    got = {
        phase: {op: (v["calls"], v["payload"]) for op, v in ops.items()}
        for phase, ops in counted["tsp"].items()
    }
    if got != formula:
        raise AssertionError(f"MoE traffic (D={d}, EP={ep}) {got} != formula {formula}")
    return counted["tsp"]


def _moe_pattern(config):
    from megatron_tsp.core.specs import moe_layer_pattern

    return moe_layer_pattern(config)


def _times(collectives, layers):
    """Per-layer collectives (``estimator.moe``) summed over ``layers`` MoE layers."""
    return {
        phase: {op: (layers * c, layers * b) for op, (c, b) in ops.items()}
        for phase, ops in collectives.items()
    }


def ring_traffic_formula(d, num_layers, num_experts, hidden, moe_ffn, weight_bytes, grad_bytes):
    """``estimator.moe.ring_collectives`` (docs/moe.md) over ``num_layers`` MoE layers, SwiGLU
    experts without biases (one expert: fc1 [2F, h] + fc2 [h, F] = 3Fh elements)."""
    from megatron_tsp.tools.estimator import moe as moe_model

    per_layer = moe_model.ring_collectives(
        d, num_experts, 3 * moe_ffn * hidden, weight_bytes, grad_bytes
    )
    return _times(per_layer, num_layers)


def check_moe_ring_traffic(d, seed, dtype_name="float64", case="moe"):
    """The collectives inside the expert ring's MoE layers (``CommCounter``, forward and backward)
    equal ``ring_traffic_formula`` op by op (calls and payload bytes). Returns the counts and, for
    comparison, the folded schedule's allgather-dispatcher bytes at the same shape (EP = D)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_tsp.tools.comm_counter import CommCounter, label_modules

    dtype = getattr(torch, dtype_name)
    vocab, seq, batch = 128, 32, 2
    data = _batch(seed, batch, seq, vocab)
    _setup(d, 1, seed, tsp=True, etp=d)
    config = _config(d, 1, dtype, case, "allgather", etp=d, ring=True)
    model = _model(config, get_gpt_block_tsp_spec(config), "llama", vocab, seq, False)
    label_modules(model, {MoELayer: "moe"})
    with CommCounter() as counter:
        _step(model, zigzag.get_batch_on_this_tsp_rank(data, d))
    got = {
        phase: {
            op: (v["calls"], v["payload"])
            for op, v in counter.by_op(scope="moe", phase=phase).items()
        }
        for phase in ("fwd", "bwd")
    }
    elt = torch.finfo(dtype).bits // 8
    grad_elt = 4 if elt < 4 else elt
    formula = ring_traffic_formula(
        d,
        sum(_moe_pattern(config)),
        NUM_EXPERTS,
        config.hidden_size,
        config.moe_ffn_hidden_size,
        elt,
        grad_elt,
    )
    if got != formula:
        raise AssertionError(
            f"expert ring traffic (D={d}, {dtype_name}) {got} != formula {formula}"
        )
    return got


def _swiglu(pre):
    """SwiGLU of an fc1 output [tokens, 2 F] (gate columns, then linear ones)."""
    import torch.nn.functional as F

    gate, up = pre.chunk(2, dim=-1)
    return F.silu(gate) * up


def check_expert_ring_zero_tokens(d, seed, with_bias, triton_kernel=False):
    """``tsp_expert_ring`` directly, fp64, with token counts that differ per rank and include
    experts with no tokens on a rank and a rank with no tokens at all (every rank still takes
    every ring step): output, input gradient and every weight-shard gradient equal the full
    SwiGLU experts applied per token, the weight gradients summed over the ranks' tokens.
    ``triton_kernel``: fp32, the activation backward in TSP's Triton kernel (``activation_kernel``,
    chosen on CUDA; here in Triton's interpreter), called for every expert at every step, those
    without tokens included (no launch), against the same experts in fp32 torch ops."""
    from megatron_tsp.core.layers.mlp import MLPActivation
    from megatron_tsp.core.layers.moe_ring import tsp_expert_ring
    from tests.checks_layers import forced_activation_kernel

    _ensure_groups(d, 1, d)
    group = tsp_state.get_tensor_sequence_parallel_group()
    rank = dist.get_rank(group)
    dtype = torch.float32 if triton_kernel else torch.float64
    h, ffn, experts = 8, 12, 3
    g = torch.Generator().manual_seed(seed)
    full = []
    for _ in range(experts):
        w1 = torch.randn(2 * ffn, h, generator=g, dtype=dtype)
        b1 = torch.randn(2 * ffn, generator=g, dtype=dtype)
        w2 = torch.randn(h, ffn, generator=g, dtype=dtype)
        full.append((w1, b1, w2) if with_bias else (w1, None, w2))
    counts = [0] * experts if rank == d - 1 else [(e + rank) % 3 for e in range(experts)]
    local = torch.Generator().manual_seed(seed + 1 + rank)
    x = torch.randn(sum(counts), h, generator=local, dtype=dtype)
    dy = torch.randn(sum(counts), h, generator=local, dtype=dtype)
    act = MLPActivation(_swiglu, "swiglu" if triton_kernel else None)

    shards = []
    for w1, b1, w2 in full:
        shards.append(sharding.shard(w1, 0, 2, d, rank))
        if b1 is not None:
            shards.append(sharding.shard(b1, 0, 2, d, rank))
        shards.append(sharding.shard(w2, 1, 1, d, rank))
    shards = [s.clone().requires_grad_(True) for s in shards]
    x_ring = x.clone().requires_grad_(True)
    with forced_activation_kernel(triton_kernel) as calls:
        out = tsp_expert_ring(x_ring, counts, shards, with_bias, group, act)
        out.backward(dy)
    if triton_kernel:  # every expert at every step, by its token count on this rank
        assert calls == [("swiglu", c) for c in counts] * d, calls

    x_ref = x.clone().requires_grad_(True)
    ref_params = [
        [t.clone().requires_grad_(True) if t is not None else None for t in e] for e in full
    ]
    parts = []
    for x_e, (w1, b1, w2) in zip(x_ref.split(counts), ref_params):
        pre = x_e @ w1.t() + (b1 if b1 is not None else 0)
        parts.append(act(pre) @ w2.t())
    ref_out = torch.cat(parts)
    ref_out.backward(dy)
    actual = {"out": out.detach(), "grad_x": x_ring.grad}
    expected = {"out": ref_out.detach(), "grad_x": x_ref.grad}
    i = 0
    for e, (w1, b1, w2) in enumerate(ref_params):
        for name, t, dim, stride in (("w1", w1, 0, 2), ("b1", b1, 0, 2), ("w2", w2, 1, 1)):
            if t is None:
                continue
            summed = t.grad.clone()
            dist.all_reduce(summed, group=group)  # every rank's tokens contribute
            actual[f"grad:{e}.{name}"] = shards[i].grad
            expected[f"grad:{e}.{name}"] = sharding.shard(summed, dim, stride, d, rank)
            i += 1
    rtol = 1e-5 if triton_kernel else 1e-10
    return assert_close(actual, expected, rtol=rtol, what=f"expert ring D={d}, zero tokens")


def moe_bf16_errors_vs_fp64(d, seed, case="moe"):
    """bf16 accuracy of both MoE schedules against Megatron TP=D+SP with the same expert layout,
    each against the fp64 single-process model on the same bf16-representable weights and batch:
    the folded schedule (EP=D, ETP=1) and the TSP expert ring (EP=1, ETP=D). Returns, per run
    ("tp_sp_ep", "tsp_ep", "tp_sp_etp", "tsp_ring"), the loss error, every parameter's
    relative gradient error (Frobenius, full size) and the tokens routed to other experts than
    the fp64 model's ("flips", summed over routers)."""
    dtype64 = DTYPES["float64"]
    vocab, seq, batch = 128, 32, 2

    _setup(1, 1, seed, tsp=False)
    ref_config = _config(1, 1, dtype64, case, "allgather")
    ref = _norms_to(
        _model(ref_config, _single_spec(ref_config), "llama", vocab, seq, False), dtype64
    )
    _perturb_experts(ref, 0, 1)
    with torch.no_grad():  # bf16-representable weights: every run starts from these exactly
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).to(dtype64))
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    # A batch whose top-k choices are all at least ROUTING_MARGIN apart (router logits' standard
    # deviations) in the fp64 model: bf16 rounding moves logits by less, so no run should route
    # a token elsewhere; the runs' "flips" say whether that held.
    for draw in range(ROUTING_MARGIN_DRAWS):
        data = _batch(seed + 7919 * draw, batch, seq, vocab)
        if _min_routing_margin(ref, data) >= ROUTING_MARGIN:
            break
    else:
        raise AssertionError(
            f"no batch in {ROUTING_MARGIN_DRAWS} with routing margins >= "
            f"{ROUTING_MARGIN} (seed={seed})"
        )
    ref_maps = []
    hooks = _record_routing(ref, ref_maps)
    ref_loss, _ = _step(ref, data)
    for h in hooks:
        h.remove()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}

    def run(tsp, ep, etp, ring):
        _setup(d, ep, seed, tsp=tsp, etp=etp)
        group = mpu.get_tensor_model_parallel_group()
        ep_rank = mpu.get_expert_model_parallel_rank()
        config = _config(d, ep, torch.bfloat16, case, "allgather", etp=etp, ring=ring)
        spec = get_gpt_block_tsp_spec(config) if tsp else _tp_sp_spec(config)
        model = _model(config, spec, "llama", vocab, seq, False).to(torch.bfloat16)
        _load_full(
            model, {n: t.to(torch.bfloat16) for n, t in ref_params.items()}, group, ep_rank, ep
        )
        batch_ = zigzag.get_batch_on_this_tsp_rank(data, d) if tsp else data
        maps = []
        hooks = _record_routing(model, maps)
        loss, _ = _run(model, batch_, group, ep)
        for h in hooks:
            h.remove()
        flips = _routing_flips(maps, ref_maps, group, d, tsp, batch)
        _reduce_expert_grads(model, ep_rank, ep)
        grads = _expert_and_grads(model, ep_rank, ep, group)
        per_param = {
            n: ((grads[n].double() - g).norm() / g.norm().clamp_min(1e-30)).item()
            for n, g in ref_grads.items()
        }
        return {
            "loss": abs(loss.double().item() - ref_loss.item()) / abs(ref_loss.item()),
            "per_param": per_param,
            "flips": flips,
        }

    return {
        "tp_sp_ep": run(False, d, 1, False),
        "tsp_ep": run(True, d, 1, False),
        "tp_sp_etp": run(False, 1, d, False),
        "tsp_ring": run(True, 1, d, True),
    }


def _record_routing(model, maps):
    """Forward hooks appending each router's routing map ([tokens, experts], bool) to ``maps``."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [
        m.register_forward_hook(lambda mod, args, out: maps.append(out[1].detach().clone()))
        for m in model.modules()
        if isinstance(m, TopKRouter)
    ]


def _routing_flips(maps, ref_maps, group, d, tsp, batch):
    """Tokens (summed over routers) whose chosen experts differ from the fp64 model's: the local
    maps are gathered over the TSP / SP group and put back in sequence order."""
    flips = 0
    for local, ref in zip(maps, ref_maps):
        local = local.reshape(-1, batch, local.shape[-1])
        parts = [torch.empty_like(local) for _ in range(d)]
        dist.all_gather(parts, local.contiguous(), group=group)
        full = torch.cat(parts, dim=0)
        if tsp:
            full = zigzag.unpermute(full, d, dim=0)
        ref = ref.reshape(full.shape)
        flips += int((full != ref).any(dim=-1).sum())
    return flips


def _min_routing_margin(model, data):
    """The smallest gap, over every router and token of one forward of ``model``, between the
    k-th and (k+1)-th largest router logit, relative to that router's logits' standard
    deviation."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    margins = []

    def record(router, args, out):
        logits = args[0] @ router.weight.t()
        top = logits.topk(router.topk + 1, dim=-1).values
        margins.append(((top[..., -2] - top[..., -1]).min() / logits.std()).item())

    hooks = [r.register_forward_hook(record) for r in routers]
    with torch.no_grad():
        model(data["tokens"], data["position_ids"], data["attention_mask"])
    for h in hooks:
        h.remove()
    return min(margins)


def check_moe_alltoall(d, ep, seed, case):
    """The alltoall dispatcher (its CUDA-only side stream and host copy answered as the CPU
    runner answers them, ``cpu_runner.alltoall_dispatcher_on_cpu``): TSP equals the
    single-process stock model and Megatron TP=D+SP with the same EP, fp64."""
    from megatron_tsp.megatron_lm.cpu_runner import alltoall_dispatcher_on_cpu

    with alltoall_dispatcher_on_cpu():
        single = check_moe_vs_single(d, ep, seed, case, dispatcher="alltoall")
        tp_sp = check_moe_vs_tp_sp(d, ep, seed, case, dispatcher="alltoall")
    return {"single": single, "tp_sp": tp_sp}


def _routing_recorder(model):
    """Forward hooks on every MoE router: the routing maps [tokens, E] in forward order."""
    from megatron.core.transformer.moe.router import TopKRouter

    maps = []
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.register_forward_hook(lambda mod, inp, out: maps.append(out[1].detach()))
    return maps


def _copies_across_ranks(routing_map, ep):
    """(copies in, copies out) of this rank for one MoE layer: token copies other ranks of its
    expert-model-parallel group route to its experts, and its own copies routed to experts on
    other ranks (experts are spread over the EP ranks in order, E/EP each)."""
    group = mpu.get_expert_model_parallel_group()
    me = dist.get_rank(group)
    maps = [torch.empty_like(routing_map) for _ in range(ep)]
    dist.all_gather(maps, routing_map.contiguous(), group=group)
    per_rank = NUM_EXPERTS // ep
    mine = slice(me * per_rank, (me + 1) * per_rank)
    copies_in = sum(int(m[:, mine].sum()) for r, m in enumerate(maps) if r != me)
    copies_out = int(routing_map.sum()) - int(routing_map[:, mine].sum())
    return copies_in, copies_out


def check_moe_alltoall_traffic(d, ep, seed, case="moe"):
    """The alltoall dispatcher's collectives under TSP (``CommCounter`` inside ``MoELayer``
    modules, received bytes, exact for its uneven all-to-alls) equal
    ``estimator.moe.alltoall_received`` evaluated on the routing this run made (every MoE layer's
    routing map, gathered over the EP group). Returns the counted bytes and the uniform-routing
    expectation (``alltoall_expected_received``) for the same shape."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_tsp.megatron_lm.cpu_runner import alltoall_dispatcher_on_cpu
    from megatron_tsp.tools.comm_counter import CommCounter, label_modules
    from megatron_tsp.tools.estimator import moe as moe_model

    dtype = DTYPES["float64"]
    vocab, seq, batch = 128, 32, 2
    data = _batch(seed, batch, seq, vocab)
    with alltoall_dispatcher_on_cpu():
        _setup(d, ep, seed, tsp=True)
        config = _config(d, ep, dtype, case, "alltoall")
        model = _model(config, get_gpt_block_tsp_spec(config), "llama", vocab, seq, False)
        label_modules(model, {MoELayer: "moe"})
        maps = _routing_recorder(model)
        with CommCounter() as counter:
            _step(model, zigzag.get_batch_on_this_tsp_rank(data, d))
    h, width = config.hidden_size, dtype.itemsize
    expected = {"fwd": {}, "bwd": {}}
    for routing_map in maps:
        copies = _copies_across_ranks(routing_map, ep)
        per_layer = moe_model.alltoall_received(*copies, h, NUM_EXPERTS, ep, width, width)
        for phase, ops in per_layer.items():
            for op, value in ops.items():
                expected[phase][op] = expected[phase].get(op, 0.0) + value
    counted = {}
    for phase, ops in expected.items():
        by_op = counter.by_op(scope="moe", phase=phase)
        counted[phase] = {op: by_op.get(op, {}).get("recv", 0.0) for op in ops}
        for op, value in ops.items():
            if abs(counted[phase][op] - value) > 1e-9 * max(value, 1.0):
                raise AssertionError(
                    f"alltoall dispatcher (D={d}, EP={ep}) {phase} {op}: counted "
                    f"{counted[phase][op]} bytes received, formula on this routing {value}"
                )
    tokens = seq * batch // d
    shape = dataclasses.replace(_moe_shape(config), dtype_bytes=width)
    uniform = len(maps) * moe_model.alltoall_expected_received(shape, ep, tokens, width)
    return {"counted": counted, "uniform_expectation": uniform}


def _moe_shape(config):
    from megatron_tsp.core.model_shape import ModelShape

    return ModelShape(
        num_layers=config.num_layers,
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        num_experts=NUM_EXPERTS,
        moe_topk=config.moe_router_topk,
        moe_ffn=config.moe_ffn_hidden_size,
    )


def trace_expert_ring(d, experts=3, h=8, ffn=12, tokens_per_expert=2):
    """Event order (P2P posts and matmuls) of ``tsp_expert_ring``'s forward and backward on fp32
    SwiGLU experts, every expert with tokens on every rank."""
    from megatron_tsp.core.layers.mlp import MLPActivation
    from megatron_tsp.core.layers.moe_ring import tsp_expert_ring
    from tests.checks_comm import trace_forward_backward

    _ensure_groups(d, 1, d)
    group = tsp_state.get_tensor_sequence_parallel_group()
    shards = []
    for _ in range(experts):
        shards.append(torch.randn(2 * ffn // d, h, requires_grad=True))
        shards.append(torch.randn(h, ffn // d, requires_grad=True))
    counts = [tokens_per_expert] * experts
    x = torch.randn(sum(counts), h, requires_grad=True)
    act = MLPActivation(_swiglu)
    return trace_forward_backward(lambda: tsp_expert_ring(x, counts, shards, False, group, act))
