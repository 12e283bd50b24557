"""Hugging Face Llama / Mistral / Qwen2 checkpoint directories -> a TSP ``GPTModel``.

Why written here and not taken from a converter: the maintained converters on the package index
were evaluated (docs/inference.md, "Weights from Hugging Face"): Megatron-Bridge requires
Transformer Engine CUDA wheels, mamba-ssm / causal-conv1d builds, megatron-core < 0.17 (0.3.x) or
Python 3.12 only with flashinfer (0.6.x), so it installs on neither supported line without a CUDA
stack; mbridge and mcore-bridge read whole tensors on every rank (``get_tensor``) and move them
to CUDA, and mcore-bridge pulls modelscope and peft. This module needs only ``safetensors`` (and
``tokenizers`` for text prompts) and reads on each rank only the rows its shards hold.

The mapping (Megatron's TP=D layout, which TSP-D shares):

- ``linear_qkv``: Megatron fuses Q, K, V per KV group: for group g the rows are
  ``[q heads of g; k_g; v_g]``, and rank r holds the r-th of D contiguous row shards of the whole
  fused weight: groups ``[r G/D, (r+1) G/D)`` when G >= D; with fewer K/V heads than D a group
  spans D/G shards and only the last of them holds its K and V rows (``qkv_rows``). The rows are
  read from ``q_proj`` / ``k_proj`` / ``v_proj`` (and their biases, Qwen2). HF's ``head_dim``
  (which may differ from hidden/heads) is Megatron's ``kv_channels``.
- ``linear_fc1``: gated, stride 2: rank r holds ``[gate_r; up_r]`` (its ``intermediate/D`` rows
  of ``gate_proj`` then of ``up_proj``). ``linear_fc2`` / ``linear_proj``: column slices of
  ``down_proj`` / ``o_proj``.
- ``word_embeddings`` / ``output_layer``: vocabulary rows ``[r V/D, (r+1) V/D)``; tied embeddings
  (``tie_word_embeddings``) share one tensor.
- norms: replicated (``input_layernorm``, ``post_attention_layernorm`` -> ``pre_mlp_layernorm``,
  ``model.norm`` -> ``final_layernorm``).

HF's RoPE rotates halves (``rotate_half``), which is Megatron's non-interleaved RoPE, so the
Q/K rows need no permutation. RoPE options: default, ``linear`` (Megatron's
``seq_len_interpolation_factor``) and ``llama3`` with any ``factor`` and Megatron's fixed
constants (low/high frequency factors 1 / 4, original length 8192, or values with the same
wavelength bounds: ``_check_llama3``). Anything else that changes the math (YaRN, dynamic NTK,
sliding windows, MLP / output-projection biases, a vocabulary not divisible by D, other
activations) is refused naming the option.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
# Megatron's Llama-3 RoPE scaling constants (RotaryEmbedding._apply_scaling defaults).
MEGATRON_LLAMA3 = dict(
    low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


class UnsupportedHFOption(ValueError):
    """A Hugging Face config setting this mapping cannot reproduce."""


@dataclass
class HFModelDescription:
    """A Hugging Face config as Megatron TransformerConfig fields and GPTModel arguments, plus the
    Megatron-LM argument names (stored in a converted checkpoint's ``args``)."""

    config: Dict[str, Any]
    gpt: Dict[str, Any]
    vocab_size: int
    max_sequence_length: int
    megatron_args: Dict[str, Any] = field(default_factory=dict)
    model_type: str = ""


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _rope_parameters(hf: dict) -> dict:
    """transformers >= 5 keeps RoPE settings in ``rope_parameters``; older configs have
    ``rope_theta`` and ``rope_scaling`` at the top level."""
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    return params


def _check_llama3(rope: dict, where: str) -> None:
    """Megatron's Llama-3 scaling takes only the factor: its low / high frequency factors and
    original length are fixed (``MEGATRON_LLAMA3``). The scaled frequencies depend on those three
    only through the two wavelength bounds ``original_max_position_embeddings / low_freq_factor``
    (8192) and ``/ high_freq_factor`` (2048) (the smoothing weight is
    ``(1/wavelength - 1/low_bound) / (1/high_bound - 1/low_bound)``), so any values with Megatron's
    bounds are the same scaling (e.g. 16384, 2, 8); others are refused naming each field that
    differs from Megatron's value."""
    values = {key: float(rope.get(key, want)) for key, want in MEGATRON_LLAMA3.items()}
    original = values["original_max_position_embeddings"]
    bounds = (original / values["low_freq_factor"], original / values["high_freq_factor"])
    want = tuple(
        MEGATRON_LLAMA3["original_max_position_embeddings"] / MEGATRON_LLAMA3[k]
        for k in ("low_freq_factor", "high_freq_factor")
    )
    if bounds == want:
        return
    named = ", ".join(
        f"{where}.{key}={rope[key]}"
        for key, default in MEGATRON_LLAMA3.items()
        if key in rope and float(rope[key]) != default
    )
    raise UnsupportedHFOption(
        f"{named}: Megatron's Llama-3 RoPE scaling (--use-rope-scaling, only "
        f"--rope-scaling-factor is free) has low/high_freq_factor 1/4 and "
        f"original_max_position_embeddings 8192 (or the same wavelength bounds "
        f"original_max_position_embeddings/low_freq_factor = {want[0]:g}, "
        f"/high_freq_factor = {want[1]:g}; here {bounds[0]:g}, {bounds[1]:g})"
    )


def describe(hf: dict, d: int) -> HFModelDescription:
    """Map a Hugging Face ``config.json`` (dict) for tensor-sequence-parallel size ``d``."""
    import torch.nn.functional as F

    kind = hf.get("model_type")
    if kind not in SUPPORTED_TYPES:
        raise UnsupportedHFOption(
            f"model_type={kind!r}: supported Hugging Face model types are {SUPPORTED_TYPES}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedHFOption(
            f"hidden_act={hf['hidden_act']!r}: only 'silu' (SwiGLU) is mapped"
        )
    if hf.get("mlp_bias"):
        raise UnsupportedHFOption("mlp_bias=True: MLP biases are not mapped")
    if kind != "qwen2" and hf.get("attention_bias"):
        raise UnsupportedHFOption(
            "attention_bias=True: Llama's o_proj bias has no Megatron counterpart without MLP "
            "biases (add_bias_linear)"
        )
    window = hf.get("sliding_window")
    max_pos = int(hf.get("max_position_embeddings", 4096))
    # A window as long as the model's context changes nothing (Mistral's configs carry 4096).
    active = window is not None and int(window) < max_pos
    if active and (kind != "qwen2" or hf.get("use_sliding_window")):
        raise UnsupportedHFOption(
            f"sliding_window={window}: sliding-window attention is not supported by TSP"
        )
    vocab = int(hf["vocab_size"])
    if vocab % d:
        raise UnsupportedHFOption(
            f"vocab_size={vocab} is not divisible by --tensor-sequence-parallel-size={d} (the "
            "embedding and output layer are split by vocabulary rows; pad the vocabulary first)"
        )
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    groups = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hidden // heads)
    rope = _rope_parameters(hf)
    rope_type = rope["rope_type"]
    gpt = dict(
        position_embedding_type="rope",
        rotary_base=int(rope.get("rope_theta", 10000.0)),
        rotary_percent=float(hf.get("partial_rotary_factor", 1.0)),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
    )
    if float(rope.get("rope_theta", 10000.0)) != gpt["rotary_base"]:
        raise UnsupportedHFOption(
            f"rope_theta={rope['rope_theta']}: Megatron's rotary_base is an integer"
        )
    args = {}
    if rope_type == "linear":
        gpt["seq_len_interpolation_factor"] = float(rope["factor"])
        args["rotary_seq_len_interpolation_factor"] = float(rope["factor"])
    elif rope_type == "llama3":
        _check_llama3(rope, "rope_parameters" if hf.get("rope_parameters") else "rope_scaling")
        gpt.update(rope_scaling=True, rope_scaling_factor=float(rope["factor"]))
        args.update(use_rope_scaling=True, rope_scaling_factor=float(rope["factor"]))
    elif rope_type != "default":
        raise UnsupportedHFOption(
            f"rope_type={rope_type!r} (rope_parameters): supported are 'default', 'linear' and "
            "'llama3'"
        )
    qkv_bias = kind == "qwen2"
    config = dict(
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        ffn_hidden_size=int(hf["intermediate_size"]),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
    )
    args.update(
        num_layers=config["num_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        group_query_attention=groups != heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        ffn_hidden_size=config["ffn_hidden_size"],
        normalization="RMSNorm",
        norm_epsilon=config["layernorm_epsilon"],
        swiglu=True,
        disable_bias_linear=True,
        add_qkv_bias=qkv_bias,
        position_embedding_type="rope",
        rotary_base=gpt["rotary_base"],
        rotary_percent=gpt["rotary_percent"],
        untie_embeddings_and_output_weights=not gpt["share_embeddings_and_output_weights"],
        vocab_size=vocab,
        padded_vocab_size=vocab,
        max_position_embeddings=max_pos,
        seq_length=max_pos,
    )
    return HFModelDescription(config, gpt, vocab, max_pos, args, kind)


# ----------------------------------------------------------------------------- weights
class SafetensorsReader:
    """Row / column slices of the tensors of a safetensors checkpoint directory (one file or a
    ``model.safetensors.index.json`` shard set), opened lazily; ``open_fn`` is
    ``safetensors.safe_open`` (a test wraps it to count the bytes each rank reads)."""

    def __init__(self, path: str, open_fn: Optional[Callable] = None):
        if open_fn is None:
            from safetensors import safe_open as open_fn
        self.path, self.open_fn = path, open_fn
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self.files = dict(json.load(f)["weight_map"])
        else:
            single = os.path.join(path, "model.safetensors")
            if not os.path.exists(single):
                raise FileNotFoundError(
                    f"{path}: no model.safetensors or model.safetensors.index.json (only "
                    "safetensors checkpoints are read)"
                )
            with open_fn(single, framework="pt") as f:
                self.files = {name: "model.safetensors" for name in f.keys()}
        self._handles: Dict[str, Any] = {}

    def has(self, name: str) -> bool:
        return name in self.files

    def _slice(self, name: str):
        if name not in self.files:
            raise KeyError(f"{self.path}: tensor {name} is not in the checkpoint")
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self.open_fn(os.path.join(self.path, file), framework="pt")
        return self._handles[file].get_slice(name)

    def rows(self, name: str, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        s = self._slice(name)
        stop = s.get_shape()[0] if stop is None else stop
        return s[start:stop]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._slice(name)[:, start:stop]


def qkv_rows(
    heads: int, groups: int, head_dim: int, size: int, rank: int, names=("q", "k", "v")
) -> List[Tuple[Any, int, int]]:
    """Rank ``rank``'s rows of Megatron's fused QKV weight (TP=``size`` layout) as
    ``(names[i], start, stop)`` row ranges of HF's ``q_proj`` / ``k_proj`` / ``v_proj``, in the
    fused order. The fused weight is, per K/V group g, ``[q heads of g; k_g; v_g]``; rank r holds
    its rows ``[r R/size, (r+1) R/size)`` of the ``R = (heads + 2 groups) head_dim`` rows."""
    per_group = heads // groups
    block = (per_group + 2) * head_dim
    total = groups * block
    if total % size:
        raise ValueError(f"fused QKV rows {total} are not divisible by {size} ranks")
    lo, hi = rank * total // size, (rank + 1) * total // size
    out = []
    for g in range(lo // block, (hi - 1) // block + 1):
        base = g * block
        # (name, first fused row of the segment, its first HF row, its length)
        segments = (
            (names[0], base, g * per_group * head_dim, per_group * head_dim),
            (names[1], base + per_group * head_dim, g * head_dim, head_dim),
            (names[2], base + (per_group + 1) * head_dim, g * head_dim, head_dim),
        )
        for name, first, hf_first, length in segments:
            a, b = max(lo, first), min(hi, first + length)
            if a < b:
                out.append((name, hf_first + a - first, hf_first + b - first))
    return out


def _layer_tensors(
    reader: SafetensorsReader, desc: HFModelDescription, layer: int, size: int, rank: int
):
    """This rank's Megatron tensors of decoder layer ``layer`` (names relative to the layer)."""
    c = desc.config
    heads, groups, head_dim = c["num_attention_heads"], c["num_query_groups"], c["kv_channels"]
    hf = f"model.layers.{layer}."
    out = {}
    # Fused QKV: Megatron's per-group [q..., k, v] rows, cut into ``size`` contiguous row shards
    # (megatron-core's ColumnParallelLinear). With at least as many K/V heads as ranks a shard is
    # whole groups; with fewer, a group spans size/groups shards and its K/V rows sit in the last
    # of them. Either way this rank reads exactly its rows, piece by piece.
    for suffix in ("weight", "bias") if c["add_qkv_bias"] else ("weight",):
        names = [hf + f"self_attn.{p}_proj.{suffix}" for p in "qkv"]
        out[f"self_attention.linear_qkv.{suffix}"] = torch.cat(
            [
                reader.rows(name, start, stop)
                for name, start, stop in qkv_rows(heads, groups, head_dim, size, rank, names)
            ],
            dim=0,
        )
    q_local = heads * head_dim // size
    out["self_attention.linear_proj.weight"] = reader.cols(
        hf + "self_attn.o_proj.weight", rank * q_local, (rank + 1) * q_local
    )
    ffn = c["ffn_hidden_size"] // size
    out["mlp.linear_fc1.weight"] = torch.cat(
        [
            reader.rows(hf + "mlp.gate_proj.weight", rank * ffn, (rank + 1) * ffn),
            reader.rows(hf + "mlp.up_proj.weight", rank * ffn, (rank + 1) * ffn),
        ]
    )
    out["mlp.linear_fc2.weight"] = reader.cols(
        hf + "mlp.down_proj.weight", rank * ffn, (rank + 1) * ffn
    )
    out["input_layernorm.weight"] = reader.rows(hf + "input_layernorm.weight")
    out["pre_mlp_layernorm.weight"] = reader.rows(hf + "post_attention_layernorm.weight")
    return out


def local_state(
    reader: SafetensorsReader, desc: HFModelDescription, size: int, rank: int
) -> Dict[str, torch.Tensor]:
    """Every parameter of rank ``rank``'s TP=D / TSP-D shard, read slice by slice."""
    vocab = desc.vocab_size // size
    rows = (rank * vocab, (rank + 1) * vocab)
    out = {"embedding.word_embeddings.weight": reader.rows("model.embed_tokens.weight", *rows)}
    for layer in range(desc.config["num_layers"]):
        for name, value in _layer_tensors(reader, desc, layer, size, rank).items():
            out[f"decoder.layers.{layer}.{name}"] = value
    out["decoder.final_layernorm.weight"] = reader.rows("model.norm.weight")
    if not desc.gpt["share_embeddings_and_output_weights"]:
        out["output_layer.weight"] = reader.rows("lm_head.weight", *rows)
    return out


def build_model(
    path: str, d: int, dtype=torch.float32, device=None, open_fn=None, **config_overrides
):
    """TSP ``GPTModel`` for the current TSP group (size ``d``) with the Hugging Face weights in
    ``path``; every rank reads only its own slices. Returns ``(model, description)``."""
    import torch.distributed as dist

    from megatron_tsp.core.model import build_tsp_gpt_model
    from megatron_tsp.core.parallel_state import get_tensor_sequence_parallel_group
    from megatron_tsp.tools.cpu_ranks import unfused_config

    desc = describe(read_config(path), d)
    fields = dict(desc.config)
    fields.update(
        use_cpu_initialization=device is None or torch.device(device).type == "cpu",
        perform_initialization=False,
    )
    fields.update(config_overrides)
    config = unfused_config(d, dtype, **fields)
    step = 2 * d
    model = build_tsp_gpt_model(
        config,
        vocab_size=desc.vocab_size,
        max_sequence_length=desc.max_sequence_length,
        seq_length=desc.max_sequence_length // step * step,
        **desc.gpt,
    )
    if device is not None:
        model = model.to(device)
    group = get_tensor_sequence_parallel_group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    state = local_state(SafetensorsReader(path, open_fn), desc, size, rank)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state))
    if missing:
        raise ValueError(f"{path}: no mapping for Megatron parameters {missing[:5]}")
    with torch.no_grad():
        for name, value in state.items():
            if params[name].shape != value.shape:
                raise ValueError(
                    f"{path}: {name} read as {tuple(value.shape)}, the model's shard is "
                    f"{tuple(params[name].shape)}"
                )
            params[name].copy_(value)
    return model, desc


def shard_bytes(desc: HFModelDescription, size: int) -> Tuple[int, int]:
    """(elements one rank reads, elements in the whole checkpoint), from the shapes."""
    c = desc.config
    hidden, layers = c["hidden_size"], c["num_layers"]
    q = c["num_attention_heads"] * c["kv_channels"]
    kv = c["num_query_groups"] * c["kv_channels"]
    ffn = c["ffn_hidden_size"]
    per_layer_sharded = (q + 2 * kv) * hidden + q * hidden + 3 * ffn * hidden
    if c["add_qkv_bias"]:
        per_layer_sharded += q + 2 * kv
    embed = desc.vocab_size * hidden * (1 if desc.gpt["share_embeddings_and_output_weights"] else 2)
    replicated = layers * 2 * hidden + hidden
    whole = layers * per_layer_sharded + embed + replicated
    return (layers * per_layer_sharded + embed) // size + replicated, whole


def tokenizer(path: str):
    """The directory's ``tokenizer.json`` (Hugging Face ``tokenizers``), or None."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(file)


def stop_tokens(hf: dict) -> List[int]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return []
    return [int(t) for t in (eos if isinstance(eos, list) else [eos])]
