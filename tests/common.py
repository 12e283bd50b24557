"""Helpers used inside ranks by the distributed checks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tsp.core import parallel_state as tsp_state

DTYPES = {"float64": torch.float64, "float32": torch.float32}
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


_current = None  # tensor-parallel size of the groups alive in this process


def _ensure_groups(size: int) -> None:
    """Megatron groups with tensor-parallel size ``size`` (TSP-D uses the same groups as TP=D),
    re-created only when the size changes: group creation is the slow part of a check."""
    global _current
    if _current != size:
        tsp_state.destroy_model_parallel()
        tsp_state.initialize_model_parallel(
            tensor_sequence_parallel_size=size, create_gloo_process_groups=False
        )
        _current = size


def setup_tsp(d: int, seed: int = 1234) -> None:
    """Groups for TSP with group size d."""
    _ensure_groups(d)
    tsp_state._TSP_SIZE = d
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def setup_megatron_tp(tp: int, seed: int = 1234) -> None:
    """Plain Megatron groups with tensor-parallel size tp (TSP marked off)."""
    _ensure_groups(tp)
    tsp_state._TSP_SIZE = None
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def reset_groups() -> None:
    global _current
    tsp_state.destroy_model_parallel()
    _current = None


# Megatron-LM's effective fusion defaults (core_v0.16.1 and core_v0.19.0 agree), i.e. what a user
# gets without any --no-*-fusion flag, so the tests run the code paths users run:
# --no-bias-gelu-fusion / --no-bias-swiglu-fusion / --no-bias-dropout-fusion /
# --no-masked-softmax-fusion are all off by default. ``make_config`` also applies Megatron-LM's
# ``validate_args`` rule "no bias linear -> no bias-GeLU fusion" (its fused GeLU needs a bias).
# Two fusions stay off because they need CUDA extensions this CPU suite cannot have:
# * apply_rope_fusion: Transformer Engine's (or apex's) fused RoPE kernel; TransformerConfig
#   refuses the flag without TE;
# * gradient_accumulation_fusion: apex's fused_weight_gradient_mlp_cuda; ColumnParallelLinear
#   refuses the flag without it. (TSP's own main_grad path is tested by test_main_grad_contract
#   and test_zero_out_wgrad, which set the layer attribute directly.)
MEGATRON_LM_FUSION_DEFAULTS = dict(
    bias_activation_fusion=True,
    bias_dropout_fusion=True,
    masked_softmax_fusion=True,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
)

# Every fusion off. Only for tests that need Megatron's unfused code path, each saying why
# (e.g. an activation with no fused kernel, or the exact erf-GeLU of a hand-written reference).
FUSIONS_OFF = dict(
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
)


def make_config(d: int, dtype: torch.dtype, **overrides) -> TransformerConfig:
    """A small ``TransformerConfig`` for TP=d (+SP when d > 1) with Megatron-LM's default fusions
    (``MEGATRON_LM_FUSION_DEFAULTS``); ``overrides`` win (``**FUSIONS_OFF`` turns them off)."""
    fields = dict(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        use_cpu_initialization=True,
        params_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=d,
        sequence_parallel=d > 1,
    )
    fields.update(MEGATRON_LM_FUSION_DEFAULTS)
    fields.update(overrides)
    if (
        "bias_activation_fusion" not in overrides
        and not fields.get("gated_linear_unit", False)
        and not fields.get("add_bias_linear", True)
    ):
        fields["bias_activation_fusion"] = False  # Megatron-LM's validate_args does the same
    return TransformerConfig(**fields)


# ----------------------------------------------------------------------------- comparisons


def _as_tensor(value) -> torch.Tensor:
    return value.detach() if torch.is_tensor(value) else torch.tensor(value, dtype=torch.float64)


def relative_error(actual, expected) -> float:
    """max |actual - expected| / max |expected| (the max-norm relative error; the absolute error
    when ``expected`` is all zero). NaN when either side holds a NaN or Inf."""
    a, e = _as_tensor(actual), _as_tensor(expected)
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        return float("nan")
    diff = (a.to(torch.float64) - e.to(torch.float64)).abs().max().item() if a.numel() else 0.0
    scale = e.abs().max().item() if e.numel() else 0.0
    return diff / scale if scale > 0 else diff


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Backward-compatible name for ``relative_error``."""
    return relative_error(actual, expected)


