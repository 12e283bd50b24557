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

Backends (``select_kernel`` picks one when a layer is built; the name and why it was chosen are in
the training log and the dry run). Only verified backends are chosen by default; the others run
only when named in ``TSP_ATTENTION_KERNEL`` (or ``override``):

=================  ===============================================================================
``aten_flash``     CUDA default where cuDNN's conditions fail, fp16/bf16, head_dim <= 256:
                   ``aten._scaled_dot_product_flash_attention`` (FA2; FA3/FA4 when the user
                   activated one with ``torch.nn.attention.activate_flash_attention_impl``). Its
                   causal mask is bottom-right for sq < sk: one call per zigzag chunk; GQA native.
``cudnn``          CUDA default on sm90+, fp16/bf16, MHA, head_dim in {64, 128}:
                   ``aten._scaled_dot_product_cudnn_attention`` with ``compute_log_sumexp``;
                   top-left causal only, so two calls + fp32 merge. Verified and timed on an
                   H200 (docs/gpu_check.md): one 7B layer step at 128k, D=8, took 146 ms with it
                   against 231 ms with ``aten_flash`` (FA2), the kernels' summed time at 32k
                   22.3 ms against 24.9.
``te_fused``       opt-in, CUDA fp16/bf16 with Transformer Engine 2.8-2.18 importable: TE's
                   ``fused_attn_fwd/bwd`` (``TeFusedKernel``): one ``causal_bottom_right`` call per
                   chunk on contiguous bshd copies, keywords chosen from TE's signatures; GQA
                   native. Checked on CPU against a contract emulator of TE (tests), not yet on a
                   GPU: ``scripts/gpu_check.py`` verifies it before it is ever timed.
``cpu_flash``      CPU default (any float dtype; also the path the fake-tensor memory tool
                   measures): ``aten._scaled_dot_product_flash_attention_for_cpu``; two calls +
                   merge.
``sdpa_recompute`` anything else (attention dropout, fp32 on CUDA, head_dim > 256): public SDPA
                   with a bottom-right ``causal_lower_right`` bias, no log-sum-exp, so the layer
                   recomputes the attention forward in backward under autograd.
=================  ===============================================================================

