"""One model description carried everywhere: options that change the math reach the
decode model, mismatches are errors naming the field, ``generate --load`` reads every checkpoint
setting, ``load_full_state`` without initialisation, and no "Unknown MLP type" notice."""

import pytest

from tests import checks_model_args


@pytest.mark.parametrize("d", [2, 4])
def test_each_option_generates_like_single_process(pool4, seed, d):
    """Linear interpolation x4, Llama-3 scaling x8, RoPE base, interleaved RoPE, rotary_percent
    0.5, RMSNorm eps, QKV biases, D KV groups, tied embeddings: TSP prefill + decode (and the TP
    fallback, and a mixed batch) give the single-process model's greedy tokens."""
    results = pool4.run(checks_model_args.check_options_generate_like_single_process, d, seed)
    assert set(results[0]) == set(checks_model_args.OPTIONS) | {"worst_prefill_logits_err"}
    print("worst prefill logits error", max(r["worst_prefill_logits_err"] for r in results))
    assert results[0]["linear_interpolation_4"]["tsp"] == "tsp"
    assert results[0]["linear_interpolation_4"]["tp_fallback"] == "tp"


def test_decode_mismatch_is_an_error_naming_the_field(pool4, seed):
    results = pool4.run(checks_model_args.check_decode_mismatch_names_the_field, 2, seed)
    assert set(results[0]) >= {"rotary_base", "rope_scaling_factor", "layernorm_epsilon"}


@pytest.mark.parametrize("d", [2, 4])
def test_load_full_state_without_initialization(pool4, seed, d):
    import megatron.core
    from packaging.version import Version

    results = pool4.run(checks_model_args.check_load_full_state_without_initialization, d, seed)
    message, unmarked = results[0]
    assert "not marked" in message
    if Version(megatron.core.__version__) < Version("0.19"):  # the case first met on 0.16
        assert any(n.endswith("linear_fc2.weight") for n in unmarked), unmarked


def test_no_unknown_mlp_notice_for_tsp_layers(pool4, seed):
    import megatron.core
    from packaging.version import Version

    results = pool4.run(checks_model_args.check_no_unknown_mlp_notice, 2, seed)
    tsp, control = results[0]  # megatron-core logs the notice on global rank 0 only
    assert tsp == []
    if Version(megatron.core.__version__) < Version("0.19"):
        assert control, "the control (plain ModuleSpec) should get 0.16's notice"


def test_megatron_args_mapping_reads_every_math_setting():
    """Checkpoint args -> config / GPTModel arguments: each setting reaches its field; GQA groups
    only under --group-query-attention (Megatron-LM's default num_query_groups=1 would otherwise
    turn every multi-head checkpoint into a multi-query model); refused settings name the flag."""
    import torch.nn.functional as F

    from megatron_tsp.megatron_lm.model_args import UnsupportedModelArgument, from_megatron_args

    base = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=1,
        group_query_attention=False,
        vocab_size=128,
        max_position_embeddings=256,
        position_embedding_type="rope",
    )
    plain = from_megatron_args(base)
    assert plain.config["num_query_groups"] == 8
    assert "kv_channels" not in plain.config  # TransformerConfig derives hidden / heads = 8
    assert plain.gpt["rope_scaling"] is False and plain.gpt["share_embeddings_and_output_weights"]
    m = from_megatron_args(
        dict(
            base,
            group_query_attention=True,
            num_query_groups=2,
            rotary_interleaved=True,
            use_rope_scaling=True,
            rope_scaling_factor=16.0,
            rotary_seq_len_interpolation_factor=4.0,
            rotary_percent=0.5,
            rotary_base=500000,
            normalization="RMSNorm",
            norm_epsilon=1e-6,
            swiglu=True,
            disable_bias_linear=True,
            add_qkv_bias=True,
            qk_layernorm=True,
            untie_embeddings_and_output_weights=True,
            padded_vocab_size=192,
            kv_channels=24,  # a head dimension other than hidden / heads = 8 (--kv-channels)
        )
    )
    assert m.config["kv_channels"] == 24
    assert m.config["num_query_groups"] == 2 and m.config["rotary_interleaved"]
    assert m.config["normalization"] == "RMSNorm" and m.config["layernorm_epsilon"] == 1e-6
    assert m.config["gated_linear_unit"] and m.config["activation_func"] is F.silu
    assert not m.config["add_bias_linear"] and m.config["add_qkv_bias"] and m.config["qk_layernorm"]
    assert m.gpt == dict(
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        rotary_percent=0.5,
        rotary_base=500000,
        rope_scaling=True,
        rope_scaling_factor=16.0,
        seq_len_interpolation_factor=4.0,
    )
    assert m.vocab_size == 192 and m.max_sequence_length == 256
    # A run config's model block names the groups without the flag.
    block = {k: v for k, v in base.items() if k != "group_query_attention"}
    assert from_megatron_args(dict(block, num_query_groups=2)).config["num_query_groups"] == 2
    for flag, value in (("num_experts", 8), ("multi_latent_attention", True)):
        with pytest.raises(UnsupportedModelArgument, match=f"--{flag.replace('_', '-')}"):
            from_megatron_args(dict(base, **{flag: value}))


def test_megatron_args_mapping_squared_relu():
    """--squared-relu maps to megatron-core's squared_relu activation (exclusive with --swiglu)."""
    import pytest
    from megatron.core.activations import squared_relu

    from megatron_tsp.megatron_lm.model_args import UnsupportedModelArgument, from_megatron_args

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=128)
    base.update(max_position_embeddings=256)
    m = from_megatron_args(dict(base, squared_relu=True))
    assert m.config["activation_func"] is squared_relu
    with pytest.raises(UnsupportedModelArgument, match="--squared-relu"):
        from_megatron_args(dict(base, squared_relu=True, swiglu=True))