def _nonfinite(t: torch.Tensor) -> str:
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    return ", ".join(p for p in (f"{nan} NaN" if nan else "", f"{inf} Inf" if inf else "") if p)


def assert_close(
    actual, expected, *, rtol: float, atol: float = 0.0, name: str = "value", what: str = ""
) -> dict:
    """Assert ``actual`` matches ``expected``; return ``{name: relative error}``.

    ``actual``/``expected``: tensors or numbers, or dicts of them with the same keys (a dict is
    compared entry by entry and the entries are named by their keys). An entry passes when both
    sides are finite everywhere, have the same shape, and ``max|a - e| <= atol + rtol *
    max|e|``. Any NaN or Inf, in either side, fails (Python's ``max`` silently skips NaN; this
    does not). The message names the worst entry and its relative error, then the next worst,
    prefixed by ``what`` (say what was compared and with which seed).
    """
    if isinstance(actual, dict) or isinstance(expected, dict):
        if not (isinstance(actual, dict) and isinstance(expected, dict)):
            raise AssertionError(f"{what}: cannot compare a dict with a {type(expected)!r}")
        if set(actual) != set(expected):
            raise AssertionError(
                f"{what}: names differ: only in actual {sorted(set(actual) - set(expected))}, "
                f"only in expected {sorted(set(expected) - set(actual))}"
            )
        if not actual:
            raise AssertionError(f"{what}: nothing to compare (empty dicts)")
        pairs = {str(k): (actual[k], expected[k]) for k in actual}
    else:
        pairs = {name: (actual, expected)}
    errors, failures = {}, []
    for key, (a_raw, e_raw) in pairs.items():
        a, e = _as_tensor(a_raw), _as_tensor(e_raw)
        if a.shape != e.shape:
            failures.append(
                (float("inf"), f"{key}: shape {tuple(a.shape)} != expected {tuple(e.shape)}")
            )
            errors[key] = float("inf")
            continue
        bad = [
            f"{side} has {_nonfinite(t)}"
            for side, t in (("actual", a), ("expected", e))
            if not torch.isfinite(t).all()
        ]
        if bad:
            failures.append((float("inf"), f"{key}: {'; '.join(bad)} (of {a.numel()})"))
            errors[key] = float("nan")
            continue
        scale = e.abs().max().item() if e.numel() else 0.0
        diff = (a.to(torch.float64) - e.to(torch.float64)).abs().max().item() if a.numel() else 0.0
        err = diff / scale if scale > 0 else diff
        errors[key] = err
        if not diff <= atol + rtol * scale:
            failures.append(
                (
                    err,
                    f"{key}: relative error {err:.3e} > rtol {rtol:.1e}"
                    + (f" (+ atol {atol:.1e})" if atol else ""),
                )
            )
    if failures:
        failures.sort(key=lambda f: -f[0])
        ranked = sorted(((v, k) for k, v in errors.items() if v == v), reverse=True)[:4]
        others = ", ".join(f"{k}={v:.2e}" for v, k in ranked)
        head = f"{what}: " if what else ""
        raise AssertionError(
            f"{head}{len(failures)} of {len(pairs)} mismatched; worst: {failures[0][1]}"
            + "".join(f"\n  {f[1]}" for f in failures[1:6])
            + (f"\n  largest relative errors: {others}" if others else "")
        )
    return errors