Slicing uses ``narrow`` and accumulation ``add_`` (never ``copy_``, ``contiguous`` or ``[...]``
indexing): those are what fake CUDA tensors support on a CPU-only torch, so the CUDA call sequence
can be traced without a GPU (``tests/test_kernels.py``). ``te_fused`` is the exception: TE reads
its inputs as contiguous, so it copies them; its call sequence is checked on CPU against a
contract emulator of TE instead (``tests/emulators/transformer_engine_emulator.py``).
"""

from __future__ import annotations

import inspect
import os
from typing import Callable, List, Optional, Sequence, Tuple

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
    """Exact merge of two key blocks' partial attentions (fp32 or wider), cast once to ``dtype``.
    The weights exp(lse_x - lse) are fp32 (the log-sum-exps are), so the products promote the
    bf16 / fp16 outputs as they read them: no separate upcast pass."""
    acc = accumulation_dtype(dtype)
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1).to(acc)
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1).to(acc)
    out = torch.mul(out_a, weight_a)
    out.addcmul_(out_b, weight_b)
    return out.to(dtype), lse


class AttentionKernel:
    """See the module docstring for the contract; subclasses implement one backend."""

    name = "abstract"
    native_gqa = False  # False: K/V repeated to the query heads, dK/dV folded back
    has_lse = True  # False: no (out, lse) forward; the layer recomputes under autograd
    # the backward holds contiguous copies of the chunk's K/V beside their dK/dV (read by the
    # planner's memory model, as ``native_gqa`` is)
    copies_kv = False
    selected_by = "direct"  # how select_kernel chose it: default / override / TSP_ATTENTION_KERNEL

    def forward(self, q, k, v, alignment: str, scale: float):
        raise NotImplementedError

    def backward(self, d_out, q, k, v, out, lse, alignment: str, scale: float):
        raise NotImplementedError

    def backward_parts(self, d_out, q, k, v, out, lse, alignment: str, scale: float):
        """``backward`` with dK and dV as tuples of tensors that follow one another along the
        key dimension (``[b, g, part, d]`` each). One part unless the kernel computes the keys
        in pieces (``_TopLeftKernel``), which then need not be joined: the TSP layer sums them
        straight into its send buffer (``TSPLayout.key_pieces``, ``row_sum_kernel``)."""
        dq, dk, dv = self.backward(d_out, q, k, v, out, lse, alignment, scale)
        return dq, (dk,), (dv,)

    def describe(self) -> str:
        """``name (why)``, e.g. "aten_flash (default)", for the log and the dry run."""
        return f"{self.name} ({self.selected_by})"

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
        dq, dk, dv = self.backward_parts(d_out, q, k, v, out, lse, alignment, scale)
        if len(dk) == 1:
            return dq, dk[0], dv[0]
        return dq, torch.cat(dk, dim=2), torch.cat(dv, dim=2)

    def backward_parts(self, d_out, q, k, v, out, lse, alignment, scale):
        """dK / dV of a bottom-right block as (prefix, diagonal): joining them is a full copy of
        the block's dK and dV (on an H200 at 7B/128k, 6.2 ms of a 145 ms layer step)."""
        groups = k.shape[1]
        k, v = self._prep(q, k, v)
        sq, sk = q.shape[2], k.shape[2]
        prefix = sk - sq
        if alignment == NO_MASK or alignment == TOP_LEFT or prefix == 0:
            dq, dk, dv = self._bwd(d_out, q, k, v, out, lse, alignment != NO_MASK, scale)
            dks, dvs = (dk,), (dv,)
        else:
            dq_a, dk_a, dv_a = self._bwd(
                d_out, q, k.narrow(2, 0, prefix), v.narrow(2, 0, prefix), out, lse, False, scale
            )
            dq_b, dk_b, dv_b = self._bwd(
                d_out, q, k.narrow(2, prefix, sq), v.narrow(2, prefix, sq), out, lse, True, scale
            )
            acc = accumulation_dtype(q.dtype)
            dq = dq_a.to(acc).add_(dq_b).to(q.dtype)
            dks, dvs = (dk_a, dk_b), (dv_a, dv_b)
        if not self.native_gqa:
            dks = tuple(_fold_heads(t, groups) for t in dks)
            dvs = tuple(_fold_heads(t, groups) for t in dvs)
        return dq, dks, dvs


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


TE_LAYOUT = "bshd_bshd_bshd"
TE_FORMAT = "bshd"
# TE's mask names: "causal" is aligned top-left, "causal_bottom_right" bottom-right.
TE_MASK = {NO_MASK: "no_mask", TOP_LEFT: "causal", BOTTOM_RIGHT: "causal_bottom_right"}
_TE_FWD_POSITIONAL = (
    "is_training",
    "max_seqlen_q",
    "max_seqlen_kv",
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "q",
    "k",
    "v",
    "fake_dtype",
    "fused_attention_backend",
)
_TE_BWD_POSITIONAL = (
    "max_seqlen_q",
    "max_seqlen_kv",
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "q",
    "k",
    "v",
    "o",
    "d_o",
    "fake_dtype",
    "dqkv_dtype",
    "aux_ctx_tensors",
    "fused_attention_backend",
)
_TE_USED_KEYWORDS = ("attn_scale", "dropout", "qkv_layout", "attn_mask_type")


