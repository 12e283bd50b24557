"""Attention kernels behind one interface: a block of queries against a block of keys.

``AttentionKernel.forward(q, k, v, alignment, scale) -> (out, lse)`` attends queries
``q [b, h, sq, d]`` to keys/values ``k, v [b, g, sk, d]`` (``h`` a multiple of ``g``: GQA) and
returns the output ``[b, h, sq, d]`` (q's dtype) and the fp32 log-sum-exp ``[b, h, sq]`` of each
query's scores. ``backward(d_out, q, k, v, out, lse, alignment, scale) -> (dq, dk, dv)`` uses the
saved ``(out, lse)`` only: the attention forward is never recomputed for it. ``alignment``:

* ``"none"``: every query sees every key;
* ``"top_left"``: query i sees keys j <= i;
* ``"bottom_right"``: query i sees keys j <= i + sk - sq (the queries are the LAST sq positions of
  the keys). TSP's zigzag chunk c attends keys [0, (c+1)C) this way: one call per chunk (the
  blocks of ``TSPLayout.causal_blocks``).

For sq == sk the two causal alignments coincide. A kernel whose causal mask is top-left only
(cuDNN, CPU flash) runs a bottom-right block as two calls, the unmasked prefix [0, sk-sq) and the
square causal diagonal, merged exactly in fp32 by their log-sum-exps
(``lse = logaddexp(lse_a, lse_b)``, ``out = e^(lse_a-lse) out_a + e^(lse_b-lse) out_b``); its
backward runs both blocks' backward with the MERGED ``(out, lse)`` (the identity ring attention
uses) and sums dq in fp32.

Backends (``select_kernel`` picks one when a layer is built; the name is in the log and dry run):

=================  ===============================================================================
``aten_flash``     CUDA fp16/bf16, head_dim <= 256: ``aten._scaled_dot_product_flash_attention``
                   (FA2; FA3/FA4 when the user activated one with
                   ``torch.nn.attention.activate_flash_attention_impl``). Its causal mask is
                   bottom-right for sq < sk: one call per zigzag chunk; GQA native (no repeat).
``cudnn``          CUDA sm90+, fp16/bf16, MHA, head_dim in {64, 128}, opt-in
                   (``TSP_ATTENTION_KERNEL=cudnn``): ``aten._scaled_dot_product_cudnn_attention``
                   with ``compute_log_sumexp``; top-left causal only, so two calls + fp32 merge.
``te_fused``       Transformer Engine 2.x fused attention (softmax stats via its ``FusedAttnFunc``),
                   only with ``--transformer-impl transformer_engine`` and TE importable.
``cpu_flash``      CPU (any float dtype; also the path the fake-tensor memory tool measures):
                   ``aten._scaled_dot_product_flash_attention_for_cpu``; two calls + merge.
``sdpa_recompute`` anything else (attention dropout, fp32 on CUDA, head_dim > 256): public SDPA
                   with a bottom-right ``causal_lower_right`` bias, no log-sum-exp, so the layer
                   recomputes the attention forward in backward under autograd.
=================  ===============================================================================

Slicing uses ``narrow`` and accumulation ``add_`` (never ``copy_``, ``contiguous`` or ``[...]``
indexing): those are what fake CUDA tensors support on a CPU-only torch, so the CUDA call sequence
can be traced without a GPU (``tests/test_kernels.py``).
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import torch

from megatron_tsp.core.layers.precision import accumulation_dtype
from megatron_tsp.core.layout import CausalBlock

NO_MASK, TOP_LEFT, BOTTOM_RIGHT = "none", "top_left", "bottom_right"
ALIGNMENTS = (NO_MASK, TOP_LEFT, BOTTOM_RIGHT)
KERNEL_NAMES = ("aten_flash", "cudnn", "te_fused", "cpu_flash", "sdpa_recompute")
ENV_OVERRIDE = "TSP_ATTENTION_KERNEL"

aten = torch.ops.aten


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, g, s, d] -> [b, heads, s, d] for kernels without native GQA (each key/value head
    serves heads/g query heads)."""
    groups = t.shape[1]
    return t if groups == heads else t.repeat_interleave(heads // groups, dim=1)


def _fold_heads(g: torch.Tensor, groups: int) -> torch.Tensor:
    """Adjoint of ``_expand_heads``: sum the query heads that shared a key/value head."""
    if g.shape[1] == groups:
        return g
    b, h, s, d = g.shape
    return g.unflatten(1, (groups, h // groups)).sum(2)


def merge_blocks(out_a, lse_a, out_b, lse_b, dtype):
    """Exact merge of two key blocks' partial attentions (fp32 or wider), cast once to ``dtype``."""
    acc = accumulation_dtype(dtype)
    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.mul(out_a.to(acc), torch.exp(lse_a - lse).unsqueeze(-1).to(acc))
    out.addcmul_(out_b.to(acc), torch.exp(lse_b - lse).unsqueeze(-1).to(acc))
    return out.to(dtype), lse


class AttentionKernel:
    """See the module docstring for the contract; subclasses implement one backend."""

    name = "abstract"
    native_gqa = False
    has_lse = True  # False: no (out, lse) forward; the layer recomputes under autograd

    def forward(self, q, k, v, alignment: str, scale: float):
        raise NotImplementedError

    def backward(self, d_out, q, k, v, out, lse, alignment: str, scale: float):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<attention kernel {self.name}>"


class _TopLeftKernel(AttentionKernel):
    """A kernel whose causal mask is top-left: bottom-right blocks run as prefix + diagonal."""

    def _fwd(self, q, k, v, causal: bool, scale: float):
        raise NotImplementedError

    def _bwd(self, d_out, q, k, v, out, lse, causal: bool, scale: float):
        raise NotImplementedError

    def _prep(self, q, k, v):
        if self.native_gqa:
            return k, v
        return _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])

    def forward(self, q, k, v, alignment, scale):
        k, v = self._prep(q, k, v)
        sq, sk = q.shape[2], k.shape[2]
        prefix = sk - sq
        if alignment == NO_MASK or alignment == TOP_LEFT or prefix == 0:
            return self._fwd(q, k, v, alignment != NO_MASK, scale)
        if prefix < 0:
            raise ValueError(f"bottom-right alignment needs sq <= sk, got {sq} > {sk}")
        out_a, lse_a = self._fwd(q, k.narrow(2, 0, prefix), v.narrow(2, 0, prefix), False, scale)
        out_b, lse_b = self._fwd(q, k.narrow(2, prefix, sq), v.narrow(2, prefix, sq), True, scale)
        return merge_blocks(out_a, lse_a, out_b, lse_b, q.dtype)

    def backward(self, d_out, q, k, v, out, lse, alignment, scale):
        groups = k.shape[1]
        k, v = self._prep(q, k, v)
        sq, sk = q.shape[2], k.shape[2]
        prefix = sk - sq
        if alignment == NO_MASK or alignment == TOP_LEFT or prefix == 0:
            dq, dk, dv = self._bwd(d_out, q, k, v, out, lse, alignment != NO_MASK, scale)
        else:
            dq_a, dk_a, dv_a = self._bwd(
                d_out, q, k.narrow(2, 0, prefix), v.narrow(2, 0, prefix), out, lse, False, scale
            )
            dq_b, dk_b, dv_b = self._bwd(
                d_out, q, k.narrow(2, prefix, sq), v.narrow(2, prefix, sq), out, lse, True, scale
            )
            acc = accumulation_dtype(q.dtype)
            dq = dq_a.to(acc).add_(dq_b).to(q.dtype)
            dk, dv = torch.cat([dk_a, dk_b], dim=2), torch.cat([dv_a, dv_b], dim=2)
        if not self.native_gqa:
            dk, dv = _fold_heads(dk, groups), _fold_heads(dv, groups)
        return dq, dk, dv


class CpuFlashKernel(_TopLeftKernel):
    name = "cpu_flash"

    def _fwd(self, q, k, v, causal, scale):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    def _bwd(self, d_out, q, k, v, out, lse, causal, scale):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out, q, k, v, out, lse, 0.0, causal, scale=scale
        )


