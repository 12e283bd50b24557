"""Run megatron-core on a CPU-only torch (gloo backend).

megatron-core assumes CUDA in three places that matter for TSP and its baselines:

1. buffers are allocated on ``torch.cuda.current_device()``;
2. the local attention builds its default causal mask with ``device="cuda"``;
3. the model-parallel RNG tracker saves and restores CUDA generator states;
4. (MoE) the router's gating GEMM tests ``te_general_gemm``, a name megatron-core 0.16 defines
   only when Transformer Engine imports.
5. under context parallelism, RoPE picks its CP rank's table rows through a pinned CUDA index.

``enable_cpu_support()`` redirects exactly these to the CPU. It is explicit (never an import side
effect), idempotent, and undone by ``disable_cpu_support()``. It refuses to run when CUDA is
available, so a GPU job can never silently land on the CPU.

Note: ``model_parallel_cuda_manual_seed`` reseeds the CPU generator once the tracker is routed
there; seed weight initialisation after calling it.
"""

from __future__ import annotations

import functools

import torch

from megatron_tsp.megatron_lm import patches


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


@functools.lru_cache(maxsize=8)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_get_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, *args, **kwargs) -> None:
    if isinstance(new_state, torch.Generator):
        new_state = new_state.get_state()
    torch.set_rng_state(new_state)


def _cpu_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """megatron-core's ``get_pos_emb_on_this_cp_rank`` (rows of CP chunks r and 2C-1-r of 2C
    along ``seq_dim``) with its index on the CPU instead of a pinned buffer copied to CUDA."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    from megatron_tsp.core.layout import TSPLayout

    size, rank = cp_group.size(), cp_group.rank()
    # Megatron's CP split is the zigzag of C ranks: CP rank r holds chunks r and 2C-1-r
    index = torch.tensor(TSPLayout(size, 2 * size).chunks_of(rank), device=pos_emb.device)
    shape = pos_emb.shape
    pos_emb = pos_emb.view(*shape[:seq_dim], 2 * size, -1, *shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*shape[:seq_dim], -1, *shape[seq_dim + 1 :])


def _cpu_manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def _cpu_router_gating_linear(inp, weight, bias, router_dtype):
    """The MoE router's logits ``inp @ weight.T + bias`` computed in ``router_dtype``, what
    megatron-core's ``RouterGatingLinearFunction`` computes without Transformer Engine (its
    gradients come back in the input's and the weight's dtypes through the casts)."""
    return torch.nn.functional.linear(
        inp.to(router_dtype),
        weight.to(router_dtype),
        None if bias is None else bias.to(router_dtype),
    )


def _cpu_support(target, reason, params, optional=False) -> patches.Patch:
    return patches.row(patches.CPU_SUPPORT, target, reason, params, optional=optional)


# each cpu-support patch and its shim
_SHIMS = {
    _cpu_support(
        "torch.cuda:current_device", "megatron-core allocates buffers there", ()
    ): _cpu_current_device,
    _cpu_support(
        "torch.cuda:get_rng_state", "the RNG tracker saves 'CUDA' states", patches.DEVICE_PARAM
    ): _cpu_get_rng_state,
    _cpu_support(
        "torch.cuda:manual_seed", "model_parallel_cuda_manual_seed", ("seed",)
    ): _cpu_manual_seed,
    _cpu_support(
        "megatron.core.transformer.utils:get_default_causal_mask",
        "local attention builds its causal mask with device='cuda'",
        ("sq",),
    ): _cpu_causal_mask,
    _cpu_support(
        "megatron.core.fusions.fused_softmax:get_default_causal_mask",
        "the same function, imported by name into the softmax module",
        ("sq",),
    ): _cpu_causal_mask,
    _cpu_support(
        "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
        "the RNG tracker restores CUDA generator states",
        ("new_state",),
    ): _cpu_set_rng_state,
    _cpu_support(
        "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
        "the RNG tracker reads CUDA generator states",
        (),
        optional=True,
    ): _cpu_get_rng_state,
    _cpu_support(
        "megatron.core.transformer.moe.router:router_gating_linear",
        "the MoE router's gating GEMM reads te_general_gemm, which core 0.16 leaves undefined "
        "without Transformer Engine",
        ("inp", "weight", "bias", "router_dtype"),
    ): _cpu_router_gating_linear,
    _cpu_support(
        "megatron.core.models.common.embeddings.rotary_pos_embedding:get_pos_emb_on_this_cp_rank",
        "RoPE under context parallelism indexes its table with a pinned CUDA tensor",
        ("pos_emb", "seq_dim", "cp_group"),
    ): _cpu_pos_emb_on_this_cp_rank,
}
patches.declare(_SHIMS)


def is_enabled() -> bool:
    return any(patches.is_active(p.mode, p.target) for p in _SHIMS)


def enable_cpu_support(force: bool = False) -> None:
    """Route megatron-core's CUDA-only helpers to the CPU (the ``cpu-support`` patches,
    ``_SHIMS``).

    ``force=True`` applies the shims even if CUDA is present (for tests of this module only).
    """
    if torch.cuda.is_available() and not force:
        raise RuntimeError(
            "enable_cpu_support() called on a machine with CUDA; the shims are for CPU-only runs"
        )
    import importlib

    for patch in _SHIMS:  # import all first: fused_softmax binds the unpatched mask function
        importlib.import_module(patch.module)
    for patch, shim in _SHIMS.items():
        patches.apply(patch.mode, patch.target, shim)


def disable_cpu_support() -> None:
    """Restore every function ``enable_cpu_support`` replaced."""
    patches.remove_mode(patches.CPU_SUPPORT)
