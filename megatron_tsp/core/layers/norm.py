"""LayerNorm / RMSNorm for sequence-sharded activations.

Norm parameters are replicated on every TSP rank while each rank normalises different tokens, so
their gradients must be summed over the group. Tagging them ``sequence_parallel=True`` makes
Megatron's ``finalize_model_grads`` do exactly that (the stock ``WrappedTorchNorm`` refuses
``sequence_parallel`` configs; this one is the same torch module, tagged).
"""

from __future__ import annotations

import torch


class TSPNorm:
    """Factory with the signature Megatron passes to norm specs; returns a torch norm module."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = None):
        normalization = normalization or config.normalization
        if config.layernorm_zero_centered_gamma or zero_centered_gamma:
            raise ValueError("TSP norms do not support --apply-layernorm-1p (zero-centred gamma)")
        if normalization == "LayerNorm":
            module = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif normalization == "RMSNorm":
            module = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"--normalization={normalization!r}: TSP supports LayerNorm and RMSNorm")
        for param in module.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return module