def _no_rng(device) -> torch.Tensor:
    """Philox seed/offset placeholders: read by the CUDA backward only when dropout > 0."""
    return torch.empty((), dtype=torch.long, device=device)


class CudnnKernel(_TopLeftKernel):
    """cuDNN fused attention through ATen; its log-sum-exp is [b, h, sq, 1]."""

    name = "cudnn"

    def _fwd(self, q, k, v, causal, scale):
        res = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        return res[0], res[1].squeeze(-1)

    def _bwd(self, d_out, q, k, v, out, lse, causal, scale):
        sq, sk = q.shape[2], k.shape[2]
        return aten._scaled_dot_product_cudnn_attention_backward(
            d_out,
            q,
            k,
            v,
            out,
            lse.unsqueeze(-1),
            _no_rng(q.device),
            _no_rng(q.device),
            None,
            None,
            None,
            sq,
            sk,
            0.0,
            causal,
            scale=scale,
        )


class AtenFlashKernel(AttentionKernel):
    """FA2 (or an activated FA3/FA4) through ATen. Its ``is_causal`` is bottom-right aligned
    whenever sq < sk (torch's own ``causal_lower_right`` dispatch relies on this), so a zigzag
    chunk is ONE call; key/value heads are shared natively (GQA without repeat)."""

    name = "aten_flash"
    native_gqa = True

    def forward(self, q, k, v, alignment, scale):
        if alignment == TOP_LEFT and q.shape[2] != k.shape[2]:
            raise ValueError("aten_flash's causal mask is bottom-right for sq != sk")
        res = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, alignment != NO_MASK, False, scale=scale
        )
        return res[0], res[1]

    def backward(self, d_out, q, k, v, out, lse, alignment, scale):
        sq, sk = q.shape[2], k.shape[2]
        return aten._scaled_dot_product_flash_attention_backward(
            d_out,
            q,
            k,
            v,
            out,
            lse,
            None,
            None,
            sq,
            sk,
            0.0,
            alignment != NO_MASK,
            _no_rng(q.device),
            _no_rng(q.device),
            scale=scale,
        )


