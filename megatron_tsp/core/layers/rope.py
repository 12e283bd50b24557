"""Rotary position embedding for TSP attention: tables built once per step, applied and inverted
without autograd.

A TP rank applies RoPE once to its q and once to its k; TSP attention applies it to the q and k of
each of the D head groups, forward and again in backward, so whatever one call costs is paid 4D
times per layer. Megatron's unfused RoPE (``rope_utils._apply_rotary_pos_emb_bshd``) recomputes
cos and sin from the angles on every call and is differentiated by autograd (about 12 kernels per
call and as many in backward). Here:

* ``local_tables`` builds, once per rotary embedding tensor and layout, the angles at this rank's
  token positions and, for the unfused path, cos and the signed sines in the compute dtype
  (Megatron's YaRN ``mscale`` folded in). ``GPTModel`` computes the embedding once per forward
  (and megatron-core's ``RotaryEmbedding.forward`` caches it across steps), so every layer and
  head group of a step reads one set of tables, cached on the embedding tensor itself;
* ``rotate(x, tables, out)`` writes RoPE(x) into ``out``, which may be a strided view (a slot of
  the K/V send buffer or of the QKV gradient): unfused, three kernels (``x*cos``, then one fused
  multiply-add per channel half: the sine product and the sum rounded once, where Megatron's
  unfused RoPE rounds the product and then the sum, so in bf16 a result may differ from
  Megatron's by that one rounding, TSP's being the closer); on CUDA with Triton, one kernel
  that writes ``out`` at its strides in fp32 arithmetic (``rope_kernel``, the default there;
  ``TSP_ROPE_KERNEL=torch`` keeps the unfused path); with ``apply_rope_fusion``, one call of the
  kernel Megatron uses (``rope_utils.fused_apply_rotary_pos_emb``, Transformer Engine's, looked
  up at call time) and a copy into ``out``;
* backward: RoPE rotates each (x_i, x_swap(i)) pair by an angle θ, so its adjoint is the
  rotation by -θ: ``rotate(dy, tables, out, inverse=True)``. Nothing is re-run under autograd and
  nothing but the tables is kept for it.

Unfused formula. With ``swap`` the pair partner of each rotary channel (i <-> i ± rot/2, or
2k <-> 2k+1 when interleaved) and ``sign`` -1 on a pair's first channel, +1 on its second,
Megatron's ``t*cos + rotate_half(t)*sin`` is y[i] = x[i] c[i] + x[swap(i)] s'[i] with
s'[i] = sign[i] s[i]. Computed as ``out = x*c``, then ``out[i] += x[swap(i)] * s'[i]`` over each
channel half (``addcmul_``). The adjoint is dx[j] = c[j] dy[j] + s'[swap(j)] dy[swap(j)]: the
same steps with each half taking its partner half's ``s'``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from megatron.core.models.common.embeddings import rope_utils

from megatron_tsp.core.layers import rope_kernel
from megatron_tsp.core.layout import TSPLayout

try:  # megatron-core >= 0.14
    from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config
except ImportError:  # pragma: no cover - older cores have no YaRN mscale
    _yarn_get_concentration_factor_from_config = None

_CACHE_ATTR = "_tsp_rope_tables"


def _mscale(config) -> float:
    if _yarn_get_concentration_factor_from_config is None:
        return 1.0
    return float(_yarn_get_concentration_factor_from_config(config))


class _NoCPGroup:
    """RoPE never reads the CP group for [s, b, ...] tensors; this avoids a global lookup."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


_NO_CP = _NoCPGroup()


def megatron_rotary(t: torch.Tensor, freqs: Optional[torch.Tensor], config) -> torch.Tensor:
    """Megatron's own ``apply_rotary_pos_emb`` of ``t`` [s, b, h, d] at ``freqs`` (its table rows
    for those positions; None: no RoPE), with the YaRN mscale Megatron's attention applies and
    no CP slicing (the caller indexes the table by the tokens' true positions). The prefill
    rotates through it; the training layer uses the cached tables of ``local_tables``."""
    if freqs is None:
        return t
    return rope_utils.apply_rotary_pos_emb(
        t, freqs, config=config, mscale=_mscale(config), cp_group=_NO_CP
    )