def group_info():
    group = tsp_state.get_tensor_sequence_parallel_group()
    return group, dist.get_world_size(group), dist.get_rank(group)


def thread_count() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


def reinit_cycles(n: int) -> int:
    """Re-initialise the groups n times through three layouts; return the thread count."""
    for _ in range(n):
        setup_tsp(2)
        setup_megatron_tp(1)
        setup_tsp(4)
    return thread_count()


def accessors_after_init(d: int) -> dict:
    """What the TSP accessors report, next to Megatron's own tensor-parallel group (which is the
    TSP group); megatron.core.parallel_state itself is left unpatched."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    setup_tsp(d)
    group = tsp_state.get_tensor_sequence_parallel_group()
    return {
        "size": tsp_state.get_tensor_sequence_parallel_world_size(),
        "rank": tsp_state.get_tensor_sequence_parallel_rank(),
        "mpu_size": mpu.get_tensor_model_parallel_world_size(),
        "is_tsp": tsp_state.is_tensor_sequence_parallel(),
        "mpu_unpatched": not hasattr(mpu, "get_tensor_sequence_parallel_world_size"),
        "group_ranks": dist.get_process_group_ranks(group),
        "dp_size": mpu.get_data_parallel_world_size(),
    }


# ----------------------------------------------------------------------------- references
# Built only from stock megatron-core modules (and, where megatron-core has no CPU module for a
# sequence-parallel config, from the textbook formula written here), never from megatron_tsp:
# a bug shared by the code under test and its reference would otherwise pass.


def reference_single_layer_spec(config):
    """Megatron's stock local layer spec (``get_gpt_layer_local_spec``) for the single-process
    TP=1 reference. Handed to ``GPTModel`` as a bare layer spec, the block adds Megatron's own
    final norm; on CPU both norms are megatron-core's ``WrappedTorchNorm`` (torch LayerNorm /
    RMSNorm with ``config.layernorm_epsilon``). It creates fp32 norm parameters whatever
    ``params_dtype`` is: call ``model.to(config.params_dtype)`` after building."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if config.tensor_model_parallel_size != 1:
        raise ValueError("the single-process reference is TP=1; use reference_tp_sp_block_spec")
    return get_gpt_layer_local_spec(normalization=config.normalization)


class FormulaNorm(torch.nn.Module):
    """LayerNorm / RMSNorm written from their definitions, for the TP+SP reference:
    megatron-core's CPU norm (``WrappedTorchNorm``) refuses sequence-parallel configs, and the
    package's ``SequenceParallelNorm`` is code under test.

    LayerNorm: ``(x - mean) / sqrt(var + eps) * weight + bias`` (biased variance);
    RMSNorm: ``x / sqrt(mean(x^2) + eps) * weight``. Parameters are named, initialised and tagged
    (``sequence_parallel``: replicated, gradients summed over the group) like Megatron's norms."""

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = None,
    ):
        super().__init__()
        self.kind = normalization or config.normalization
        if self.kind not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"FormulaNorm: normalization={self.kind!r} is not LayerNorm/RMSNorm")
        if config.layernorm_zero_centered_gamma or zero_centered_gamma:
            raise ValueError("FormulaNorm: zero-centred gamma is not part of the reference")
        self.eps = eps
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = (
            torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
            if self.kind == "LayerNorm"
            else None
        )
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "LayerNorm":
            centred = x - x.mean(dim=-1, keepdim=True)
            var = (centred * centred).mean(dim=-1, keepdim=True)
            return centred / torch.sqrt(var + self.eps) * self.weight + self.bias
        return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + self.eps) * self.weight


def reference_tp_sp_layer_spec(config):
    """Megatron's stock local layer spec (TP=D+SP baseline) with ``FormulaNorm`` as its norms."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=config.normalization))
    spec.submodules.input_layernorm = FormulaNorm
    spec.submodules.pre_mlp_layernorm = FormulaNorm
    return spec


def reference_tp_sp_block_spec(config):
    """Block spec of the stock Megatron TP=D+SP reference: ``reference_tp_sp_layer_spec`` layers
    and a ``FormulaNorm`` final norm (PP=1)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = reference_tp_sp_layer_spec(config)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * config.num_layers, layer_norm=FormulaNorm
    )


