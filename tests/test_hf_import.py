"""Hugging Face Llama / Mistral / Qwen2 directories under TSP (``megatron_tsp.models.hf_import``,
``megatron-tsp generate --hf``): tiny random models saved with ``transformers`` in fp64 load under
D = 2 and 4; last-token logits equal HF's forward, greedy tokens equal HF's ``generate``; each rank
reads only its own slices; unsupported options are refused by name."""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_tsp.models import hf_import  # noqa: E402
from tests import checks_hf_import  # noqa: E402

SIZES = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
MODELS = {
    # Llama with GQA and RoPE base 5e5 with Llama-3.1 scaling (factor 8): its lowest frequency
    # (head_dim 4) lies in the band the scaling changes.
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            rms_norm_eps=1e-5,
        ),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=True)),
    # Qwen2: QKV biases; linear RoPE interpolation x4.
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0)),
    ),
}
NEW_TOKENS = 4


def _save_hf(kind, seed, root, spec=None):
    """``spec``: (config class, model class, changes to SIZES); ``MODELS[kind]`` by default."""
    config_cls, model_cls, extra = spec or MODELS[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**dict(SIZES, **extra))
    model = getattr(transformers, model_cls)(config).double().eval()
    with torch.no_grad():  # HF initialises biases to zero: random ones make Qwen2's visible
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    path = os.path.join(root, kind)
    model.save_pretrained(path)
    return model, path


def _hf_cases(model, seed, lengths):
    g = torch.Generator().manual_seed(seed + 3)
    cases = []
    for n in lengths:
        prompt = torch.randint(0, SIZES["vocab_size"], (1, n), generator=g)
        with torch.no_grad():
            logits = model(prompt).logits[0, -1]
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
        cases.append((prompt[0].tolist(), logits, out[0, n:].tolist()))
    return cases


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("d", [2, 4])
def test_hf_model_generates_like_hf(pool4, seed, tmp_path, kind, d):
    model, path = _save_hf(kind, seed, str(tmp_path))
    # TSP prefill (length not a multiple of 2D) and the TP fallback (shorter than 2D).
    cases = _hf_cases(model, seed, [6 * d + 1, 2 * d - 1])
    results = pool4.run(checks_hf_import.check_hf_generation, d, seed, path, cases)
    for r in results:
        # HF's fp64 forward is fp32 in places (RMSNorm upcasts to float32 and back, RoPE tables
        # are built in float32): measured 4e-8..1e-7 relative; the TSP model is fp64 throughout.
        assert max(r["errors"].values()) <= 1e-6, r["errors"]
        # Only its own slices: the shard's bytes (replicated norms once), well below the whole.
        assert r["read"] == r["expected"], r
        assert r["read"] < r["whole"] * 0.75, r


@pytest.fixture(scope="module")
def pool8():
    """Eight gloo ranks for D=8, started once for this module (only D=8 cases use it)."""
    from tests.harness import RankPool

    pool = RankPool(8)
    yield pool
    pool.close()


# Layouts the D-way split of the fused QKV weight must follow (megatron-core's TP=D layout):
# fewer K/V heads than D (a group's [q..., k, v] rows span D/ng row shards, its K/V rows in the
# last; at D=8 with 2 groups a shard is 1.5 heads, not head-aligned), and HF's head_dim != hidden /
# heads (Megatron's kv_channels: 8 instead of 32/8 = 4), with 2 K/V heads (= D at D=2).
FEWER_KV = {2: 1, 4: 2, 8: 2}
LAYOUTS = {
    # Qwen2: QKV biases, so the bias rows are split like the weight's.
    "qwen2_fewer_kv": lambda d: (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_key_value_heads=FEWER_KV[d]),
    ),
    "llama_head_dim": lambda d: (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(head_dim=8, num_key_value_heads=2),
    ),
}