def te_call_keywords(fwd, bwd):
    """The version-dependent keyword arguments of TE's ``fused_attn_fwd`` / ``fused_attn_bwd``,
    read from their signatures: ``(fwd_extra, bwd_extra, needs_dqkv_dtype)``.

    Every argument is passed by keyword, so a parameter added, removed or moved between TE
    releases cannot shift another (TE 2.15 removed ``fused_attn_bwd``'s positional
    ``dqkv_dtype``). The layout keywords TE 2.15 added (``o_format``, ``do_format``,
    ``dqkv_layout``) default to sbhd / a packed sbh3d buffer, so they are always passed, naming
    the separate bshd tensors this kernel hands over. Raises RuntimeError naming the parameters
    when the signature has a required parameter this kernel does not know or lacks one it uses.
    """
    problems = []
    extras = []
    for fn, known in ((fwd, _TE_FWD_POSITIONAL), (bwd, _TE_BWD_POSITIONAL)):
        params = inspect.signature(fn).parameters
        required = [
            n for n, p in params.items() if p.default is inspect.Parameter.empty and n != "self"
        ]
        unknown = [n for n in required if n not in known]
        missing = [n for n in known + _TE_USED_KEYWORDS if n not in params and n != "dqkv_dtype"]
        if unknown:
            problems.append(f"{fn.__name__} requires unknown parameters {unknown}")
        if missing:
            problems.append(f"{fn.__name__} lacks parameters {missing}")
        extras.append(params)
    if problems:
        raise RuntimeError(
            "TSP_ATTENTION_KERNEL=te_fused: this Transformer Engine's fused attention API is not "
            "one the te_fused kernel supports (TE 2.8-2.18 style): " + "; ".join(problems)
        )
    fwd_params, bwd_params = extras
    fwd_extra = {"o_format": TE_FORMAT} if "o_format" in fwd_params else {}
    bwd_extra = {
        name: value
        for name, value in (
            ("o_format", TE_FORMAT),
            ("do_format", TE_FORMAT),
            ("dqkv_layout", TE_LAYOUT),
        )
        if name in bwd_params
    }
    return fwd_extra, bwd_extra, "dqkv_dtype" in bwd_params


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """[b, n, s, d] -> [b, s, n, d] with contiguous memory: TE's C++ side wraps each tensor from
    its data pointer and sizes only and derives the strides from ``qkv_layout``, so a strided view
    (a K/V ``narrow`` of the packed buffer, q inside the QKV output, an sbhd output) would be read
    at the wrong offsets. A copy only where the view is not already laid out that way."""
    return t.transpose(1, 2).contiguous()


