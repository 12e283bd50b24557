"""TSP prefill + TP decode checks, run inside every rank of the pool."""

from __future__ import annotations

import torch

from megatron_tsp.core import sharding
from megatron_tsp.core.specs import get_gpt_block_tsp_spec
from megatron_tsp.inference import SamplingParams, TSPInferenceEngine
from tests.checks_gpt import STYLES, _config, _norms_to
from tests.common import (
    DTYPES,
    group_info,
    reference_single_layer_spec,
    rel_err,
    setup_megatron_tp,
    setup_tsp,
)

SIZES = dict(layers=2, hidden=32, heads=8, ffn=64)
VOCAB, MAX_POS = 96, 64


def _gpt(config, spec, style):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=MAX_POS,
        parallel_output=False,
        position_embedding_type=STYLES[style]["position_embedding_type"],
        share_embeddings_and_output_weights=False,
    )


def _reference(style, seed, dtype, groups=None, kv_channels=None):
    """Single-process stock megatron-core GPTModel (TP=1, Megatron's local spec and CPU norms,
    not the package's specs), eval mode."""
    setup_megatron_tp(1, seed)
    config = _config(
        1,
        dtype,
        style,
        *(SIZES[k] for k in ("layers", "hidden", "heads", "ffn")),
        groups,
        kv_channels,
    )
    model = _norms_to(_gpt(config, reference_single_layer_spec(config), style), dtype).eval()
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}


@torch.no_grad()
def _greedy_reference(model, prompt, steps):
    """Full-sequence forwards without any cache: argmax of the last position, appended."""
    seq = list(prompt)
    out, first_logits = [], None
    for _ in range(steps):
        ids = torch.tensor([seq])
        pos = torch.arange(len(seq)).unsqueeze(0)
        logits = model(ids, pos, None)[0, -1]
        if first_logits is None:
            first_logits = logits
        tok = int(torch.argmax(logits))
        out.append(tok)
        seq.append(tok)
    return out, first_logits


def _engine(d, seed, style, dtype, params, groups=None, kv_channels=None):
    setup_tsp(d, seed)
    group, _, _ = group_info()
    config = _config(
        d,
        dtype,
        style,
        *(SIZES[k] for k in ("layers", "hidden", "heads", "ffn")),
        groups,
        kv_channels,
    )
    model = _gpt(config, get_gpt_block_tsp_spec(config), style)
    sharding.load_full_state(model, params, group)
    return TSPInferenceEngine(model), group


def _prompts(seed, lengths):
    g = torch.Generator().manual_seed(seed + 11)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _cache_err(a, b, length, batch):
    """Worst relative difference between two static contexts' caches over [0, length)."""
    assert a.key_value_memory_dict.keys() == b.key_value_memory_dict.keys()
    worst = 0.0
    for layer in a.key_value_memory_dict:
        for x, y in zip(a.key_value_memory_dict[layer], b.key_value_memory_dict[layer]):
            assert x.shape[1:] == y.shape[1:], (x.shape, y.shape)
            worst = max(worst, rel_err(x[:length, :batch], y[:length, :batch]))
    return worst


