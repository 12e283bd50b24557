"""Hugging Face checkpoint directories under TSP: checks run inside every rank of the pool."""

from __future__ import annotations

import torch

from megatron_tsp.inference import TSPInferenceEngine
from megatron_tsp.models import hf_import
from tests.common import rel_err, setup_tsp


class CountingOpen:
    """``safe_open`` that counts the bytes of every slice or tensor handed out."""

    def __init__(self):
        self.bytes = 0

    def __call__(self, path, framework):
        from safetensors import safe_open

        counter, handle = self, safe_open(path, framework=framework)

        class Slice:
            def __init__(self, inner):
                self.inner = inner

            def get_shape(self):
                return self.inner.get_shape()

            def __getitem__(self, index):
                out = self.inner[index]
                counter.bytes += out.numel() * out.element_size()
                return out

        class Handle:
            def keys(self):
                return handle.keys()

            def get_slice(self, name):
                return Slice(handle.get_slice(name))

            def get_tensor(self, name):
                out = handle.get_tensor(name)
                counter.bytes += out.numel() * out.element_size()
                return out

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        return Handle()


def check_hf_generation(d, seed, path, cases):
    """``cases``: [(prompt, HF last-token logits, HF greedy tokens)]. Loads ``path`` under TSP-D
    (fp64) counting the bytes read; returns the worst logits error per prefill mode and the
    bytes this rank read with the expected count."""
    setup_tsp(d, seed)
    counter = CountingOpen()
    model, desc = hf_import.build_model(path, d, torch.float64, open_fn=counter)
    engine = TSPInferenceEngine(model)
    worst = {"tsp": 0.0, "tp": 0.0}
    for prompt, logits, tokens in cases:
        res = engine.generate([prompt], len(tokens))
        worst[res.prefill_mode] = max(
            worst[res.prefill_mode], rel_err(res.prefill_logits[0], logits)
        )
        if res.tokens[0] != tokens:
            raise AssertionError(
                f"D={d} {desc.model_type}, prompt len {len(prompt)} ({res.prefill_mode} prefill): "
                f"generated {res.tokens[0]}, Hugging Face generate {tokens}"
            )
    mine, whole = hf_import.shard_bytes(desc, d)
    return dict(errors=worst, read=counter.bytes, expected=mine * 8, whole=whole * 8)


def check_checkpoint_rope_factor(d, seed, ckpt, prompt, factors):
    """Load the ``generate --save`` checkpoint ``ckpt`` under TSP-D through ``generate --load``'s
    own path (its stored Megatron-LM args -> ``model_args`` -> the model), and the same weights
    into models built with each Llama-3 ``rope_scaling_factor`` in ``factors``. Returns the factor
    the load path read (stored args and GPTModel argument), its greedy tokens, and the relative
    difference of its last-token logits (fp64) from each explicit-factor model's."""
    from megatron_tsp.core.model import build_tsp_gpt_model
    from megatron_tsp.tools import generate

    setup_tsp(d, seed)
    args = generate.parse_args(["--tsp", str(d), "--load", ckpt, "--dtype", "float64"])
    cpu = torch.device("cpu")
    model, kwargs, stored = generate._build(args, cpu)
    result = TSPInferenceEngine(model).generate([prompt], 2)
    config, described = generate._config_from_model_fields(stored, d, torch.float64)
    seq = described.max_sequence_length
    diffs = {}
    for factor in factors:
        other = build_tsp_gpt_model(
            config,
            vocab_size=described.vocab_size,
            max_sequence_length=seq,
            seq_length=seq // (2 * d) * (2 * d),
            **dict(described.gpt, rope_scaling_factor=factor),
        )
        generate._load_torch_dist(other, generate._checkpoint_dir(ckpt))
        logits = TSPInferenceEngine(other).generate([prompt], 1).prefill_logits[0]
        diffs[factor] = rel_err(result.prefill_logits[0], logits)
    return dict(
        stored=stored.get("rope_scaling_factor"),
        read=kwargs.get("rope_scaling_factor"),
        scaling=kwargs.get("rope_scaling"),
        tokens=result.tokens[0],
        diffs=diffs,
    )