class TeFusedKernel(_TopLeftKernel):
    """Transformer Engine's fused attention (cuDNN inside TE) with softmax statistics, through
    TE 2.x's ``fused_attn_fwd`` / ``fused_attn_bwd`` in the "bshd" layout. Imported lazily: a
    machine without TE never touches it. Top-left causal ("causal" mask type), so bottom-right
    blocks are split and merged like cuDNN's. NOT verified on a GPU yet (see
    docs/attention-fast-path.md)."""

    name = "te_fused"
    native_gqa = True

    def __init__(self):
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.constants import TE_DType
        from transformer_engine.pytorch.cpp_extensions import fused_attn as te_fa

        self._te, self._te_dtype = te_fa, TE_DType
        self._backend = tex.NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen

    def _fwd(self, q, k, v, causal, scale):
        te = self._te
        b, h, sq, d = q.shape
        sk = k.shape[2]
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
        cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=q.device)
        out, aux = te.fused_attn_fwd(
            True,
            sq,
            sk,
            cu_q,
            cu_k,
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            q.dtype,
            self._backend,
            attn_scale=scale,
            dropout=0.0,
            qkv_layout="bshd_bshd_bshd",
            attn_mask_type="causal" if causal else "no_mask",
        )
        lse = aux[0].reshape(b, h, sq)
        return out.view(b, sq, h, d).transpose(1, 2), lse

    def _bwd(self, d_out, q, k, v, out, lse, causal, scale):
        te = self._te
        b, h, sq, d = q.shape
        sk = k.shape[2]
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
        cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=q.device)
        dq, dk, dv, *_ = te.fused_attn_bwd(
            sq,
            sk,
            cu_q,
            cu_k,
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out.transpose(1, 2),
            d_out.transpose(1, 2),
            q.dtype,
            self._te_dtype[q.dtype],
            [lse.unsqueeze(-1), _no_rng(q.device)],
            self._backend,
            attn_scale=scale,
            dropout=0.0,
            qkv_layout="bshd_bshd_bshd",
            attn_mask_type="causal" if causal else "no_mask",
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class SdpaRecomputeKernel(AttentionKernel):
    """Public SDPA with a bottom-right ``causal_lower_right`` bias (attention dropout allowed).
    No log-sum-exp: the layer runs ``attend`` under autograd, in forward and again in backward."""

    name = "sdpa_recompute"
    native_gqa = True
    has_lse = False

    def attend(self, q, k, v, alignment, scale, dropout_p=0.0):
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right
        from torch.utils._python_dispatch import _disable_current_modes

        mask, causal = None, False
        sq, sk = q.shape[2], k.shape[2]
        if alignment == TOP_LEFT or (alignment == BOTTOM_RIGHT and sq == sk):
            causal = True
        elif alignment == BOTTOM_RIGHT:
            # CausalBias is a tensor subclass: build it outside any fake/tracing mode (no data).
            with _disable_current_modes():
                mask = causal_lower_right(sq, sk)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=causal,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )


_BACKENDS = {
    "aten_flash": AtenFlashKernel,
    "cudnn": CudnnKernel,
    "te_fused": TeFusedKernel,
    "cpu_flash": CpuFlashKernel,
    "sdpa_recompute": SdpaRecomputeKernel,
}


def _te_available() -> bool:
    try:
        import transformer_engine.pytorch.cpp_extensions.fused_attn  # noqa: F401
    except Exception:  # ImportError, or a TE build that fails to load its library
        return False
    return True


def kernel_choice(
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    gqa: bool,
    dropout_p: float = 0.0,
    capability: Optional[Tuple[int, int]] = None,
    transformer_impl: str = "local",
    te_available: Optional[bool] = None,
    override: Optional[str] = None,
) -> str:
    """The backend name for these properties (pure function: the selection table of
    docs/attention-fast-path.md). ``override`` (or the ``TSP_ATTENTION_KERNEL`` environment
    variable, read by ``select_kernel``) forces a backend; it is refused by name if it cannot run
    this case."""
    low = dtype in (torch.float16, torch.bfloat16)
    flash_ok = device_type == "cuda" and low and head_dim <= 256 and head_dim % 8 == 0
    cudnn_ok = (
        flash_ok
        and not gqa
        and head_dim in (64, 128)
        and capability is not None
        and capability >= (9, 0)
    )
    if override:
        if override not in _BACKENDS:
            raise ValueError(f"{ENV_OVERRIDE}={override!r}: choose one of {KERNEL_NAMES}")
        ok = {
            "aten_flash": flash_ok,
            "cudnn": cudnn_ok,
            "te_fused": flash_ok and bool(te_available),
            "cpu_flash": device_type == "cpu",
            "sdpa_recompute": True,
        }[override]
        if not ok or (dropout_p > 0 and override != "sdpa_recompute"):
            raise ValueError(
                f"{ENV_OVERRIDE}={override} cannot run device={device_type} dtype={dtype} "
                f"head_dim={head_dim} gqa={gqa} attention_dropout={dropout_p} "
                f"capability={capability}"
            )
        return override
    if dropout_p > 0:
        return "sdpa_recompute"
    if device_type == "cpu":
        return "cpu_flash"
    if flash_ok and transformer_impl == "transformer_engine" and te_available:
        return "te_fused"
    if flash_ok:
        return "aten_flash"
    return "sdpa_recompute"


def select_kernel(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    gqa: bool,
    dropout_p: float = 0.0,
    transformer_impl: str = "local",
    override: Optional[str] = None,
) -> AttentionKernel:
    """Build the kernel for a layer (called once, at construction). A model built on the meta
    device (Megatron's lazy init, the dry run) is bound for the GPU: it gets the CUDA choice
    (without cuDNN, whose selection needs the device's compute capability)."""
    device = torch.device(device)
    device_type = "cuda" if device.type == "meta" else device.type
    capability = None
    if device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
    te = _te_available() if transformer_impl == "transformer_engine" else False
    name = kernel_choice(
        device_type,
        dtype,
        head_dim,
        gqa,
        dropout_p,
        capability,
        transformer_impl,
        te,
        override or os.environ.get(ENV_OVERRIDE) or None,
    )
    if name == "te_fused":
        try:
            return TeFusedKernel()
        except Exception:  # a TE build without the expected fused-attention API: ATen flash
            return AtenFlashKernel()
    return _BACKENDS[name]()


def get_kernel(name: str) -> AttentionKernel:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention kernel {name!r}: choose one of {KERNEL_NAMES}")
    return _BACKENDS[name]()


# --------------------------------------------------------------------------------------------
# Causal attention as a sequence of blocks (``layout.CausalBlock``): TSP's zigzag chunks are
# ``TSPLayout.causal_blocks`` (local chunk c against natural-order keys [0, (c+1)C), bottom-right)


