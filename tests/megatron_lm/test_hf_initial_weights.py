"""Megatron-LM's real ``pretrain_gpt.py`` starting from Hugging Face weights converted by
``megatron-tsp generate --hf DIR --save OUT``: under TSP (D=2) and under stock TP=2 the same
checkpoint gives the same loss curve, which differs from a random start (the weights were used).

Needs MEGATRON_LM_PATH and ``transformers``. ~1-2 min on 2 free cores."""

import pytest
import torch

from tests.megatron_lm import test_training_loop as loop
from tests.megatron_lm.common import megatron_lm_path

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    megatron_lm_path() is None, reason="set MEGATRON_LM_PATH to a Megatron-LM checkout"
)


def test_pretrain_gpt_starts_from_converted_hf_weights(tmp_path, seed):
    from tests.test_inference import _run_cli

    # The loop's shapes (tests/megatron_lm/test_training_loop.py COMMON + llama style): h=64,
    # 4 heads / 2 KV groups, ffn 256, 64 positions; NullTokenizer's 255 ids pad to 256 at TP=2.
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,  # Megatron-LM's --norm-epsilon default
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    hf_dir, out = str(tmp_path / "hf"), str(tmp_path / "megatron")
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    proc = _run_cli(
        "generate", "--tsp", "2", "--hf", hf_dir, "--save", out, "--max-new-tokens", "0"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    style = loop.STYLES["llama"]
    load = ["--load", out, "--finetune", "--no-load-optim", "--no-load-rng"]
    tsp = loop._run(2, seed, *style, *load, "--tensor-sequence-parallel-size", "2")
    ref = loop._run(2, seed, *style, *load, "--tensor-model-parallel-size", "2")
    loop._assert_same_curve(tsp, ref, loop.FP32_LOSS_RTOL, loop.FP32_NORM_RTOL)
    scratch = loop._run(2, seed, *style, "--tensor-sequence-parallel-size", "2")
    # The run started from the converted weights, not from Megatron's own init: at init both
    # predict almost uniformly (first losses ~ln(vocab), seen 7.7e-5 apart), so compare the
    # whole curve and the gradient norms, which follow the weights.
    loaded = tsp.losses + tsp.grad_norms
    fresh = scratch.losses + scratch.grad_norms
    assert max(loop._rel(a, b) for a, b in zip(loaded, fresh)) > 1e-3, (loaded, fresh)