class TeFusedKernel(AttentionKernel):
    """Transformer Engine's fused attention (cuDNN inside TE, F16 arbitrary-seqlen backend)
    through ``transformer_engine.pytorch.cpp_extensions.fused_attn``. Imported lazily; opt-in
    only (``TSP_ATTENTION_KERNEL=te_fused``) until verified on a GPU by ``scripts/gpu_check.py``.

    One call per zigzag chunk with TE's ``causal_bottom_right`` mask (TE's "causal" is top-left);
    GQA native. Q/K/V (and O/dO in backward) are handed over as separate contiguous
    ``[b, s, n, d]`` tensors in the "bshd_bshd_bshd" layout; the output comes back
    ``[b, sq, h, d]``, the softmax statistics (the log-sum-exp of the scaled scores)
    ``[b, h, sq, 1]`` fp32, the gradients ``[b, s, n, d]`` each. The keyword arguments are
    chosen from the installed TE's signatures (``te_call_keywords``) when the kernel is built, so
    an unsupported TE fails at construction, not in the first backward. The contiguous copies
    cost one extra pass over a chunk's K/V (and q, O, dO) where the layer's views are strided."""

    name = "te_fused"
    native_gqa = True
    copies_kv = True

    def __init__(self):
        from transformer_engine.pytorch.cpp_extensions import fused_attn as te_fa

        self._te = te_fa
        self._backend = te_fa.FusedAttnBackend["F16_arbitrary_seqlen"]
        self._fwd_extra, self._bwd_extra, needs_dtype = te_call_keywords(
            te_fa.fused_attn_fwd, te_fa.fused_attn_bwd
        )
        self._te_dtype = None
        if needs_dtype:  # TE <= 2.14: dQ/dK/dV dtype as a TE DType
            from transformer_engine.pytorch.constants import TE_DType

            self._te_dtype = TE_DType

    @staticmethod
    def _cu_seqlens(b, sq, sk, device):
        """Cumulative sequence lengths [b + 1] (int32): TE takes the batch size from them."""
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=device)
        cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=device)
        return cu_q, cu_k

    @staticmethod
    def _expect(what, t, shape, dtype=None):
        if tuple(t.shape) != tuple(shape) or not t.is_contiguous() or (dtype and t.dtype != dtype):
            raise RuntimeError(
                f"te_fused: Transformer Engine returned {what} {tuple(t.shape)} {t.dtype} "
                f"(contiguous={t.is_contiguous()}), expected contiguous {tuple(shape)}"
                + (f" {dtype}" if dtype else "")
            )

    def forward(self, q, k, v, alignment, scale):
        b, h, sq, d = q.shape
        sk = k.shape[2]
        cu_q, cu_k = self._cu_seqlens(b, sq, sk, q.device)
        out, aux = self._te.fused_attn_fwd(
            is_training=True,
            max_seqlen_q=sq,
            max_seqlen_kv=sk,
            cu_seqlens_q=cu_q,
            cu_seqlens_kv=cu_k,
            q=_bshd(q),
            k=_bshd(k),
            v=_bshd(v),
            fake_dtype=q.dtype,
            fused_attention_backend=self._backend,
            attn_scale=scale,
            dropout=0.0,
            qkv_layout=TE_LAYOUT,
            attn_mask_type=TE_MASK[alignment],
            **self._fwd_extra,
        )
        self._expect("out", out, (b, sq, h, v.shape[-1]), q.dtype)
        self._expect("softmax stats", aux[0], (b, h, sq, 1), torch.float32)
        return out.transpose(1, 2), aux[0].view(b, h, sq)

    def backward(self, d_out, q, k, v, out, lse, alignment, scale):
        b, h, sq, d = q.shape
        g, sk = k.shape[1], k.shape[2]
        cu_q, cu_k = self._cu_seqlens(b, sq, sk, q.device)
        stats = lse.to(torch.float32).unsqueeze(-1).contiguous()
        # [softmax stats, rng_state]: the Philox seed/offset pair is read only with dropout > 0.
        aux = [stats, torch.zeros(2, dtype=torch.int64, device=q.device)]
        extra = dict(self._bwd_extra)
        if self._te_dtype is not None:
            extra["dqkv_dtype"] = self._te_dtype[q.dtype]
        dq, dk, dv, *_ = self._te.fused_attn_bwd(
            max_seqlen_q=sq,
            max_seqlen_kv=sk,
            cu_seqlens_q=cu_q,
            cu_seqlens_kv=cu_k,
            q=_bshd(q),
            k=_bshd(k),
            v=_bshd(v),
            o=_bshd(out),
            d_o=_bshd(d_out),
            fake_dtype=q.dtype,
            aux_ctx_tensors=aux,
            fused_attention_backend=self._backend,
            attn_scale=scale,
            dropout=0.0,
            qkv_layout=TE_LAYOUT,
            attn_mask_type=TE_MASK[alignment],
            **extra,
        )
        self._expect("dq", dq, (b, sq, h, d), q.dtype)
        self._expect("dk", dk, (b, sk, g, d), q.dtype)
        self._expect("dv", dv, (b, sk, g, v.shape[-1]), q.dtype)
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
    te_available: Optional[bool] = None,
    override: Optional[str] = None,
) -> str:
    """The backend name for these properties (pure function: the selection table of
    docs/attention-fast-path.md). Without ``override`` only verified backends are chosen:
    dropout -> ``sdpa_recompute``; CPU -> ``cpu_flash``; CUDA sm90+ fp16/bf16, MHA, head_dim 64
    or 128 -> ``cudnn``; other CUDA fp16/bf16 with a head_dim flash supports -> ``aten_flash``;
    otherwise ``sdpa_recompute``. ``te_fused`` runs only when named by ``override`` (or the
    ``TSP_ATTENTION_KERNEL`` environment variable, read by ``select_kernel``); an override that
    cannot run this case is refused by name."""
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
            te_note = f" transformer_engine_importable={bool(te_available)}"
            raise ValueError(
                f"{ENV_OVERRIDE}={override} cannot run device={device_type} dtype={dtype} "
                f"head_dim={head_dim} gqa={gqa} attention_dropout={dropout_p} "
                f"capability={capability}" + (te_note if override == "te_fused" else "")
            )
        return override
    if dropout_p > 0:
        return "sdpa_recompute"
    if device_type == "cpu":
        return "cpu_flash"
    if cudnn_ok:  # measured on an H200 (docs/gpu_check.md): faster than FA2 at 32k and 128k
        return "cudnn"
    if flash_ok:
        return "aten_flash"
    return "sdpa_recompute"


