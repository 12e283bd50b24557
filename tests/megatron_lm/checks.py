"""Checks run inside every gloo rank (see tests/harness.py) for the Megatron-LM integration."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_tsp.core import parallel_state as tsp_state
from megatron_tsp.core import zigzag

STYLES = {
    # GPT-2-like: LayerNorm, GELU, biases, learned absolute positions, MHA.
    "gpt2": dict(
        config=dict(
            normalization="LayerNorm",
            gated_linear_unit=False,
            activation_func=F.gelu,
            add_bias_linear=True,
        ),
        position_embedding_type="learned_absolute",
    ),
    # Llama-like: RMSNorm, SwiGLU, no biases, RoPE, GQA (--group-query-attention).
    "llama": dict(
        config=dict(
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            num_query_groups=2,
        ),
        position_embedding_type="rope",
    ),
    # Llama-like with one K/V head (fewer than D=2: megatron-core's TP layout, shared K/V head)
    "llama-mqa": dict(
        config=dict(
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            num_query_groups=1,
        ),
        position_embedding_type="rope",
    ),
}
HEADS, HIDDEN, FFN, LAYERS, VOCAB, SEQ, BATCH = 4, 32, 64, 2, 128, 32, 2


def _groups(d: int, seed: int) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not (
        tsp_state.is_tensor_sequence_parallel()
        and tsp_state.get_tensor_sequence_parallel_world_size() == d
    ):
        tsp_state.destroy_model_parallel()
        tsp_state.initialize_model_parallel(
            tensor_sequence_parallel_size=d, create_gloo_process_groups=False
        )
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def _config(d: int, style: str, dtype=torch.float32):
    """Megatron-LM's defaults (fusions included, see tests.common.make_config) for this style."""
    from tests.common import make_config

    return make_config(
        d,
        dtype,
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        **STYLES[style]["config"],
    )


def _model(config, spec, style):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type=STYLES[style]["position_embedding_type"],
        share_embeddings_and_output_weights=False,
    )


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    loss_mask = (torch.rand(BATCH, SEQ, generator=g) > 0.3).float()
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ).contiguous()
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)
    attention_mask = causal.expand(BATCH, 1, SEQ, SEQ).contiguous()
    return dict(
        tokens=tokens,
        labels=labels,
        loss_mask=loss_mask,
        attention_mask=attention_mask,
        position_ids=position_ids,
    )


def megatron_loss(model, batch):
    """``pretrain_gpt.forward_step`` + ``loss_func``: (sum of masked token losses, token count)."""
    losses = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    mask = batch["loss_mask"].view(-1).float()
    return torch.sum(losses.view(-1).float() * mask), mask.sum().to(torch.int)


# --------------------------------------------------------------------------------------------