def _check_against_hf(pool, seed, tmp_path, kind, d, spec, lengths=None):
    """Save a random fp64 HF model of ``spec`` (config class, model class, changes to SIZES), load
    it under TSP-D in ``pool``: greedy tokens equal HF's, last-token logits within 1e-6, each rank
    reads exactly its shard's bytes. Returns the per-rank results."""
    model, path = _save_hf(kind, seed, str(tmp_path), spec)
    cases = _hf_cases(model, seed, lengths or [6 * d + 1, 2 * d - 1])
    results = pool.run(checks_hf_import.check_hf_generation, d, seed, path, cases)
    print(kind, f"D={d}", "errors", [r["errors"] for r in results])
    print(kind, f"D={d}", "bytes read per rank", [r["read"] for r in results], results[0])
    for r in results:
        assert max(r["errors"].values()) <= 1e-6, r["errors"]
        assert r["read"] == r["expected"], r
    return results


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("d", [2, 4, 8])
def test_hf_qkv_layouts_generate_like_hf(request, seed, tmp_path, layout, d):
    """Fewer K/V heads than D and a decoupled head_dim: HF's greedy tokens and last-token logits
    (TSP prefill and the TP fallback), each rank reading exactly its rows of the fused QKV."""
    config_cls, model_cls, changes = LAYOUTS[layout](d)
    sizes = dict(SIZES, **changes)
    if layout == "qwen2_fewer_kv":
        assert sizes["num_key_value_heads"] < d
    else:
        assert sizes["head_dim"] != sizes["hidden_size"] // sizes["num_attention_heads"]
    pool = request.getfixturevalue("pool8" if d == 8 else "pool4")
    _check_against_hf(pool, seed, tmp_path, layout, d, (config_cls, model_cls, changes))


def _llama3(factor, **fields):
    return dict(
        rope_parameters=dict(
            dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=factor,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            **fields,
        ),
        rms_norm_eps=1e-5,
    )


# Llama-3 RoPE scaling megatron-core represents (RotaryEmbedding(rope_scaling=True,
# rope_scaling_factor=f): any factor, the other three fixed at 1 / 4 / 8192, which enter only as
# the wavelength bounds 8192/1 and 8192/4): factor 4 and 2 (not the default 8), and the same
# bounds from other values (16384 / 2 / 8).
LLAMA3_REPRESENTABLE = {
    "factor_4": _llama3(4.0),
    "factor_2_bounds_16384_2_8": _llama3(
        2.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position_embeddings=16384
    ),
}


@pytest.mark.parametrize("case", sorted(LLAMA3_REPRESENTABLE))
def test_hf_llama3_rope_scaling_values_generate_like_hf(pool4, seed, tmp_path, case):
    """Non-default Llama-3 scaling that megatron-core can represent imports and equals HF (RoPE
    base 5e5, head_dim 4: the lower frequency lies in the smoothed band, so the factor changes
    the logits)."""
    spec = ("LlamaConfig", "LlamaForCausalLM", LLAMA3_REPRESENTABLE[case])
    results = _check_against_hf(pool4, seed, tmp_path, f"llama3_{case}", 2, spec, [57, 3])
    desc = hf_import.describe(hf_import.read_config(str(tmp_path / f"llama3_{case}")), 2)
    factor = LLAMA3_REPRESENTABLE[case]["rope_parameters"]["factor"]
    assert desc.gpt["rope_scaling_factor"] == factor
    assert desc.megatron_args["rope_scaling_factor"] == factor and results


@pytest.mark.parametrize(
    "field, value",
    [
        ("low_freq_factor", 2.0),
        ("high_freq_factor", 8.0),
        ("original_max_position_embeddings", 4096),
        ("original_max_position_embeddings", 16384),
    ],
)
@pytest.mark.parametrize("style", ["rope_parameters", "rope_scaling"])
def test_hf_llama3_rope_scaling_megatron_cannot_represent_is_refused(field, value, style):
    """Other low / high frequency factors or original length (other wavelength bounds than
    megatron-core's fixed 8192 / 2048): one-line ValueError naming the HF field and its value,
    under transformers >= 5's ``rope_parameters`` and the older top-level ``rope_scaling``."""
    rope = _llama3(4.0, **{field: value})["rope_parameters"]
    config = _llama_dict()
    config.pop("rope_parameters", None)
    if style == "rope_scaling":
        config["rope_theta"] = rope.pop("rope_theta")
    config[style] = rope
    with pytest.raises(ValueError) as err:
        hf_import.describe(config, 2)
    message = str(err.value)
    assert "\n" not in message and f"{style}.{field}={value}" in message, message
    config[style][field] = _llama3(4.0)["rope_parameters"][field]
    assert hf_import.describe(config, 2).gpt["rope_scaling_factor"] == 4.0