def fused_rope_kernel(config) -> Optional[Callable]:
    """The fused RoPE Megatron's ``apply_rotary_pos_emb`` would call for [s, b, h, d] tensors
    (``rope_utils.fused_apply_rotary_pos_emb``: Transformer Engine's), or None where Megatron runs
    the unfused formula: ``apply_rope_fusion`` off, or a YaRN ``mscale`` != 1 (which TE's kernel
    does not take). Looked up at call time, so a Transformer Engine imported late is seen."""
    if not getattr(config, "apply_rope_fusion", False) or _mscale(config) != 1.0:
        return None
    fused = getattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    if fused is None:
        raise ValueError(
            "apply_rope_fusion is set but megatron-core has no fused RoPE "
            "(rope_utils.fused_apply_rotary_pos_emb needs Transformer Engine); "
            "unset --apply-rope-fusion / apply_rope_fusion"
        )
    return fused


@dataclass(frozen=True)
class RopeTables:
    """This rank's RoPE tables for one embedding, dtype and layout.

    ``fused``: Transformer Engine's fused kernel, with ``tensors`` = (angles, -angles) fp32
    [t, 1, 1, rot]; ``one_kernel``: TSP's own kernel (``rope_kernel``), with ``tensors`` = (cos,
    s') fp32 [t, rot]; otherwise ``tensors`` = (cos, s') in the compute dtype, [t, 1, 1, rot]
    (see the module docstring). ``rot``: rotary channels (the rest of each head passes
    through)."""

    rot: int
    interleaved: bool
    fused: Optional[Callable]
    tensors: Tuple[torch.Tensor, ...]
    one_kernel: bool = False

    def with_tensors(self, tensors) -> "RopeTables":
        """The same tables rebuilt from ``tensors`` (e.g. what ``save_for_backward`` returns)."""
        return dataclasses.replace(self, tensors=tuple(tensors))