def select_kernel(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    gqa: bool,
    dropout_p: float = 0.0,
    override: Optional[str] = None,
) -> AttentionKernel:
    """Build the kernel for a layer (called once, at construction). A model built on the meta
    device (Megatron's lazy init, the dry run) is bound for the GPU: it gets the CUDA choice
    (without cuDNN, whose selection needs the device's compute capability).

    The kernel's ``selected_by`` says why: "default", "override" (the argument) or
    "TSP_ATTENTION_KERNEL" (the environment variable). A requested backend that cannot be built
    (``te_fused`` with an unsupported TE) raises; nothing falls back silently."""
    device = torch.device(device)
    device_type = "cuda" if device.type == "meta" else device.type
    capability = None
    if device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
    requested, why = override, "override"
    if not requested and os.environ.get(ENV_OVERRIDE):
        requested, why = os.environ[ENV_OVERRIDE], ENV_OVERRIDE
    te = _te_available() if requested == "te_fused" else False
    name = kernel_choice(device_type, dtype, head_dim, gqa, dropout_p, capability, te, requested)
    kernel = _BACKENDS[name]()
    kernel.selected_by = why if requested else "default"
    return kernel


def kernel_class(name: str) -> type:
    """The backend class of ``name`` (not built: its facts, e.g. ``native_gqa``, ``copies_kv``)."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention kernel {name!r}: choose one of {KERNEL_NAMES}")
    return _BACKENDS[name]


def get_kernel(name: str) -> AttentionKernel:
    return kernel_class(name)()


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


def _block_qkv(q, k_all, v_all, block: CausalBlock):
    """The [b, n, s, d] views of one block's queries and keys/values."""
    return (
        _heads_view(q.narrow(0, block.query_start, block.query_len)),
        _heads_view(k_all.narrow(0, block.key_start, block.key_len)),
        _heads_view(v_all.narrow(0, block.key_start, block.key_len)),
    )


def zigzag_forward(
    kernel: AttentionKernel, q, k_all, v_all, blocks: Sequence[CausalBlock], scale: float
):
    """q [sq, b, np, d] (the local queries, e.g. this rank's chunks in order); k_all, v_all
    [sk, b, ng, d] the key buffer the ``blocks`` index (``TSPLayout.causal_blocks``: natural
    order; ``gathered_blocks``: the gathered K/V as they arrive): one bottom-right causal call
    per block.

    Returns ``(outs, lses)``: per block the output rows [query_len, b, np * d] (q's dtype) and the
    fp32 log-sum-exp [b, np, query_len]; the caller keeps them for ``zigzag_backward``."""
    outs: List[torch.Tensor] = []
    lses: List[torch.Tensor] = []
    for block in blocks:
        o, lse = kernel.forward(*_block_qkv(q, k_all, v_all, block), BOTTOM_RIGHT, scale)
        outs.append(chunk_rows(o))
        lses.append(lse)
    return outs, lses