def check_batch_hook(seed: int) -> dict:
    """The wrapped ``get_batch_on_this_cp_rank`` zigzags on the TSP group, only when active; the
    expected batch is built from the chunk definition (``tests.common.expected_zigzag_batch``),
    not by the function under test. Installing twice (the launcher and a patched
    ``pretrain_gpt.py`` both call ``install()``) must still permute once, and uninstalling must
    restore Megatron's own function."""
    import megatron.core.utils as core_utils

    from megatron_tsp.megatron_lm import batch as hook
    from tests.common import expected_zigzag_batch

    d = dist.get_world_size()
    _groups(d, seed)
    original = core_utils.get_batch_on_this_cp_rank
    hook.install_batch_hook()
    hook.install_batch_hook()  # second install: a no-op
    try:
        wrapped = core_utils.get_batch_on_this_cp_rank
        assert wrapped is not original and wrapped.__wrapped_by_tsp__ is original, (
            "installing twice wrapped the wrapper"
        )
        batch = _batch(seed)
        hook.activate(None)
        passthrough = wrapped(dict(batch))
        assert all(torch.equal(passthrough[k], batch[k]) for k in batch)
        hook.activate(d)
        out = wrapped(dict(batch))
        expected = expected_zigzag_batch(batch, d)
        assert set(out) == set(batch)
        for key in batch:
            if key != "attention_mask":
                assert torch.equal(out[key], expected[key]), (
                    f"{key}: the hooked batch is not the zigzag permutation (chunks r and 2D-1-r)"
                )
        # the S x S mask is left alone (TSP attention never reads it), not permuted twice
        assert out["attention_mask"] is batch["attention_mask"]
        from megatron_tsp.core import batch_guard

        assert batch_guard.zigzag_mark(out["tokens"]) == d
        assert batch_guard.zigzag_mark(batch["tokens"]) is None
        # contiguous SP shard r of the permuted tokens == zigzag chunks r and 2D-1-r
        r = dist.get_rank()
        chunks = batch["tokens"].chunk(2 * d, dim=1)
        local = out["tokens"].chunk(d, dim=1)[r]
        assert torch.equal(local, torch.cat([chunks[r], chunks[2 * d - 1 - r]], dim=1))
        assert not torch.equal(out["tokens"], batch["tokens"])
        # the generic helper still permutes a mask on both axes (causal mask of true positions)
        pos = out["position_ids"][0]
        assert torch.equal(expected["attention_mask"][0, 0], pos.unsqueeze(1) < pos.unsqueeze(0))
        errors = {}
        try:
            wrapped(dict(batch, cu_seqlens=torch.tensor([0, SEQ])))
        except ValueError as exc:
            errors["packed"] = str(exc)
        # --reset-position-ids: positions restart after an EOD; refused before the zigzag
        restarted = batch["position_ids"].clone()
        restarted[:, SEQ // 2 :] -= SEQ // 2
        try:
            wrapped(dict(batch, position_ids=restarted))
        except ValueError as exc:
            errors["positions"] = str(exc)
        hook.activate(2 * d)
        try:
            wrapped(dict(batch))
        except RuntimeError as exc:
            errors["size"] = str(exc)
        assert errors.get("packed") == (
            "TSP got a packed (THD) batch with cu_seqlens (2 boundaries): packed sequences are "
            "not supported under TSP yet; drop --sft / --dataloader-inter-document-masking"
        ), errors
        assert "--reset-position-ids" in errors.get("positions", ""), errors
        assert f"sequence 0 holds 0 at index {SEQ // 2}" in errors["positions"], errors
        assert errors.get("size") == (
            f"--tensor-sequence-parallel-size={2 * d} but the tensor-parallel group has {d} ranks"
        ), errors
    finally:
        hook.activate(None)
        hook.uninstall_batch_hook()
    assert core_utils.get_batch_on_this_cp_rank is original, "uninstall did not restore Megatron's"
    return {"ok": True}


EOD = 7


def _packed_batch(seed: int, create_attention_mask: bool) -> dict:
    """Megatron's GPT dataset batch with both document flags (megatron-core's own
    ``_get_ltor_masks_and_position_ids``): EODs inside the sequences, one back to back, one at
    the last index."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    g = torch.Generator().manual_seed(seed)
    rows = {"tokens": [], "attention_mask": [], "position_ids": []}
    for sample in range(BATCH):
        tokens = torch.randint(0, VOCAB, (SEQ,), generator=g)
        tokens[tokens == EOD] = EOD + 1
        ends = torch.randperm(SEQ, generator=g)[:3].tolist() + [[9, 10], [SEQ - 1]][sample % 2]
        tokens[ends] = EOD
        mask, _, positions = _get_ltor_masks_and_position_ids(
            tokens, EOD, True, True, False, create_attention_mask
        )
        rows["tokens"].append(tokens)
        rows["attention_mask"].append(mask)
        rows["position_ids"].append(positions)
    batch = _batch(seed)
    batch["tokens"] = torch.stack(rows["tokens"])
    batch["position_ids"] = torch.stack(rows["position_ids"])
    batch["attention_mask"] = torch.stack(rows["attention_mask"]) if create_attention_mask else None
    return batch


def check_batch_hook_documents(seed: int) -> dict:
    """``--reset-attention-mask`` through the wrapped ``get_batch_on_this_cp_rank``: the batch
    without a dataloader mask (the launcher's) comes out zigzagged with the documents of
    Megatron's own dense mask in its ``attention_mask`` slot, read from the position-id restarts
    or after the EODs, and read *before* the CP split (a stand-in split that slices the dict in
    place, as Megatron's does, must not change them); ``--reset-position-ids`` alone keeps one
    document per sequence with the restarted ids permuted."""
    from megatron_tsp.core.documents import DocumentMask, as_documents
    from megatron_tsp.megatron_lm import batch as hook
    from megatron_tsp.megatron_lm.documents import DocumentRule
    from tests.common import expected_zigzag_batch

    d = dist.get_world_size()
    _groups(d, seed)
    reference = DocumentMask.from_attention_mask(_packed_batch(seed, True)["attention_mask"])
    assert not reference.is_single_document
    both = DocumentRule(reset_attention_mask=True, reset_position_ids=True, eod=lambda: -1)
    eod_only = DocumentRule(reset_attention_mask=True, eod=EOD)
    positions_only = DocumentRule(reset_position_ids=True, eod=EOD)

    def megatron_cp_split(batch):  # slices in place like Megatron's CP split (CP rank 0 of 2)
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            batch[key] = batch[key][:, : SEQ // 2]
        return batch

    try:
        for rule, natural_positions in ((both, False), (eod_only, True)):
            hook.activate(d, rule)
            batch = _packed_batch(seed, False)
            if natural_positions:  # --reset-attention-mask alone: positions are arange
                batch["position_ids"] = _batch(seed)["position_ids"]
            out = hook._wrap(lambda b: b)(dict(batch))
            assert as_documents(out["attention_mask"]) == reference, rule
            expected = expected_zigzag_batch(batch, d)
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                assert torch.equal(out[key], expected[key]), key
            split = hook._wrap(megatron_cp_split)(dict(batch))
            assert as_documents(split["attention_mask"]) == reference
            assert split["tokens"].shape[1] == SEQ // 2
        hook.activate(d, positions_only)
        batch = _packed_batch(seed, False)
        out = hook._wrap(lambda b: b)(dict(batch))
        assert out["attention_mask"] is None
        assert torch.equal(out["position_ids"], expected_zigzag_batch(batch, d)["position_ids"])
        # no document in the batch (no EOD): one causal document, today's path
        hook.activate(d, eod_only)
        plain = _batch(seed)
        plain["attention_mask"] = None
        plain["tokens"][plain["tokens"] == EOD] = EOD + 1
        assert hook._wrap(lambda b: b)(dict(plain))["attention_mask"] is None
    finally:
        hook.activate(None)
    return {"ok": True}


def check_spec_hook_and_loss(seed: int, style: str) -> dict:
    """``GPTModel(transformer_layer_spec=tsp_block_spec)`` (what ``--spec`` hands Megatron) builds
    the TSP model; on the zigzagged batch its Megatron loss sum and token count equal the stock
    TP=D+SP model's on the natural batch (same weights)."""
    from megatron_tsp.core.layers.attention import TSPSelfAttention
    from megatron_tsp.core.layers.mlp import TSPMLP
    from megatron_tsp.megatron_lm import spec as spec_hook
    from tests.common import assert_close, reference_tp_sp_block_spec

    d = dist.get_world_size()
    _groups(d, seed)
    config = _config(d, style)
    stock = _model(config, reference_tp_sp_block_spec(config), style)
    spec_hook.install_gpt_model_hook()
    try:
        _groups(d, seed + 1)  # different init: the weights must come from the stock model
        tsp = _model(config, spec_hook.tsp_block_spec, style)
    finally:
        spec_hook.uninstall_gpt_model_hook()
    layer = tsp.decoder.layers[0]
    assert isinstance(layer.self_attention, TSPSelfAttention), type(layer.self_attention)
    assert isinstance(layer.mlp, TSPMLP), type(layer.mlp)
    assert len(tsp.decoder.layers) == LAYERS
    norm = tsp.decoder.final_layernorm
    want_norm = "RMSNorm" if config.normalization == "RMSNorm" else "LayerNorm"
    assert type(norm).__name__.endswith(want_norm), type(norm)
    assert getattr(norm.weight, "sequence_parallel", False)
    # --swiglu / --group-query-attention / --disable-bias-linear reach the TSP shards
    fc1 = layer.mlp.linear_fc1.weight
    assert fc1.shape[0] == FFN * (2 if config.gated_linear_unit else 1) // d
    head_dim = HIDDEN // HEADS
    qkv_rows = (HEADS + 2 * config.num_query_groups) * head_dim // d
    assert layer.self_attention.linear_qkv.weight.shape[0] == qkv_rows
    assert (layer.mlp.linear_fc1.bias is None) == (not config.add_bias_linear)
    has_rope = getattr(tsp, "rotary_pos_emb", None) is not None
    assert has_rope == (STYLES[style]["position_embedding_type"] == "rope")
    stock_state = {k: v for k, v in stock.state_dict().items()}
    assert set(stock_state) == set(tsp.state_dict())
    tsp.load_state_dict(stock_state, strict=True)

    batch = _batch(seed)
    ref_sum, ref_tokens = megatron_loss(stock, batch)
    tsp_batch = zigzag.get_batch_on_this_tsp_rank(batch, d)
    tsp_sum, tsp_tokens = megatron_loss(tsp, tsp_batch)
    assert int(tsp_tokens) == int(ref_tokens)
    errors = assert_close(
        tsp_sum,
        ref_sum,
        rtol=1e-5,
        name="loss sum",
        what=f"--spec TSP model ({style}) vs stock TP={d}+SP, seed={seed}",
    )
    return {"loss_rel_err": errors["loss sum"], "tokens": int(tsp_tokens)}


def _sharded_layout(model):
    out = {}
    for key, sh in model.sharded_state_dict().items():
        out[key] = (type(sh).__name__,) + tuple(
            repr(getattr(sh, attr, None))
            for attr in (
                "global_shape",
                "global_offset",
                "axis_fragmentations",
                "replica_id",
                "local_shape",
                "dtype",
                "prepend_axis_num",
                "flattened_range",
            )
        )
    return out


def check_dist_checkpoint_interop(ckpt_root: str, seed: int, style: str) -> dict:
    """Megatron distributed checkpointing (torch_dist): TP=D+SP -> TSP-D and TSP-D -> TP=D+SP.

    Proves the sharded_state_dict of the TSP model has the stock model's keys, global shapes,
    offsets, fragmentation and replica ids, then saves with ``dist_checkpointing.save`` from one
    layout and loads with ``dist_checkpointing.load`` into the other (fresh weights from another
    seed), and checks weights and the Megatron loss.
    """
    import os

    from megatron.core import dist_checkpointing

    from megatron_tsp.megatron_lm import spec as spec_hook
    from tests.common import assert_close, reference_tp_sp_block_spec

    d = dist.get_world_size()
    config = _config(d, style)
    spec_hook.install_gpt_model_hook()
    # Megatron's torch_dist writer synchronizes the CUDA stream before reading tensors: nothing
    # to wait for on the CPU. (It also starts a multiprocessing Manager, so this check must run in
    # non-daemon ranks: see ckpt_roundtrip.py.)
    cuda_synchronize = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *args, **kwargs: None
    try:

        def build(kind: str, init_seed: int):
            _groups(d, init_seed)
            spec = spec_hook.tsp_block_spec if kind == "tsp" else reference_tp_sp_block_spec(config)
            return _model(config, spec, style)

        batch = _batch(seed)
        results = {}
        for src_kind, dst_kind in (("tp_sp", "tsp"), ("tsp", "tp_sp")):
            src = build(src_kind, seed)
            dst = build(dst_kind, seed + 11)
            layout_src, layout_dst = _sharded_layout(src), _sharded_layout(dst)
            assert layout_src == layout_dst, set(layout_src) ^ set(layout_dst)
            differs = any(
                not torch.equal(a, b)
                for a, b in zip(src.state_dict().values(), dst.state_dict().values())
                if torch.is_tensor(a)
            )
            assert differs, "the destination must start from different weights"
            path = os.path.join(ckpt_root, f"{src_kind}_to_{dst_kind}_{style}")
            if dist.get_rank() == 0:
                os.makedirs(path, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(src.sharded_state_dict(), path)
            loaded = dist_checkpointing.load(dst.sharded_state_dict(), path)
            dst.load_state_dict(loaded, strict=True)
            for (name, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
                if torch.is_tensor(a):
                    assert torch.equal(a, b), f"{src_kind}->{dst_kind}: {name} differs after load"
            ref_batch = (
                batch if src_kind == "tp_sp" else zigzag.get_batch_on_this_tsp_rank(batch, d)
            )
            out_batch = (
                batch if dst_kind == "tp_sp" else zigzag.get_batch_on_this_tsp_rank(batch, d)
            )
            with torch.no_grad():
                a, _ = megatron_loss(src, ref_batch)
                b, _ = megatron_loss(dst, out_batch)
            rel = assert_close(
                b,
                a,
                rtol=1e-5,
                name="loss sum",
                what=f"{src_kind}->{dst_kind} ({style}), seed={seed}",
            )["loss sum"]
            results[f"{src_kind}->{dst_kind}"] = rel
            results["keys"] = len(layout_src)
        return results
    finally:
        torch.cuda.synchronize = cuda_synchronize
        spec_hook.uninstall_gpt_model_hook()
