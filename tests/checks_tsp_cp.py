"""TSP x context parallelism checks run inside every rank (D*C ranks of the pool).

The sequence group is megatron-core's tensor-and-context-parallel group; a rank's tokens and the
reference rows it is compared with come from ``tests.common.zigzag_positions`` over D*C ranks
(the zigzag written from its definition), the sequence rank from q = cp_rank * D + tp_rank
(asserted against megatron-core's group), never from the package's layout.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

import tests.common as common
from megatron_tsp.core import parallel_state as tsp_state
from megatron_tsp.core import sharding, zigzag
from megatron_tsp.core.layout import TSPLayout
from megatron_tsp.core.specs import get_gpt_block_tsp_spec
from tests import checks_gpt
from tests.checks_layers import _grad_pairs, attention_with_random_weights, reference_attention
from tests.common import (
    DTYPES,
    TOL,
    assert_close,
    expected_zigzag_batch,
    make_config,
    single_rank_group,
    zigzag_positions,
    zigzag_rows,
)


def setup_tsp_cp(d: int, c: int, seed: int, expert_tensor_parallel_size: int = 1) -> dict:
    """Megatron groups for TSP=d x CP=c (re-created every call; the next ``setup_tsp`` of
    another check re-creates its own), experts sharded over ``expert_tensor_parallel_size``
    ranks. Returns the ranks and groups, with the sequence rank checked against the definition
    q = cp_rank * D + tp_rank."""
    tsp_state.destroy_model_parallel()
    common._current = ("tsp x cp", d, c)  # any later setup_tsp / setup_megatron_tp re-inits
    tsp_state.initialize_model_parallel(
        tensor_sequence_parallel_size=d,
        context_parallel_size=c,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        create_gloo_process_groups=False,
    )
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    tp = tsp_state.get_tensor_sequence_parallel_group()
    cp = mpu.get_context_parallel_group()
    seq = tsp_state.get_tensor_sequence_and_context_parallel_group()
    tp_rank, cp_rank, q = dist.get_rank(tp), dist.get_rank(cp), dist.get_rank(seq)
    assert dist.get_world_size(seq) == d * c, dist.get_world_size(seq)
    assert q == cp_rank * d + tp_rank, (q, cp_rank, tp_rank)
    assert TSPLayout.sequence_rank(tp_rank, cp_rank, d) == q
    return dict(tp=tp, cp=cp, seq=seq, tp_rank=tp_rank, cp_rank=cp_rank, q=q)


def _cp_local(full: torch.Tensor, c: int, cp_rank: int, dim: int = 0) -> torch.Tensor:
    """Megatron's CP split by its definition: CP chunks cp_rank and 2C-1-cp_rank of 2C."""
    chunks = full.chunk(2 * c, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * c - 1 - cp_rank]], dim=dim)


def _sum_over_cp(module, cp_group) -> None:
    """What Megatron's DDP does over DP x CP: every gradient summed over the CP ranks."""
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=cp_group)


def check_attention_cp(
    d,
    c,
    seed,
    dtype_name="float64",
    heads=8,
    groups=4,
    bias=True,
    rope=True,
    seq=32,
    batch=2,
    hidden=32,
    attention_backward="saved",
    kv_grad_all_to_all=False,
):
    """One TSP x CP attention layer vs full-sequence causal attention: output, input gradient,
    every weight gradient (summed over CP, then per TSP shard / over TSP for replicated ones)."""
    dtype = DTYPES[dtype_name]
    g = setup_tsp_cp(d, c, seed)
    config = make_config(
        d,
        dtype,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        add_bias_linear=bias,
        context_parallel_size=c,
    )
    config.tsp_kv_grad_all_to_all = kv_grad_all_to_all
    layer, full = attention_with_random_weights(config, attention_backward, seed, dtype, g["tp"])
    x_full = torch.randn(seq, batch, hidden, dtype=dtype)
    dy_full = torch.randn(seq, batch, hidden, dtype=dtype)
    freqs = local_freqs = None
    if rope:
        freqs = RotaryEmbedding(
            kv_channels=hidden // heads,
            rotary_percent=1.0,
            use_cpu_initialization=True,
            cp_group=single_rank_group(),  # the full table; the CP slice is taken below
        )(seq).to(dtype)
        local_freqs = _cp_local(freqs, c, g["cp_rank"])  # what Megatron's CP RoPE hands a rank

    ref = {n: t.clone().requires_grad_(True) for n, t in full.items()}
    xr = x_full.clone().requires_grad_(True)
    yr = reference_attention(
        xr,
        ref["linear_qkv.weight"],
        ref.get("linear_qkv.bias"),
        ref["linear_proj.weight"],
        ref.get("linear_proj.bias"),
        heads,
        groups,
        freqs,
        config,
    )
    yr.backward(dy_full)

    q = g["q"]
    x = zigzag_rows(x_full, d * c, q).requires_grad_(True)
    out, out_bias = layer(x, attention_mask=None, rotary_pos_emb=local_freqs)
    y = out + out_bias if out_bias is not None else out
    y.backward(zigzag_rows(dy_full, d * c, q))
    _sum_over_cp(layer, g["cp"])
    actual = {"output": y, "grad:input": x.grad}
    expected = {
        "output": zigzag_rows(yr, d * c, q),
        "grad:input": zigzag_rows(xr.grad, d * c, q),
    }
    _grad_pairs(layer, {n: t.grad for n, t in ref.items()}, g["tp"], actual, expected)
    return assert_close(
        actual,
        expected,
        rtol=TOL[dtype],
        what=f"TSP x CP attention D={d} C={c} {dtype_name} heads={heads}/{groups} "
        f"rope={rope} backward={attention_backward} seed={seed}",
    )