def check_generation(
    d, seed, style, dtype_name="float64", new_tokens=4, groups=None, kv_channels=None
):
    """Greedy TSP-prefill + TP-decode vs the single-process model; TSP cache / logits vs TP
    prefill's; two-chunk prefill vs one-shot; mixed-length batch; short prompt (TP fallback).
    ``groups``: num_query_groups instead of the style's (e.g. fewer K/V heads than D);
    ``kv_channels``: a head dimension other than hidden / heads."""
    dtype = DTYPES[dtype_name]
    ref, params = _reference(style, seed, dtype, groups, kv_channels)
    engine, _ = _engine(d, seed, style, dtype, params, groups, kv_channels)
    if kv_channels is not None:  # both models' heads (and caches) have the given dimension
        for model in (engine.tsp_model, engine.decode_model):
            head_dim = model.decoder.layers[0].self_attention.hidden_size_per_attention_head
            assert head_dim == kv_channels, (type(model).__name__, head_dim)
    step = 2 * d
    out = {}

    # Same-length batch, length not a multiple of 2D: TSP vs TP prefill, then decode.
    length = 3 * step + 1
    prompts = _prompts(seed, [length, length])
    tsp = engine.generate(prompts, new_tokens)
    tp = engine.generate(prompts, new_tokens, prefill="tp")
    assert tsp.prefill_mode == "tsp" and tp.prefill_mode == "tp"
    out["cache_tsp_vs_tp"] = _cache_err(tsp.context, tp.context, length + new_tokens - 1, 2)
    out["prefill_logits_tsp_vs_tp"] = rel_err(tsp.prefill_logits, tp.prefill_logits)
    import megatron_tsp.core.layers.prefill_attention as prefill_attention

    saved_block, prefill_attention.ROPE_BLOCK = prefill_attention.ROPE_BLOCK, 5
    try:  # chunked prefill, and RoPE of the gathered keys in blocks of 5 rows
        chunked = engine.generate(prompts, new_tokens, prefill_chunk_tokens=2 * step)
    finally:
        prefill_attention.ROPE_BLOCK = saved_block
    out["cache_chunked_vs_oneshot"] = _cache_err(
        chunked.context, tsp.context, length + new_tokens - 1, 2
    )
    out["prefill_logits_chunked_vs_oneshot"] = rel_err(chunked.prefill_logits, tsp.prefill_logits)
    for i, p in enumerate(prompts):
        want, ref_logits = _greedy_reference(ref, p, new_tokens)
        out[f"prefill_logits_vs_single[{i}]"] = rel_err(tsp.prefill_logits[i], ref_logits)
        for name, res in (("tsp", tsp), ("tp", tp), ("chunked", chunked)):
            if res.tokens[i] != want:
                raise AssertionError(
                    f"{name} prefill, prompt {i} (len {len(p)}): generated "
                    f"{res.tokens[i]}, single-process model {want} (seed {seed})"
                )

    # Mixed lengths (multiple of 2D, not, and below 2D -> TP fallback for the shared prefix).
    for lengths in ([2 * step, 2 * step - 3, step + 2], [step - 1, step + 3]):
        prompts = _prompts(seed + len(lengths), lengths)
        res = engine.generate(prompts, new_tokens)
        assert res.prefill_mode == ("tsp" if min(lengths) >= step else "tp"), res.prefill_mode
        for i, p in enumerate(prompts):
            want, _ = _greedy_reference(ref, p, new_tokens)
            if res.tokens[i] != want:
                raise AssertionError(
                    f"lengths {lengths}, prompt {i}: generated {res.tokens[i]}, "
                    f"single-process model {want} (seed {seed})"
                )
    return out


def check_sampling_and_errors(d, seed):
    """Sampled generation is identical on every rank and reproducible from the seed; top_k=1 is
    greedy; stop tokens end a row; bad requests raise ValueError naming the argument and leave
    the engine usable."""
    ref, params = _reference("llama", seed, torch.float64)
    engine, _ = _engine(d, seed, "llama", torch.float64, params)
    prompts = _prompts(seed, [4 * d + 1, 4 * d + 1])
    sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=seed)
    a = engine.generate(prompts, 6, sampled).tokens
    b = engine.generate(prompts, 6, sampled).tokens
    assert a == b, (a, b)
    greedy = engine.generate(prompts, 6).tokens
    assert engine.generate(prompts, 6, SamplingParams(temperature=1.0, top_k=1)).tokens == greedy
    stop = greedy[0][2]
    stopped = engine.generate(prompts, 6, stop_tokens=[stop]).tokens
    first = greedy[0].index(stop)
    assert stopped[0] == greedy[0][: first + 1], (stopped, greedy)
    errors = {}
    bad_requests = {
        "prompts[1] is empty": dict(prompts=[prompts[0], []], max_new_tokens=2),
        "max_new_tokens=": dict(prompts=prompts, max_new_tokens=MAX_POS),
        "temperature=": dict(
            prompts=prompts, max_new_tokens=2, sampling=SamplingParams(temperature=-1.0)
        ),
        "top_p=": dict(prompts=prompts, max_new_tokens=2, sampling=SamplingParams(top_p=1.5)),
        "top_k=": dict(prompts=prompts, max_new_tokens=2, sampling=SamplingParams(top_k=-2)),
        "prefill_chunk_tokens=": dict(
            prompts=prompts, max_new_tokens=2, prefill_chunk_tokens=2 * d + 1
        ),
        "outside the vocabulary": dict(prompts=[[VOCAB + 3]], max_new_tokens=2),
    }
    for needle, kwargs in bad_requests.items():
        try:
            engine.generate(**kwargs)
        except ValueError as e:
            if needle not in str(e):
                raise AssertionError(f"error for {needle!r} does not name it: {e}")
            errors[needle] = str(e)
        else:
            raise AssertionError(f"no error for {needle}")
    again = engine.generate(prompts, 6).tokens  # still usable after the errors
    assert again == greedy, (again, greedy)
    return {"sampled": a, "errors": errors}