def test_cli_generate_hf_and_save_for_megatron(tmp_path, seed):
    """The two commands of docs/inference.md: `generate --hf DIR` gives HF's greedy tokens;
    `--save OUT` writes a Megatron torch_dist checkpoint that `generate --load OUT` (another D)
    reads back to the same tokens."""
    from tests.test_inference import _run_cli

    model, path = _save_hf("llama", seed, str(tmp_path))
    [(prompt, _, tokens)] = _hf_cases(model, seed, [9])
    ids = ",".join(map(str, prompt))
    common = ("--prompt-ids", ids, "--max-new-tokens", str(NEW_TOKENS), "--dtype", "float64")
    out = str(tmp_path / "megatron")
    proc = _run_cli("generate", "--tsp", "2", "--hf", path, "--save", out, *common)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    want = f"[0] {' '.join(map(str, prompt))} -> {' '.join(map(str, tokens))}"
    assert want in proc.stdout, (want, proc.stdout)
    assert "rope_scaling=True" in proc.stdout, proc.stdout
    loaded = _run_cli("generate", "--tsp", "1", "--load", out, *common)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr[-3000:]
    assert want in loaded.stdout, (want, loaded.stdout)
    assert "rope_scaling=True" in loaded.stdout, loaded.stdout


def _llama_dict(**changes):
    config = transformers.LlamaConfig(**SIZES).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize(
    "changes, needle",
    [
        (
            dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)),
            "rope_type='yarn'",
        ),
        (dict(vocab_size=97), "vocab_size=97"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(mlp_bias=True), "mlp_bias=True"),
        (dict(model_type="gemma"), "model_type='gemma'"),
        (
            dict(
                rope_parameters=dict(
                    rope_type="llama3", factor=8.0, rope_theta=5e5, low_freq_factor=2.0
                )
            ),
            "low_freq_factor",
        ),
        (dict(model_type="mistral", sliding_window=16), "sliding_window=16"),
    ],
)
def test_unsupported_hf_options_are_refused_by_name(changes, needle):
    with pytest.raises(hf_import.UnsupportedHFOption) as err:
        hf_import.describe(_llama_dict(**changes), 2)
    assert needle in str(err.value)
    hf_import.describe(_llama_dict(), 2)  # the same config without the option is accepted


def test_cli_save_load_keeps_a_non_default_rope_scaling_factor(pool4, seed, tmp_path):
    """`generate --save` with `--use-rope-scaling --rope-scaling-factor 4` (the embedded model, RoPE
    base 5e5 so the factor changes the table) then `--load` at another D: the checkpoint's args
    carry 4.0, the load path builds the model with it, its logits equal a model built with factor
    4 on the same weights and differ from factor 8's (Megatron's default, what a dropped factor
    gives), and `generate --load` at D=1 gives the saving run's tokens."""
    from tests.test_inference import _run_cli

    ckpt = str(tmp_path / "ckpt")
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 128, (61,), generator=g).tolist()
    flags = ("--use-rope-scaling", "--rope-scaling-factor", "4", "--rotary-base", "500000")
    common = ("--train-steps", "0", "--max-new-tokens", "2", "--dtype", "float64")
    common += ("--prompt-ids", ",".join(map(str, prompt)))
    saved = _run_cli("generate", "--tsp", "2", "--save", ckpt, *flags, *common)
    assert saved.returncode == 0, saved.stdout + saved.stderr[-3000:]
    loaded = _run_cli("generate", "--tsp", "1", "--load", ckpt, *common)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr[-3000:]
    for out in (saved.stdout, loaded.stdout):
        assert "rope_scaling=True" in out and "rope_scaling_factor=4.0" in out, out

    def generations(text):
        return [line for line in text.splitlines() if line.startswith("[0]")]

    assert len(generations(saved.stdout)) == 1, saved.stdout
    assert generations(saved.stdout) == generations(loaded.stdout), (saved.stdout, loaded.stdout)
    check = checks_hf_import.check_checkpoint_rope_factor
    results = pool4.run(check, 4, seed, ckpt, prompt, [4, 8])
    r = results[0]
    print("load path read factor", r["read"], "logits vs explicit factors", r["diffs"])
    assert r["stored"] == 4.0 and r["read"] == 4.0 and r["scaling"] is True, r
    assert r["diffs"][4] <= 1e-12, r
    assert r["diffs"][8] >= 1e-6, r  # the factor is visible in fp64 logits
    assert f"-> {' '.join(map(str, r['tokens']))}" in generations(saved.stdout)[0], r