def zigzag_backward_sources(
    kernel: AttentionKernel,
    d_ctx,
    q,
    k_all,
    v_all,
    blocks: Sequence[CausalBlock],
    scale: float,
    outs,
    lses,
    after_first_block: Optional[Callable[[], None]] = None,
):
    """Gradients from the saved ``(outs, lses)`` of ``zigzag_forward``. Returns ``(dq,
    dk_sources, dv_sources)``: dq [sq, b, np, d] and per block ``(key_start,
    layout.KeyRows)``: the kernel's dK / dV rows in key order (``backward_parts``; in its
    dtype, never joined), for the layer to sum into its send buffer (``TSPLayout.key_pieces``).

    ``after_first_block``: called once the first block's backward has been issued (the layer
    posts the previous head group's dK/dV reduce-scatter there, behind compute already
    queued)."""
    b, dim = k_all.shape[1], k_all.shape[3]
    heads = q.shape[2]
    dq_parts, dks, dvs = [], [], []
    for i, block in enumerate(blocks):
        n = block.query_len
        rows = _heads_view(d_ctx.narrow(0, block.query_start, n).reshape(n, b, heads, dim))
        out = _heads_view(outs[i].view(n, b, heads, dim))
        dq_b, dk_b, dv_b = kernel.backward_parts(
            rows, *_block_qkv(q, k_all, v_all, block), out, lses[i], BOTTOM_RIGHT, scale
        )
        dq_parts.append(dq_b.permute(2, 0, 1, 3))
        dks.append((block.key_start, tuple(t.permute(2, 0, 1, 3) for t in dk_b)))
        dvs.append((block.key_start, tuple(t.permute(2, 0, 1, 3) for t in dv_b)))
        if i == 0 and after_first_block is not None:
            after_first_block()
    return torch.cat(dq_parts, dim=0), dks, dvs


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
    """``zigzag_backward_sources`` with dK/dV summed over the blocks: ``(dq, dkv_acc)``,
    ``dkv_acc`` [S, b, 2 * ng, d] (dK in the first ng heads, dV in the rest) of
    ``accumulation_dtype`` (fp32 for bf16/fp16); a given ``dkv_acc`` must be zeroed. For the
    reference paths (kernel check, memory tool); the TSP layer sums its blocks straight into
    its send buffer instead (``TSPLayout.key_pieces``)."""
    s, b, groups, dim = k_nat.shape
    if dkv_acc is None:
        dkv_acc = torch.zeros(
            (s, b, 2 * groups, dim), dtype=accumulation_dtype(q.dtype), device=q.device
        )
    dq, dks, dvs = zigzag_backward_sources(
        kernel, d_ctx, q, k_nat, v_nat, blocks, scale, outs, lses
    )
    for (start, dk_parts), (_, dv_parts) in zip(dks, dvs):
        for dk_c, dv_c in zip(dk_parts, dv_parts):
            window = dkv_acc.narrow(0, start, dk_c.shape[0])
            window.narrow(2, 0, groups).add_(dk_c)
            window.narrow(2, groups, groups).add_(dv_c)
            start += dk_c.shape[0]
    return dq, dkv_acc


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


# --------------------------------------------------------------------------------------------
# Packed documents (``documents.DocumentMask.segments``): per group of samples with the same
# documents, one bottom-right causal call per (chunk, document) segment over natural-order keys.
# Every local query row is in exactly one segment, so nothing is merged across segments.


def _sample_views(t: torch.Tensor, plan, dim: int = 1) -> torch.Tensor:
    """The samples of one ``SampleSegments`` (a view along the batch dimension ``dim``)."""
    if plan.sample_start == 0 and plan.sample_count == t.shape[dim]:
        return t
    return t.narrow(dim, plan.sample_start, plan.sample_count)


def document_forward(
    kernel: AttentionKernel, q, k_nat, v_nat, plans, scale: float, blocks: Sequence[CausalBlock]
):
    """``zigzag_forward`` for packed documents: q [sq, b, np, d] the local queries, k_nat /
    v_nat [S, b, ng, d] natural-order K/V, ``plans`` the ``SampleSegments`` of the batch. One
    bottom-right causal kernel call per segment (and group of samples); the outputs are written
    into one [sq, b, np * d] buffer and the log-sum-exps into one [b, np, sq] buffer.

    Returns ``(outs, lses)`` cut along ``blocks`` (the layer's per-chunk blocks), the shapes
    ``zigzag_forward`` returns for them, so the layer saves and reads them as it does for one
    document."""
    sq, b, heads, dim = q.shape
    out = q.new_empty((sq, b, heads * dim))
    lse = None
    for plan in plans:
        q_s, k_s, v_s = (_sample_views(t, plan) for t in (q, k_nat, v_nat))
        for seg in plan.blocks:
            o, l_seg = kernel.forward(*_block_qkv(q_s, k_s, v_s, seg), BOTTOM_RIGHT, scale)
            if lse is None:
                lse = torch.empty((b, heads, sq), dtype=l_seg.dtype, device=q.device)
            rows = _sample_views(out.narrow(0, seg.query_start, seg.query_len), plan)
            rows.copy_(chunk_rows(o))
            _sample_views(lse, plan, dim=0).narrow(2, seg.query_start, seg.query_len).copy_(l_seg)
    outs = [out.narrow(0, blk.query_start, blk.query_len) for blk in blocks]
    lses = [lse.narrow(2, blk.query_start, blk.query_len) for blk in blocks]
    return outs, lses