def check_generation_cp(d, c, seed, style, dtype_name="float64", new_tokens=4, groups=None):
    """TSP x CP prefill (D*C ranks) + TP=D decode on CP rank 0: greedy tokens equal the
    single-process model's on every rank; on CP rank 0 the cache equals a TP=D prefill's and
    the prefill logits the single model's; chunked equals one-shot; the other CP ranks keep no
    cache and return CP rank 0's result; prompts shorter than 2DC fall back to TP prefill."""
    import dataclasses

    from tests.checks_tsp_cp import setup_tsp_cp

    dtype = DTYPES[dtype_name]
    ref, params = _reference(style, seed, dtype, groups)
    g = setup_tsp_cp(d, c, seed)
    config = _config(
        d, dtype, style, SIZES["layers"], SIZES["hidden"], SIZES["heads"], SIZES["ffn"], groups
    )
    config = dataclasses.replace(config, context_parallel_size=c)
    model = _gpt(config, get_gpt_block_tsp_spec(config), style)
    sharding.load_full_state(model, params, g["tp"])
    engine = TSPInferenceEngine(model)
    assert (engine.seq_size, engine.cp_size, engine.cp_rank) == (d * c, c, g["cp_rank"])
    serving = g["cp_rank"] == 0
    step = 2 * d * c
    out = {}

    length = 2 * step + 3  # not a multiple of 2DC: padded
    prompts = _prompts(seed, [length, length])
    tsp = engine.generate(prompts, new_tokens)
    tp = engine.generate(prompts, new_tokens, prefill="tp")
    chunked = engine.generate(prompts, new_tokens, prefill_chunk_tokens=step)
    assert tsp.prefill_mode == "tsp" and tp.prefill_mode == "tp"
    if serving:
        out["cache_tsp_vs_tp"] = _cache_err(tsp.context, tp.context, length + new_tokens - 1, 2)
        out["cache_chunked_vs_oneshot"] = _cache_err(
            chunked.context, tsp.context, length + new_tokens - 1, 2
        )
    else:
        for res in (tsp, tp, chunked):
            assert not res.context.key_value_memory_dict, "a CP rank > 0 kept a KV cache"
    out["prefill_logits_tsp_vs_tp"] = rel_err(tsp.prefill_logits, tp.prefill_logits)
    out["prefill_logits_chunked_vs_oneshot"] = rel_err(chunked.prefill_logits, tsp.prefill_logits)
    for i, p in enumerate(prompts):
        want, ref_logits = _greedy_reference(ref, p, new_tokens)
        out[f"prefill_logits_vs_single[{i}]"] = rel_err(tsp.prefill_logits[i], ref_logits)
        for name, res in (("tsp", tsp), ("tp", tp), ("chunked", chunked)):
            if res.tokens[i] != want:
                raise AssertionError(
                    f"TSP{d} x CP{c} {name} prefill, prompt {i} (len {len(p)}): generated "
                    f"{res.tokens[i]}, single-process model {want} (seed {seed})"
                )

    # Mixed lengths: a shared prefix of at least 2DC (TSP), and one below 2DC (TP fallback).
    for lengths in ([step + 5, step + 1], [step - 1, step + 2]):
        prompts = _prompts(seed + len(lengths) + lengths[0], lengths)
        res = engine.generate(prompts, new_tokens)
        assert res.prefill_mode == ("tsp" if min(lengths) >= step else "tp"), res.prefill_mode
        for i, p in enumerate(prompts):
            want, _ = _greedy_reference(ref, p, new_tokens)
            if res.tokens[i] != want:
                raise AssertionError(
                    f"TSP{d} x CP{c}, lengths {lengths}, prompt {i}: generated "
                    f"{res.tokens[i]}, single-process model {want} (seed {seed})"
                )
    try:
        engine.generate(prompts, 1, prefill_chunk_tokens=2 * d)
    except ValueError as e:
        assert f"= {step}" in str(e) and "context-parallel size" in str(e), str(e)
    else:
        raise AssertionError("prefill_chunk_tokens=2D was accepted under TSP x CP")
    return out
