"""Run a submodule's forward pre-hooks when a TSP layer reads its weights without calling it.

TSP layers keep Megatron's ``linear_qkv`` / ``linear_proj`` / ``linear_fc1`` / ``linear_fc2`` as
parameter holders (same names, shapes and checkpoints as TP=D) but never call them: the TSP
schedule reads their ``weight`` / ``bias`` directly. Hooks that Megatron registers on every module
and that fire on a module *call* would then be skipped. The one that matters in training is
Megatron DDP's ``--overlap-param-gather`` pre-hook: it waits for the all-gather of the bucket
holding the module's parameters (and dispatches the next one). Skipping it makes TSP read
weights mid-gather (DP > 1) and leaves the gather handle pending
(``assert self.param_gather_handle is None`` on the next iteration).

``run_forward_pre_hooks(module)`` runs the module's forward pre-hooks (and the global ones) as a
call would, before the weights are read. The hooks see empty positional inputs; a hook that
returns replacement inputs cannot apply to a module that is not called, so that is an error.
"""

from __future__ import annotations

import torch


def run_forward_pre_hooks(module: torch.nn.Module) -> None:
    """Fire ``module``'s forward pre-hooks as ``module(...)`` would, without calling it."""
    from torch.nn.modules import module as module_mod

    hooks = list(getattr(module_mod, "_global_forward_pre_hooks", {}).items())
    hooks += list(module._forward_pre_hooks.items())
    if not hooks:
        return
    with_kwargs = getattr(module, "_forward_pre_hooks_with_kwargs", {})
    for hook_id, hook in hooks:
        if hook_id in with_kwargs:
            result = hook(module, (), {})
        else:
            result = hook(module, ())
        if result is not None:
            raise RuntimeError(
                f"forward pre-hook {getattr(hook, '__qualname__', hook)!r} on "
                f"{type(module).__name__} returned replacement inputs; TSP layers read this "
                "module's weights without calling it, so input-rewriting hooks cannot apply"
            )