def _build(emb: torch.Tensor, layout: TSPLayout, dtype, config) -> RopeTables:
    if emb.dim() != 4 or emb.shape[1] != 1 or emb.shape[2] != 1:
        raise ValueError(f"TSP attention needs a [s, 1, 1, d] rotary table, got {tuple(emb.shape)}")
    if layout.context_parallel_size > 1:
        # Megatron's rotary embedding hands each CP rank its CP-local table (CP chunks c and
        # 2C-1-c), which holds exactly this CP rank's tokens (``TSPLayout.cp_local_positions``)
        if emb.shape[0] != layout.cp_local_len:
            raise ValueError(
                f"TSP x CP attention expects Megatron's CP-local rotary table of "
                f"{layout.cp_local_len} positions, got {emb.shape[0]}"
            )
        rows = layout.cp_local_positions(emb.device)
    else:
        seq = layout.seq_length
        if emb.shape[0] < seq:
            raise ValueError(f"rotary table covers {emb.shape[0]} positions, need {seq}")
        rows = layout.positions(emb.device)
    interleaved = bool(getattr(config, "rotary_interleaved", False))
    rot = emb.shape[-1]
    # Megatron's RoPE indexes its table by sequence index, not position_ids (see
    # zigzag.get_batch_on_this_tsp_rank for why the two agree): this rank's rows are at its
    # layout positions.
    with torch.no_grad():
        angles = emb.index_select(0, rows)
        # TSP's own kernel where it runs (it writes the strided destination, no copy; YaRN's
        # mscale folds into its tables), else Transformer Engine's when apply_rope_fusion asks
        one_kernel = rope_kernel.available(emb.device, dtype)
        fused = None if one_kernel else fused_rope_kernel(config)
        if fused is not None:
            return RopeTables(rot, interleaved, fused, (angles, -angles))
        mscale = _mscale(config)
        # one kernel: fp32 tables, fp32 arithmetic, one rounding (TE's fused numerics); else
        # exactly Megatron's unfused cos_ / sin_ (rope_utils._apply_rotary_pos_emb_bshd)
        table_dtype = torch.float32 if one_kernel else dtype
        cos = (torch.cos(angles) * mscale).to(table_dtype)
        sin = (torch.sin(angles) * mscale).to(table_dtype)
        sign = torch.ones(rot, dtype=table_dtype, device=emb.device)
        first = sign.unflatten(-1, (-1, 2))[..., 0] if interleaved else sign[: rot // 2]
        first.fill_(-1)
        signed = sin * sign  # s'
        if one_kernel:
            cos, signed = cos.view(-1, rot).contiguous(), signed.view(-1, rot).contiguous()
    return RopeTables(rot, interleaved, None, (cos, signed), one_kernel=one_kernel)


def local_tables(
    emb: Optional[torch.Tensor], layout: TSPLayout, dtype: torch.dtype, config
) -> Optional[RopeTables]:
    """This rank's tables for the rotary embedding ``emb`` ([S, 1, 1, rot] fp32 angles, natural
    positions), built on first use and cached on ``emb`` (keyed by layout, dtype, rotary options
    and ``emb``'s version counter), so the layers of a step share one set and a new embedding
    tensor starts a new cache."""
    if emb is None:
        return None
    key = (
        layout.group_size,
        layout.seq_length,
        layout.rank,
        layout.context_parallel_size,
        dtype,
        emb.device,
        emb._version,
        bool(getattr(config, "rotary_interleaved", False)),
        bool(getattr(config, "apply_rope_fusion", False)),
        _mscale(config),
        rope_kernel.available(emb.device, dtype),
    )
    cache = getattr(emb, _CACHE_ATTR, None)
    if cache is None:
        cache = {}
        setattr(emb, _CACHE_ATTR, cache)
    tables = cache.get(key)
    if tables is None:
        tables = cache[key] = _build(emb, layout, dtype, config)
    return tables


def _broadcast(table: torch.Tensor, ndim: int) -> torch.Tensor:
    """[t, 1, 1, rot] -> [t, 1, ..., 1, rot] with ``ndim`` dimensions (a view)."""
    return table.view(table.shape[0], *([1] * (ndim - 2)), table.shape[-1])


def _halves(t: torch.Tensor, interleaved: bool):
    """The two channel sets of the rotary pairs (views): first members, second members."""
    if interleaved:
        return t[..., 0::2], t[..., 1::2]
    half = t.shape[-1] // 2
    return t[..., :half], t[..., half:]


def rotate(
    x: torch.Tensor,
    tables: RopeTables,
    out: Optional[torch.Tensor] = None,
    inverse: bool = False,
) -> torch.Tensor:
    """RoPE of ``x`` [t, ..., d] (rotation by -θ when ``inverse``: the adjoint, for the
    backward), written into ``out`` (same shape, any strides; a new contiguous tensor when None).
    Returns ``out``. No autograd graph is recorded."""
    with torch.no_grad():
        if tables.fused is not None:
            angles = tables.tensors[1 if inverse else 0]
            # the fused kernel takes [s, b, h, d]: extra head dimensions are folded into b
            x4 = x if x.dim() == 4 else x.reshape(x.shape[0], -1, *x.shape[-2:])
            y = tables.fused(x4, angles, interleaved=tables.interleaved).view(x.shape)
            if out is None:
                return y
            return out.copy_(y)
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        cos, signed = tables.tensors
        if tables.one_kernel:
            return rope_kernel.rope_into(x, cos, signed, out, tables.interleaved, inverse)
        rot = tables.rot
        x_rot, out_rot = x[..., :rot], out[..., :rot]
        torch.mul(x_rot, _broadcast(cos, x.dim()), out=out_rot)
        x_first, x_second = _halves(x_rot, tables.interleaved)
        out_first, out_second = _halves(out_rot, tables.interleaved)
        s_first, s_second = _halves(_broadcast(signed, x.dim()), tables.interleaved)
        if inverse:  # the adjoint: each channel takes its partner's signed sine
            s_first, s_second = s_second, s_first
        out_first.addcmul_(x_second, s_first)
        out_second.addcmul_(x_first, s_second)
        if rot < x.shape[-1]:  # partial rotary: the other channels pass through
            out[..., rot:].copy_(x[..., rot:])
        return out