def _heads_view(t: torch.Tensor) -> torch.Tensor:
    """[s, b, n, d] -> [b, n, s, d] (a view)."""
    return t.permute(1, 2, 0, 3)


def chunk_rows(out_c: torch.Tensor) -> torch.Tensor:
    """A chunk's output [b, h, C, d] as rows [C, b, h * d] (a view for kernels that allocate
    like the query, which is itself a view of [C, b, h, d] memory; a copy otherwise)."""
    b, h, c, d = out_c.shape
    return out_c.permute(2, 0, 1, 3).reshape(c, b, h * d)


def _block_qkv(q, k_nat, v_nat, block: CausalBlock):
    """The [b, n, s, d] views of one block's queries and keys/values."""
    return (
        _heads_view(q.narrow(0, block.query_start, block.query_len)),
        _heads_view(k_nat.narrow(0, 0, block.key_len)),
        _heads_view(v_nat.narrow(0, 0, block.key_len)),
    )


def zigzag_forward(
    kernel: AttentionKernel, q, k_nat, v_nat, blocks: Sequence[CausalBlock], scale: float
):
    """q [sq, b, np, d] (the local queries, e.g. this rank's chunks in order); k_nat, v_nat
    [S, b, ng, d] natural order; ``blocks``: the causal blocks (``TSPLayout.causal_blocks``).

    Returns ``(outs, lses)``: per block the output rows [query_len, b, np * d] (q's dtype) and the
    fp32 log-sum-exp [b, np, query_len]; the caller keeps them for ``zigzag_backward``."""
    outs: List[torch.Tensor] = []
    lses: List[torch.Tensor] = []
    for block in blocks:
        o, lse = kernel.forward(*_block_qkv(q, k_nat, v_nat, block), BOTTOM_RIGHT, scale)
        outs.append(chunk_rows(o))
        lses.append(lse)
    return outs, lses


def zigzag_backward(
    kernel: AttentionKernel,
    d_ctx,
    q,
    k_nat,
    v_nat,
    blocks: Sequence[CausalBlock],
    scale: float,
    outs,
    lses,
    dkv_acc: Optional[torch.Tensor] = None,
):
    """Gradients from the saved ``(outs, lses)``: ``dq`` [sq, b, np, d] and dK/dV summed over the
    blocks in an accumulator of ``accumulation_dtype`` (fp32 for bf16/fp16).

    ``dkv_acc``: optional zeroed [S, b, 2 * ng, d] accumulator (dK in the first ng heads, dV in
    the rest), the packed layout the reduce-scatter sends; allocated when None. Returns
    ``(dq, dkv_acc)``."""
    s, b, groups, dim = k_nat.shape
    heads = q.shape[2]
    if dkv_acc is None:
        dkv_acc = torch.zeros(
            (s, b, 2 * groups, dim), dtype=accumulation_dtype(q.dtype), device=q.device
        )
    dq_parts = []
    for i, block in enumerate(blocks):
        rows_len = block.query_len
        rows = d_ctx.narrow(0, block.query_start, rows_len).reshape(rows_len, b, heads, dim)
        out = outs[i].view(rows_len, b, heads, dim)
        dq_c, dk_c, dv_c = kernel.backward(
            _heads_view(rows),
            *_block_qkv(q, k_nat, v_nat, block),
            _heads_view(out),
            lses[i],
            BOTTOM_RIGHT,
            scale,
        )
        dq_parts.append(dq_c.permute(2, 0, 1, 3))
        window = dkv_acc.narrow(0, 0, block.key_len)
        window.narrow(2, 0, groups).add_(dk_c.permute(2, 0, 1, 3))
        window.narrow(2, groups, groups).add_(dv_c.permute(2, 0, 1, 3))
    return torch.cat(dq_parts, dim=0), dkv_acc


def zigzag_attend(
    kernel: SdpaRecomputeKernel,
    q,
    k_nat,
    v_nat,
    blocks: Sequence[CausalBlock],
    scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Differentiable blockwise causal attention through public SDPA: [sq, b, np * d]."""
    outs = []
    for block in blocks:
        o = kernel.attend(*_block_qkv(q, k_nat, v_nat, block), BOTTOM_RIGHT, scale, dropout_p)
        outs.append(chunk_rows(o))
    return torch.cat(outs, dim=0)