def check_cp_batch(d, c, seed, batch=2, seq=32, vocab=128):
    """The TSP x CP batch hook: CP rank c's slice is the D*C zigzag's slice c (definition), and
    equals Megatron's CP split followed by the D-rank zigzag."""
    g = setup_tsp_cp(d, c, seed)
    data = checks_gpt._batch(seed, batch, seq, vocab)
    data["attention_mask"] = torch.rand(batch, 1, seq, seq) > 0.5
    # a random mask: the index arithmetic on both axes, not the single-document contract
    local = zigzag.get_batch_on_this_tsp_rank(
        data, d, context_parallel_size=c, cp_rank=g["cp_rank"], check_single_document=False
    )
    every = zigzag_positions(seq, d * c)  # all D*C ranks' positions, in sequence-rank order
    mine = torch.tensor(every[g["cp_rank"] * seq // c : (g["cp_rank"] + 1) * seq // c])
    megatron_cp = {
        k: (_cp_local(_cp_local(v, c, g["cp_rank"], -1), c, g["cp_rank"], -2))
        if k == "attention_mask"
        else _cp_local(v, c, g["cp_rank"], 1)
        for k, v in data.items()
        if torch.is_tensor(v)
    }
    composed = expected_zigzag_batch(megatron_cp, d)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(local[key], data[key][:, mine]), key
        assert torch.equal(local[key], composed[key]), key
    # the attention mask: query rows = this CP rank's tokens, keys = the whole gathered order
    assert torch.equal(local["attention_mask"], data["attention_mask"][..., mine, :][..., every])
    # this rank's own tokens are its sequence rank's zigzag chunks
    shard = local["tokens"].chunk(d, dim=1)[g["tp_rank"]]
    assert torch.equal(shard, data["tokens"][:, zigzag_positions(seq, d * c, g["q"])])
    return True


def check_gpt_cp(
    d,
    c,
    seed,
    style,
    dtype_name="float64",
    groups=None,
    layers=2,
    hidden=32,
    heads=8,
    ffn=64,
    vocab=128,
    batch=2,
    seq=32,
    rtol=None,
    kv_channels=None,
):
    """A whole GPTModel under TSP x CP vs the single-process stock GPTModel: loss and every
    gradient (summed over CP as DDP does, replicated ones over TSP as finalize_model_grads
    does, then gathered to full size). ``kv_channels``: a head dimension other than hidden /
    heads."""
    dtype = DTYPES[dtype_name]
    ref_loss, ref_params, ref_grads, data = checks_gpt.reference_run(
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
        "exact",
        groups,
        kv_channels=kv_channels,
    )
    g = setup_tsp_cp(d, c, seed)
    config = checks_gpt._config(d, dtype, style, layers, hidden, heads, ffn, groups, kv_channels)
    config = dataclasses.replace(config, context_parallel_size=c)
    model = checks_gpt._model(config, get_gpt_block_tsp_spec(config), style, vocab, seq, False)
    sharding.load_full_state(model, ref_params, g["tp"])
    local = zigzag.get_batch_on_this_tsp_rank(
        data, d, context_parallel_size=c, cp_rank=g["cp_rank"]
    )
    logits = model(local["tokens"], local["position_ids"], None)
    losses = -torch.log_softmax(logits, -1).gather(-1, local["labels"].unsqueeze(-1)).squeeze(-1)
    # loss normalisation over the sequence axis: the global mask count, the CP ranks' sum
    part = (losses * local["loss_mask"].to(losses.dtype)).sum() / data["loss_mask"].sum()
    part.backward()
    loss = part.detach().clone()
    dist.all_reduce(loss, group=g["cp"])
    _sum_over_cp(model, g["cp"])
    sharding.allreduce_sequence_parallel_grads(model, g["tp"])
    grads = sharding.gather_full_state(model, g["tp"], grads=True)
    actual = {"loss": loss, **{f"grad:{n}": t for n, t in grads.items()}}
    expected = {"loss": ref_loss, **{f"grad:{n}": t for n, t in ref_grads.items()}}
    return assert_close(
        actual,
        expected,
        rtol=rtol if rtol is not None else TOL[dtype],
        what=f"TSP x CP GPT ({style}, D={d}, C={c}, groups={config.num_query_groups}, "
        f"kv_channels={config.kv_channels}, "
        f"{dtype_name}) vs single-process stock GPTModel, seed={seed}",
    )
