"""One model description everywhere: checks run inside every rank of the pool.

Each math-changing option is switched on in a single-process stock megatron-core model (the
reference, no cache, full forward per token) and in a TSP model built by ``build_tsp_gpt_model``
with the same config and GPTModel arguments; the engine is given nothing but the model, so the
decode model must read the option off it.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from megatron_tsp.core import sharding
from megatron_tsp.core.model import build_tsp_gpt_model
from megatron_tsp.inference import TSPInferenceEngine
from megatron_tsp.inference.engine import build_decode_model, check_decode_model
from tests.checks_gpt import _config, _norms_to
from tests.checks_inference import MAX_POS, SIZES, VOCAB, _greedy_reference, _prompts
from tests.common import (
    group_info,
    reference_single_layer_spec,
    rel_err,
    setup_megatron_tp,
    setup_tsp,
)

# name -> (TransformerConfig overrides, GPTModel arguments) on top of the Llama style (RMSNorm,
# SwiGLU, RoPE, 4 KV groups of 8 heads, untied embeddings). RoPE base 5e5 in the Llama-3 case puts
# the head's lowest frequency in the band the scaling smooths (head_dim 4: wavelength ~4.4k
# positions, between 8192/4 and 8192), so the option changes the table.
OPTIONS = {
    "linear_interpolation_4": ({}, dict(seq_len_interpolation_factor=4.0)),
    "llama3_rope_scaling_8": (
        {},
        dict(rope_scaling=True, rope_scaling_factor=8.0, rotary_base=500000),
    ),
    "rotary_base_5e5": ({}, dict(rotary_base=500000)),
    "rotary_interleaved": (dict(rotary_interleaved=True), {}),
    "rotary_percent_0.5": ({}, dict(rotary_percent=0.5)),
    "rmsnorm_eps_0.1": (dict(layernorm_epsilon=0.1), {}),
    "qkv_bias": (dict(add_qkv_bias=True), {}),
    # As few KV groups as D allows (one per rank: 2 at D=2, the base's 4 at D=4); fewer groups
    # than D: test_gpt.py::test_fewer_kv_heads_than_d.
    "gqa_groups_eq_d": (dict(num_query_groups="d"), {}),
    "tied_embeddings": ({}, dict(share_embeddings_and_output_weights=True)),
    # the attention scale off 1/sqrt(head dim), and NoPE on every second layer (no_rope_freq=2:
    # that layer ignores the RoPE table), read by TSP prefill as by the training layer
    "softmax_scale_0.3": (dict(softmax_scale=0.3), {}),
    "nope_every_2nd_layer": (dict(no_rope_freq=2), {}),
}
BASE_GPT = dict(position_embedding_type="rope", share_embeddings_and_output_weights=False)


def _option_config(d, dtype, overrides):
    config = _config(
        d, dtype, "llama", SIZES["layers"], SIZES["hidden"], SIZES["heads"], SIZES["ffn"]
    )
    return dataclasses.replace(config, **overrides) if overrides else config


def _stock(config, gpt):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=config,
        transformer_layer_spec=reference_single_layer_spec(config),
        vocab_size=VOCAB,
        max_sequence_length=MAX_POS,
        parallel_output=False,
        **gpt,
    )


def _sharpen(model, seed):
    """Make positions matter: with Megatron's init (std 0.02) the attention scores of this tiny
    model are ~0.05, softmax is nearly uniform and RoPE changes no token; QKV weights x15 make
    them O(5). Megatron initialises biases to zero: random QKV biases make that option visible."""
    g = torch.Generator().manual_seed(seed + 5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_qkv.weight"):
                p.mul_(15.0)
            if name.endswith("linear_qkv.bias"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)


def _engine_for(d, seed, dtype, overrides, gpt, full):
    setup_tsp(d, seed)
    group, _, _ = group_info()
    config = _option_config(d, dtype, dict(overrides, perform_initialization=False))
    model = build_tsp_gpt_model(config, vocab_size=VOCAB, max_sequence_length=MAX_POS, **gpt)
    model = _norms_to(model, dtype)
    sharding.load_full_state(model, full, group)
    return TSPInferenceEngine(model)  # nothing but the model


def check_options_generate_like_single_process(d, seed, new_tokens=3, names=None):
    """For each option: greedy tokens from TSP prefill (length not a multiple of 2D), from the
    TP fallback (prompt shorter than 2D) and from a mixed-length batch equal the single-process
    model's; the rotary table or config really differs from the Llama base (the option is not
    a no-op, so dropping it would fail)."""
    dtype = torch.float64
    out = {}
    worst = 0.0
    for name in names or OPTIONS:
        overrides, extra = OPTIONS[name]
        overrides = {k: d if v == "d" else v for k, v in overrides.items()}
        gpt = dict(BASE_GPT, **extra)
        setup_megatron_tp(1, seed)
        ref = _norms_to(_stock(_option_config(1, dtype, overrides), gpt), dtype).eval()
        _sharpen(ref, seed)
        full = {n: p.detach().clone() for n, p in ref.named_parameters()}
        table = ref.rotary_pos_emb(MAX_POS)
        if extra and "share_embeddings_and_output_weights" not in extra:
            plain = _stock(_option_config(1, dtype, {}), BASE_GPT).rotary_pos_emb(MAX_POS)
            if plain.shape == table.shape and torch.equal(plain, table):
                raise AssertionError(f"{name}: the option does not change the rotary table")
        engine = _engine_for(d, seed, dtype, overrides, gpt, full)
        step = 2 * d
        results = {}
        for label, lengths in (
            ("tsp", [3 * step + 1, 3 * step + 1]),
            ("tp_fallback", [step - 1]),
            ("mixed", [2 * step, step + 2]),
        ):
            prompts = _prompts(seed + len(label), lengths)
            res = engine.generate(prompts, new_tokens)
            for i, p in enumerate(prompts):
                want, want_logits = _greedy_reference(ref, p, new_tokens)
                if len(p) == min(lengths):  # the prefilled row: its logits are the prefill's
                    err = rel_err(res.prefill_logits[i], want_logits)
                    worst = max(worst, err)
                    if err > 1e-10:
                        raise AssertionError(
                            f"option {name}, D={d}, {label} prefill ({res.prefill_mode}) logits "
                            f"off by {err:.1e} relative (seed {seed})"
                        )
                if res.tokens[i] != want:
                    raise AssertionError(
                        f"option {name}, D={d}, {label} prompt {i} (len {len(p)}): generated "
                        f"{res.tokens[i]}, single-process model {want} (seed {seed})"
                    )
            results[label] = res.prefill_mode
        out[name] = results
    out["worst_prefill_logits_err"] = worst
    return out


def check_decode_mismatch_names_the_field(d, seed):
    """A decode model that would compute something else raises naming the field: a GPTModel
    argument given to the engine (interpolation factor, base, scaling), a config field."""
    setup_megatron_tp(1, seed)
    dtype = torch.float64
    setup_tsp(d, seed)
    config = _option_config(d, dtype, {})
    # base 5e5: the lowest frequency is in the band Llama-3 scaling changes (see OPTIONS)
    gpt = dict(BASE_GPT, seq_len_interpolation_factor=4.0, rope_scaling=True, rotary_base=500000)
    model = build_tsp_gpt_model(config, vocab_size=VOCAB, max_sequence_length=MAX_POS, **gpt)
    messages = {}
    for needle, wrong in (
        ("seq_len_interpolation_factor", dict(seq_len_interpolation_factor=None)),
        ("rotary_base", dict(rotary_base=20000)),
        ("rope_scaling", dict(rope_scaling=False)),
        ("rope_scaling_factor", dict(rope_scaling_factor=4.0)),
        ("rotary_percent", dict(rotary_percent=0.5)),
    ):
        try:
            TSPInferenceEngine(model, **wrong)
        except ValueError as e:
            if needle not in str(e):
                raise AssertionError(f"mismatch in {needle}: message does not name it: {e}")
            messages[needle] = str(e)
        else:
            raise AssertionError(f"decode model with {wrong} was accepted")
    decode = build_decode_model(model)  # the model's own description: accepted
    check_decode_model(model, decode)
    for field, value in (("layernorm_epsilon", 0.5), ("rotary_interleaved", True)):
        decode.config = dataclasses.replace(decode.config, **{field: value})
        try:
            check_decode_model(model, decode)
        except ValueError as e:
            if f"config.{field}" not in str(e):
                raise AssertionError(f"config mismatch in {field} not named: {e}")
            messages[field] = str(e)
        else:
            raise AssertionError(f"config.{field} mismatch accepted")
        decode.config = dataclasses.replace(decode.config, **{field: getattr(model.config, field)})
    # A GPTModel built without the builder: its interpolation factor is read off the model.
    from megatron.core.models.gpt import GPTModel

    from megatron_tsp.core.specs import get_gpt_block_tsp_spec

    direct = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_block_tsp_spec(config),
        vocab_size=VOCAB,
        max_sequence_length=MAX_POS,
        position_embedding_type="rope",
        seq_len_interpolation_factor=4.0,
    )
    engine = TSPInferenceEngine(direct)
    assert engine.decode_model.rotary_pos_emb.seq_len_interpolation_factor == 4.0
    return messages


def check_load_full_state_without_initialization(d, seed):
    """``perform_initialization=False`` (Megatron leaves parallel weights unmarked): the builder
    marks them, ``load_full_state`` loads a full state (also into a GPTModel built directly from
    the TSP spec) and ``gather_full_state`` gives it back exactly; a sharded parameter that nothing
    marks raises an error that says what to do."""
    from megatron.core.models.gpt import GPTModel

    from megatron_tsp.core.specs import get_gpt_block_tsp_spec

    dtype = torch.float64
    setup_megatron_tp(1, seed)
    ref = _stock(_option_config(1, dtype, {}), BASE_GPT)
    full = {n: p.detach().clone() for n, p in ref.named_parameters()}
    setup_tsp(d, seed)
    group, _, _ = group_info()
    config = _option_config(d, dtype, dict(perform_initialization=False))
    built = build_tsp_gpt_model(config, vocab_size=VOCAB, max_sequence_length=MAX_POS, **BASE_GPT)
    fc1 = built.decoder.layers[0].mlp.linear_fc1.weight
    assert fc1.tensor_model_parallel and fc1.partition_stride == 2, vars(fc1)
    direct = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_block_tsp_spec(config),
        vocab_size=VOCAB,
        max_sequence_length=MAX_POS,
        **BASE_GPT,
    )
    # What megatron-core left unmarked (0.16: every Column/RowParallelLinear and embedding
    # weight; 0.19 marks some of them itself).
    unmarked = [n for n, p in direct.named_parameters() if not hasattr(p, "tensor_model_parallel")]
    worst = 0.0
    for model in (built, direct):
        sharding.load_full_state(model, full, group)
        back = sharding.gather_full_state(model, group)
        for name, value in full.items():
            worst = max(worst, (back[name] - value).abs().max().item())
    assert worst == 0.0, worst

    class Custom(torch.nn.Module):  # a sharded parameter Megatron knows nothing about
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4 // d, 3))

    try:
        sharding.load_full_state(Custom(), {"w": torch.zeros(4, 3)}, group)
    except ValueError as e:
        message = str(e)
        for needle in ("w:", "tensor_model_parallel", "partition_dim", "not marked"):
            assert needle in message, message
    else:
        raise AssertionError("an unmarked sharded parameter loaded silently")
    return message, unmarked


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def check_no_unknown_mlp_notice(d, seed):
    """Building TSP transformer layers logs no "Unknown MLP type" notice; the same TSPMLP under a
    plain ``ModuleSpec`` (a user's own spec) still gets it where the installed megatron-core logs
    it (0.16; 0.19 has no such notice). Returns (notices for TSP, notices for the control)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_tsp.core.specs import get_gpt_block_tsp_spec

    setup_tsp(d, seed)
    config = _option_config(d, torch.float64, {})
    logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    handler = _Records()
    logger.addHandler(handler)
    try:
        spec = get_gpt_block_tsp_spec(config)
        build_tsp_gpt_model(config, vocab_size=VOCAB, max_sequence_length=MAX_POS, **BASE_GPT)
        tsp = [m for m in handler.messages if "Unknown MLP type" in m]
        handler.messages.clear()
        layer = spec.layer_specs[0] if hasattr(spec, "layer_specs") else spec
        mlp = layer.submodules.mlp
        layer.submodules.mlp = ModuleSpec(
            module=mlp.module, params=mlp.params, submodules=mlp.submodules
        )
        from megatron.core.models.gpt import GPTModel

        GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=VOCAB,
            max_sequence_length=MAX_POS,
            **BASE_GPT,
        )
        control = [m for m in handler.messages if "Unknown MLP type" in m]
    finally:
        logger.removeHandler(handler)
    return tsp, control