_SINGLE_RANK_GROUP = None


def single_rank_group():
    """A process group holding only this rank (created once per process; every rank of the
    default group must call this together the first time). Stock tensor-parallel modules built
    on it run as TP=1 on the full data, side by side with the TSP group."""
    global _SINGLE_RANK_GROUP
    if _SINGLE_RANK_GROUP is None:
        world = dist.get_world_size()
        _SINGLE_RANK_GROUP, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world)])
    return _SINGLE_RANK_GROUP


def stock_mlp(config):
    """megatron-core's ``MLP`` (TP=1 on ``single_rank_group``, ColumnParallelLinear /
    RowParallelLinear): the reference for the TSP MLP, activation and fusion choice included."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    if config.tensor_model_parallel_size != 1 or config.sequence_parallel:
        raise ValueError(
            "stock_mlp is the TP=1 reference: build its config with make_config(1, ..)"
        )
    return MLP(
        config,
        MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        tp_group=single_rank_group(),
    )


def zigzag_positions(seq: int, group_size: int, rank=None) -> list:
    """Token positions in zigzag order, from the chunk definition alone (independent of
    ``megatron_tsp.core.layout`` / ``zigzag``): ``seq`` tokens form 2D chunks of C = S/(2D)
    tokens, rank r holds chunk r then chunk 2D-1-r. With ``rank``: that rank's positions; without:
    every rank's, concatenated in rank order (the gathered order)."""
    d = group_size
    if seq % (2 * d):
        raise ValueError(f"{seq} tokens cannot form {2 * d} chunks")
    chunk = seq // (2 * d)
    ranks = range(d) if rank is None else [rank]
    return [c * chunk + i for r in ranks for c in (r, 2 * d - 1 - r) for i in range(chunk)]


def zigzag_rows(full: torch.Tensor, group_size: int, rank: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s local slice of a full-sequence tensor (sequence along ``dim``), by the
    definition in ``zigzag_positions``: the reference side of a layer check."""
    positions = zigzag_positions(full.shape[dim], group_size, rank)
    return full.index_select(dim, torch.tensor(positions, device=full.device))


def natural_order(gathered: torch.Tensor, group_size: int, dim: int) -> torch.Tensor:
    """A tensor in gathered (zigzag) order along ``dim`` put back into natural order, by the
    definition in ``zigzag_positions``."""
    positions = torch.tensor(zigzag_positions(gathered.shape[dim], group_size))
    out = torch.empty_like(gathered)
    out.index_copy_(dim, positions, gathered)
    return out


def expected_zigzag_batch(batch: dict, group_size: int) -> dict:
    """The TSP-permuted batch, built from the chunk definition alone (independent of
    ``megatron_tsp.core.zigzag``): the sequence is cut into 2D chunks of S/(2D) tokens and rank r
    holds chunks r and 2D-1-r, so the permuted sequence is chunks ``0, 2D-1, 1, 2D-2, ...``.
    ``[b, s]`` tensors are reordered along s, the ``[b, 1, s, s]`` attention mask along both
    sequence axes; anything else (None, scalars) is passed through."""
    d = group_size
    out = {}
    for key, value in batch.items():
        if not torch.is_tensor(value) or value.dim() < 2 or d == 1:
            out[key] = value
            continue
        seq = value.shape[-1] if key == "attention_mask" else value.shape[1]
        positions = zigzag_positions(seq, d)  # every rank's, in rank order
        if key == "attention_mask":
            out[key] = value[..., positions, :][..., positions]
        else:
            out[key] = value[:, positions]
    return out
