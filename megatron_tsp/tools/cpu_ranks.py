"""What the tools that spawn CPU ranks share: gloo start-up and a CPU-runnable model config.

``bench``, ``demo`` and ``generate`` start D (or DP x D) gloo ranks on loopback and build small
GPT models whose ``TransformerConfig`` must run on a CPU-only torch; ``tests/harness.py`` starts its
rank pool the same way.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

# Every Megatron fusion off: the bias-activation, bias-dropout and masked-softmax fusions are
# jit / torch.compile'd kernels that compile slowly on CPU, and the RoPE and gradient-accumulation
# fusions need CUDA extensions (Transformer Engine / apex) that TransformerConfig and
# ColumnParallelLinear refuse to run without.
FUSIONS_OFF = dict(
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
)


def style_fields(style: str) -> dict:
    """``TransformerConfig`` fields of a model family: "llama" (RMSNorm, SwiGLU, no linear
    biases) or "gpt2" (LayerNorm, GeLU, biases): the tools' ``--style``."""
    import torch.nn.functional as F

    if style not in ("llama", "gpt2"):
        raise ValueError(f"--style={style}: choose llama or gpt2")
    llama = style == "llama"
    return dict(
        normalization="RMSNorm" if llama else "LayerNorm",
        gated_linear_unit=llama,
        activation_func=F.silu if llama else F.gelu,
        add_bias_linear=not llama,
    )


def unfused_config(d: int, dtype: torch.dtype, sequence_parallel: bool = None, **fields):
    """``TransformerConfig`` for tensor-parallel size ``d`` (+ sequence parallelism, by default
    when d > 1) with no dropout, CPU initialisation and ``FUSIONS_OFF``; ``fields`` (the model
    shape, ``style_fields``, ...) win."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = dict(
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=d,
        sequence_parallel=d > 1 if sequence_parallel is None else sequence_parallel,
        use_cpu_initialization=True,
        params_dtype=dtype,
        **FUSIONS_OFF,
    )
    config.update(fields)
    return TransformerConfig(**config)


def init_gloo_rank(
    rank: int, world_size: int, port: int, timeout_s: float, threads: int = 1
) -> None:
    """Join a gloo group on loopback as ``rank`` of ``world_size``, with ``threads`` intra-op
    threads (``OMP_NUM_THREADS`` is set only when unset, so a caller's choice wins)."""
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
