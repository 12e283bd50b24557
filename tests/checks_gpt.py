"""End-to-end GPTModel checks run inside every rank."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel

from megatron_tsp.core import output_head, sharding, zigzag
from megatron_tsp.core.specs import get_gpt_block_tsp_spec
from tests.common import (
    DTYPES,
    TOL,
    assert_close,
    group_info,
    make_config,
    reference_single_layer_spec,
    reference_tp_sp_block_spec,
    setup_megatron_tp,
    setup_tsp,
)

STYLES = {
    "gpt2": dict(
        normalization="LayerNorm",
        gated_linear_unit=False,
        activation_func=F.gelu,
        add_bias_linear=True,
        position_embedding_type="learned_absolute",
        num_query_groups=None,
    ),
    "llama": dict(
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        position_embedding_type="rope",
        num_query_groups=4,
    ),
}


def _config(d, dtype, style, layers, hidden, heads, ffn, groups=None, kv_channels=None):
    """``kv_channels``: the head dimension when it is not hidden / heads (``--kv-channels``)."""
    s = dict(STYLES[style])
    s.pop("position_embedding_type")
    if groups is not None:  # e.g. fewer K/V heads than D
        s["num_query_groups"] = groups
    if s["num_query_groups"] is None:
        s["num_query_groups"] = heads
    if kv_channels is not None:
        s["kv_channels"] = kv_channels
    return make_config(
        d,
        dtype,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=ffn,
        **s,
    )


def _model(config, spec, style, vocab, seq, parallel_output=True, tied=False):
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=seq,
        parallel_output=parallel_output,
        position_embedding_type=STYLES[style]["position_embedding_type"],
        share_embeddings_and_output_weights=tied,
    )


def _batch(seed, batch, seq, vocab):
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    loss_mask = (torch.rand(batch, seq, generator=g) > 0.3).float()
    loss_mask[0, 0] = 1.0
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq).contiguous()
    return dict(
        tokens=tokens,
        labels=labels,
        loss_mask=loss_mask,
        position_ids=position_ids,
        attention_mask=None,
    )


def _step(model, batch, loss_path):
    """Masked mean token loss, normalised like the single-device objective, then backward.

    ``loss_path='megatron'``: Megatron's vocab-parallel cross-entropy (computes in fp32).
    ``loss_path='exact'``: vocab-gathered logits and a cross-entropy in the model's dtype.
    """
    if loss_path == "megatron":
        losses = model(
            batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
        )
    else:
        logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        losses = (
            -torch.log_softmax(logits, dim=-1).gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
        )
    mask = batch["loss_mask"].to(losses.dtype)
    loss = (losses * mask).sum() / mask.sum()
    loss.backward()
    return loss.detach()


@contextlib.contextmanager
def _ring_calls():
    """Count the model calls that computed their loss on the vocabulary ring."""
    calls, original = [], output_head.ring_loss
    output_head.ring_loss = lambda *a: (calls.append(1), original(*a))[1]
    try:
        yield calls
    finally:
        output_head.ring_loss = original


def _norms_to(model, dtype):
    """megatron-core's CPU norm (``WrappedTorchNorm``) builds torch norms in the default dtype
    whatever ``params_dtype`` is; cast just those (other parameters stay exactly as Megatron made
    them, e.g. the fp32 learned position embedding, as in the model under test)."""
    for module in model.modules():
        if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
            module.to(dtype)
    return model


def reference_run(
    style,
    seed,
    dtype,
    layers,
    hidden,
    heads,
    ffn,
    vocab,
    batch,
    seq,
    loss_path,
    groups=None,
    tied=False,
    kv_channels=None,
):
    """Single-device stock GPTModel (TP=1, Megatron's local spec and norms): loss, params and
    grads."""
    setup_megatron_tp(1, seed)
    config = _config(1, dtype, style, layers, hidden, heads, ffn, groups, kv_channels)
    model = _model(
        config,
        reference_single_layer_spec(config),
        style,
        vocab,
        seq,
        parallel_output=loss_path == "megatron",
        tied=tied,
    )
    _norms_to(model, dtype)
    data = _batch(seed, batch, seq, vocab)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = _step(model, data, loss_path)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss, params, grads, data


def check_gpt_vs_single(
    d,
    seed,
    style,
    dtype_name="float64",
    layers=2,
    hidden=32,
    heads=8,
    ffn=64,
    vocab=128,
    batch=2,
    seq=32,
    baseline="tsp",
    loss_path="exact",
    rtol=None,
    groups=None,
    vocab_ring=False,
    tied=False,
    kv_channels=None,
):
    """TSP (or the stock Megatron TP=d+SP reference, ``baseline='tp_sp'``) GPTModel vs the TP=1
    stock model: loss and every gradient, gathered to full size. ``groups``: num_query_groups
    instead of the style's. ``vocab_ring``: the TSP model's loss on the vocabulary ring
    (``output_head``, the model called with labels) against the reference's ``loss_path``.
    ``tied``: input and output embeddings shared. ``kv_channels``: a head dimension other than
    hidden / heads."""
    dtype = DTYPES[dtype_name]
    ref_loss, ref_params, ref_grads, data = reference_run(
        style,
        seed,
        dtype,
        layers,
        hidden,
        heads,
        ffn,
        vocab,
        batch,
        seq,
        loss_path,
        groups,
        tied,
        kv_channels=kv_channels,
    )
    if baseline == "tsp":
        setup_tsp(d, seed)
    else:
        setup_megatron_tp(d, seed)
    group, size, rank = group_info() if baseline == "tsp" else _tp_group_info()
    config = _config(d, dtype, style, layers, hidden, heads, ffn, groups, kv_channels)
    spec = (get_gpt_block_tsp_spec if baseline == "tsp" else reference_tp_sp_block_spec)(config)
    model = _model(config, spec, style, vocab, seq, loss_path == "megatron" or vocab_ring, tied)
    if vocab_ring:
        output_head.install(model, policy="always")
    sharding.load_full_state(model, ref_params, group)
    local = zigzag.get_batch_on_this_tsp_rank(data, size) if baseline == "tsp" else data
    with _ring_calls() as calls:
        loss = _step(model, local, "megatron" if vocab_ring else loss_path)
    assert len(calls) == (1 if vocab_ring else 0), f"vocab ring ran {len(calls)} times"
    sharding.allreduce_sequence_parallel_grads(model, group)
    grads = sharding.gather_full_state(model, group, grads=True)
    actual = {"loss": loss, **{f"grad:{n}": g for n, g in grads.items()}}
    expected = {"loss": ref_loss, **{f"grad:{n}": g for n, g in ref_grads.items()}}
    return assert_close(
        actual,
        expected,
        rtol=rtol if rtol is not None else TOL[dtype],
        what=f"{baseline} GPT ({style}, D={d}, groups={config.num_query_groups}, "
        f"kv_channels={config.kv_channels}, hidden={hidden}, {dtype_name}, "
        f"loss={loss_path}, vocab_ring={vocab_ring}, tied={tied}) "
        f"vs single-process stock GPTModel, seed={seed}",
    )


def _tp_group_info():
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    group = mpu.get_tensor_model_parallel_group()
    return group, dist.get_world_size(group), dist.get_rank(group)


def check_tsp_vs_tp_sp(
    d,
    seed,
    style,
    dtype_name="float64",
    loss_path="exact",
    layers=2,
    hidden=32,
    heads=8,
    ffn=64,
    vocab=128,
    batch=2,
    seq=32,
    rtol=None,
    groups=None,
    vocab_ring=False,
    tied=False,
    kv_channels=None,
):
    """(c)+(d): Megatron TP=d+SP and TSP-d on the same ranks and weights. ``vocab_ring``: the
    TSP model's loss on the vocabulary ring (``output_head``; Megatron's loss path for both);
    ``tied``: input and output embeddings shared; ``kv_channels``: a head dimension other than
    hidden / heads.

    The TP+SP model is stock megatron-core (``reference_tp_sp_block_spec``: Megatron's local layer
    spec, norms written from their formula) initialised by Megatron; its ``state_dict`` (this rank's
    shards) loads into the TSP model with ``strict=True``; both run one step on the same batch and
    must give the same loss and the same gradient shards. Then the reverse: a TSP model initialised
    by Megatron with another seed equals a TP+SP model initialised with that seed, and its
    state_dict loads into a fresh TP+SP model.
    """
    dtype = DTYPES[dtype_name]
    data = _batch(seed, batch, seq, vocab)

    setup_megatron_tp(d, seed)
    group, size, rank = _tp_group_info()
    config = _config(d, dtype, style, layers, hidden, heads, ffn, groups, kv_channels)
    po = loss_path == "megatron"
    tp_model = _model(config, reference_tp_sp_block_spec(config), style, vocab, seq, po, tied)
    tp_state = {k: v.clone() if torch.is_tensor(v) else v for k, v in tp_model.state_dict().items()}
    tp_loss = _step(tp_model, data, loss_path)
    sharding.allreduce_sequence_parallel_grads(tp_model, group)
    tp_grads = {n: p.grad.clone() for n, p in tp_model.named_parameters()}

    setup_tsp(d, seed)
    tsp_model = _model(config, get_gpt_block_tsp_spec(config), style, vocab, seq, po, tied)
    if vocab_ring:
        output_head.install(tsp_model, policy="always")
    _assert_same_layout(tp_model, tsp_model)
    tsp_model.load_state_dict(tp_state, strict=True)
    with _ring_calls() as calls:
        tsp_loss = _step(tsp_model, zigzag.get_batch_on_this_tsp_rank(data, size), loss_path)
    assert len(calls) == (1 if vocab_ring else 0), f"vocab ring ran {len(calls)} times"
    sharding.allreduce_sequence_parallel_grads(tsp_model, group)
    actual = {"loss": tsp_loss}
    expected = {"loss": tp_loss}
    for name, param in tsp_model.named_parameters():
        actual[f"grad:{name}"] = param.grad
        expected[f"grad:{name}"] = tp_grads[name]
    out = assert_close(
        actual,
        expected,
        rtol=rtol if rtol is not None else TOL[dtype],
        what=f"TSP vs stock Megatron TP={d}+SP GPT ({style}, groups={config.num_query_groups}, "
        f"kv_channels={config.kv_channels}, hidden={hidden}, "
        f"{dtype_name}, loss={loss_path}, vocab_ring={vocab_ring}, tied={tied}), seed={seed}",
    )
    if vocab_ring:
        return out

    # Reverse direction, and identical initialisation from the same seed.
    init_seed = seed + 7
    setup_tsp(d, init_seed)
    tsp_init = _model(config, get_gpt_block_tsp_spec(config), style, vocab, seq, po)
    setup_megatron_tp(d, init_seed)
    tp_init = _model(config, reference_tp_sp_block_spec(config), style, vocab, seq, po)
    for (n1, p1), (n2, p2) in zip(tsp_init.named_parameters(), tp_init.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), f"{n1}: TSP init differs from TP=D init"
    fresh = _model(config, reference_tp_sp_block_spec(config), style, vocab, seq, po)
    fresh.load_state_dict(tsp_init.state_dict(), strict=True)
    for (n1, p1), (_, p2) in zip(fresh.named_parameters(), tsp_init.named_parameters()):
        assert torch.equal(p1, p2), n1
    return out


def _assert_same_layout(a, b):
    """Same parameter names, shapes, dtypes and tensor-parallel attributes."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert list(pa) == list(pb), set(pa) ^ set(pb)
    for name in pa:
        x, y = pa[name], pb[name]
        assert x.shape == y.shape and x.dtype == y.dtype, name
        for attr in (
            "tensor_model_parallel",
            "partition_dim",
            "partition_stride",
            "sequence_parallel",
        ):
            assert getattr(x, attr, None) == getattr(y, attr, None), (name, attr)
    assert set(a.state_dict()) == set(b.state_dict())


def arm_faulthandler(seconds=60):
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(seconds, exit=False, file=sys.stderr)
