"""Hand weight gradients back to autograd, honouring Megatron's ``main_grad`` contract."""

from __future__ import annotations

from typing import Optional

import torch


def weight_grad_output(
    param: Optional[torch.Tensor], grad: Optional[torch.Tensor], accumulate_into_main_grad: bool
) -> Optional[torch.Tensor]:
    """The value an autograd ``Function`` returns for ``param``'s gradient.

    ``accumulate_into_main_grad`` is Megatron's ``gradient_accumulation_fusion`` (named for
    the fused wgrad kernel it selects; here nothing is fused): when the param has a ``main_grad``
    (Megatron DDP's fp32 buffer), the gradient is added to it here and autograd receives a
    dummy, flagged through ``grad_added_to_main_grad`` so DDP does not add it twice; otherwise
    autograd gets the gradient.
    """
    if param is None or grad is None:
        return None
    if accumulate_into_main_grad and getattr(param, "main_grad", None) is not None:
        param.main_grad.add_(grad.to(param.main_grad.dtype))
        if hasattr(param, "grad_added_to_main_grad"):
            param.grad_added_to_main_grad = True
            if getattr(param, "zero_out_wgrad", False):
                return torch.zeros_like(param)
            return torch.empty_like(param)
        return None
    return grad.to(param.dtype)
