"""LayerNorm / RMSNorm for sequence-sharded activations (TSP and the TP+SP baseline).

Norm parameters are replicated on every rank while each rank normalises different tokens, so
their gradients must be summed over the group. Tagging them ``sequence_parallel=True`` makes
Megatron's ``finalize_model_grads`` do exactly that (the stock ``WrappedTorchNorm`` refuses
``sequence_parallel`` configs; these are the same torch modules, tagged).

``SequenceParallelNorm`` is what a spec names: Megatron's ``build_module`` calls it with the
norm keywords, and it builds a ``SequenceParallelLayerNorm`` or a ``SequenceParallelRMSNorm``
from ``config.normalization``. Both are subclasses of it and of the torch norm, so
``isinstance(m, SequenceParallelNorm)`` and ``isinstance(m, torch.nn.LayerNorm)`` hold, and
their state-dict keys are the torch norm's (``weight``, ``bias``). A plain function would not do:
Megatron's ``build_module`` returns functions uncalled.
"""

from __future__ import annotations

import inspect

import torch


def _check_supported(config, zero_centered_gamma: bool, normalization: str) -> None:
    if config.layernorm_zero_centered_gamma or zero_centered_gamma:
        raise ValueError("TSP norms do not support --apply-layernorm-1p (zero-centred gamma)")
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"--normalization={normalization!r}: TSP supports LayerNorm and RMSNorm")


class SequenceParallelNorm:
    """Base of the sequence-parallel-tagged torch norms. Calling it builds the subclass for
    ``normalization`` (default ``config.normalization``); the signature is that of Megatron's
    norm specs (``persist_layer_norm`` is accepted and has no effect on a torch norm)."""

    normalization: str  # "LayerNorm" / "RMSNorm": set by the subclasses
    torch_norm: type  # the torch module class the subclass extends

    def __new__(cls, *args, **kwargs):
        if cls is not SequenceParallelNorm:  # a subclass, or unpickling / deepcopy (no arguments)
            return super().__new__(cls)
        bound = inspect.signature(SequenceParallelNorm.__init__).bind(None, *args, **kwargs)
        config = bound.arguments["config"]
        normalization = bound.arguments.get("normalization") or config.normalization
        _check_supported(config, bound.arguments.get("zero_centered_gamma", False), normalization)
        subclass = {"LayerNorm": SequenceParallelLayerNorm, "RMSNorm": SequenceParallelRMSNorm}[
            normalization
        ]
        return super().__new__(subclass)  # Python then runs subclass.__init__(*args, **kwargs)

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = None,
    ):
        if normalization not in (None, self.normalization):
            raise ValueError(
                f"normalization={normalization!r} given to "
                f"{type(self).__name__} (a {self.normalization})"
            )
        _check_supported(config, zero_centered_gamma, self.normalization)
        self.torch_norm.__init__(self, hidden_size, eps=eps, dtype=config.params_dtype)
        for param in self.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)


class SequenceParallelLayerNorm(SequenceParallelNorm, torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` whose parameters carry ``sequence_parallel`` from the config."""

    normalization, torch_norm = "LayerNorm", torch.nn.LayerNorm


class SequenceParallelRMSNorm(SequenceParallelNorm, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose parameters carry ``sequence_parallel`` from the config."""

    normalization, torch_norm = "RMSNorm", torch.nn.RMSNorm