def document_backward(
    kernel: AttentionKernel,
    d_ctx,
    q,
    k_nat,
    v_nat,
    plans,
    scale: float,
    outs,
    lses,
    blocks: Sequence[CausalBlock],
    after_first_block: Optional[Callable[[], None]] = None,
):
    """Gradients from ``document_forward``'s saved ``(outs, lses)`` (cut along ``blocks``).
    Returns ``(dq, dkv)``: dq [sq, b, np, d] (each row written by its one segment) and dkv
    [S, b, 2 * ng, d] in natural key order (dK in the first ng heads, dV in the rest), the
    segments' dK / dV summed in ``accumulation_dtype`` (fp32 for bf16/fp16), for the layer to
    map onto the gathered layout and reduce-scatter. ``after_first_block`` as in
    ``zigzag_backward_sources``."""
    sq, b, heads, dim = q.shape
    s, _, groups, _ = k_nat.shape
    out = torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
    out = out.view(sq, b, heads, dim)
    lse = torch.cat(lses, dim=2) if len(lses) > 1 else lses[0]
    dq = torch.empty_like(q)
    dkv = torch.zeros((s, b, 2 * groups, dim), dtype=accumulation_dtype(q.dtype), device=q.device)
    first = True
    for plan in plans:
        q_s, k_s, v_s, o_s, g_s, dq_s, dkv_s = (
            _sample_views(t, plan) for t in (q, k_nat, v_nat, out, d_ctx, dq, dkv)
        )
        lse_s = _sample_views(lse, plan, dim=0)
        for seg in plan.blocks:
            n, start = seg.query_len, seg.query_start
            rows = _heads_view(g_s.narrow(0, start, n).reshape(n, -1, heads, dim))
            dq_b, dk_b, dv_b = kernel.backward_parts(
                rows,
                *_block_qkv(q_s, k_s, v_s, seg),
                _heads_view(o_s.narrow(0, start, n)),
                lse_s.narrow(2, start, n),
                BOTTOM_RIGHT,
                scale,
            )
            dq_s.narrow(0, start, n).copy_(dq_b.permute(2, 0, 1, 3))
            key = seg.key_start
            for dk_c, dv_c in zip(dk_b, dv_b):
                window = dkv_s.narrow(0, key, dk_c.shape[2])
                window.narrow(2, 0, groups).add_(dk_c.permute(2, 0, 1, 3))
                window.narrow(2, groups, groups).add_(dv_c.permute(2, 0, 1, 3))
                key += dk_c.shape[2]
            if first and after_first_block is not None:
                after_first_block()
            first = False
    return dq, dkv


def document_attend(
    kernel: SdpaRecomputeKernel,
    q,
    k_nat,
    v_nat,
    plans,
    scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """``zigzag_attend`` for packed documents (differentiable): [sq, b, np * d], the segments'
    outputs concatenated along the rows (they tile them in order) and the sample groups along
    the batch."""
    parts = []
    for plan in plans:
        q_s, k_s, v_s = (_sample_views(t, plan) for t in (q, k_nat, v_nat))
        rows = [
            chunk_rows(
                kernel.attend(*_block_qkv(q_s, k_s, v_s, seg), BOTTOM_RIGHT, scale, dropout_p)
            )
            for seg in plan.blocks
        ]
        parts.append(torch.cat(rows, dim=0) if len(rows) > 1 else rows[0])
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
