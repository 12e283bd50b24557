"""When TSP's own Triton kernels run (``rope_kernel``, ``row_sum_kernel``,
``activation_kernel``): on CUDA tensors of an fp32-or-narrower dtype (their arithmetic is fp32),
where Triton imports, unless the kernel's environment variable says ``torch`` (its torch-op path,
kept for comparison and as a fallback)."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CHOICES = ("triton", "torch")


def enabled(env: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel switched by environment variable ``env`` runs for ``dtype`` tensors on
    ``device``; an unknown value of ``env`` is refused, naming it."""
    choice = os.environ.get(env, "triton")
    if choice not in CHOICES:
        raise ValueError(f"{env}={choice!r}: choose one of {CHOICES}")
    return (
        choice == "triton"
        and torch.device(device).type == "cuda"
        and dtype in DTYPES
        and triton_importable()
    )


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None
