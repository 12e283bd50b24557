"""A CPU contract emulator of Transformer Engine's fused attention (``fused_attn_fwd`` /
``fused_attn_bwd`` of ``transformer_engine.pytorch.cpp_extensions.fused_attn``), so the
``te_fused`` kernel's call sequence runs in the CPU test suite and fails where the real library
would compute something else.

What it reproduces, and from which part of TE (releases 2.8 and 2.15-2.18):

* **Signatures.** ``fused_attn_fwd`` / ``fused_attn_bwd`` have the parameter names, order and
  defaults of the chosen release (``VERSIONS``): "2.8" has ``fused_attn_bwd``'s positional
  ``dqkv_dtype`` after ``fake_dtype``; "2.15" has none, and has the ``o_format`` (default "sbhd"),
  ``do_format`` ("sbhd") and ``dqkv_layout`` ("sbh3d") keywords. A positional call therefore
  shifts exactly as on the real library, and the Python-side checks run in TE's order (so the
  2.8 positional call on 2.15 dies in ``len(aux_ctx_tensors)`` with a TypeError).
* **Tensors from data pointers.** TE's C++ extension wraps every tensor from its data pointer,
  dtype and sizes only; the strides come from ``qkv_layout`` (and the batch size from
  ``cu_seqlens_q``). The emulator reads each input through its storage from its storage offset
  with the contiguous strides of the layout's format (``torch.as_strided`` on the storage),
  ignoring the tensor's own strides: a strided view is misread as on the GPU; a read past the
  storage raises.
* **Masks.** "no_mask"; "causal" aligned top-left (query i sees keys j <= i);
  "causal_bottom_right" aligned bottom-right (j <= i + sk - sq); the "padding*" variants only
  with sequence lengths equal to the maxima (anything else is outside what is emulated).
* **Outputs.** Forward: O allocated with Q's sizes (2.8) or Q's sizes converted to ``o_format``
  (2.15) and written in the memory order of ``qkv_layout`` (the F16 arbitrary-seqlen kernel takes
  O's strides from ``qkv_layout``); ``aux_ctx_tensors = [softmax stats [b, h, sq, 1] fp32
  (the log-sum-exp of the scaled scores), rng_state [2] int64]``. Backward: recomputes the
  probabilities from the GIVEN stats and uses the GIVEN O (as cuDNN's backward does), reads O
  and dO with ``qkv_layout``'s strides, allocates dQ/dK/dV per ``qkv_layout`` (2.8) or
  ``dqkv_layout`` (2.15: packed groups share one buffer shaped by Q) and writes each gradient in
  ``qkv_layout``'s memory order at its pointer: overlapping buffers clobber each other, a write
  past the buffer raises.

Arithmetic is plain float64 math (the result is cast to the input dtype). TE accepts only
fp16/bf16; ``install(..., wide_dtypes=True)`` also lets fp32/fp64 through so the kernel tests can
compare at fp64 precision (the only departure from the contract). Only the F16 arbitrary-seqlen
backend and the separate-tensor layouts "bshd_bshd_bshd" / "sbhd_sbhd_sbhd" are emulated; other
arguments raise NotImplementedError rather than being ignored.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import types
from typing import List, Optional

import torch

VERSIONS = ("2.8", "2.15")


class NVTE_Fused_Attn_Backend(enum.IntEnum):
    NVTE_F16_max512_seqlen = 0
    NVTE_F16_arbitrary_seqlen = 1
    NVTE_FP8 = 2
    NVTE_No_Backend = -1


class DType(enum.IntEnum):
    kByte = 0
    kInt32 = 2
    kInt64 = 3
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat64 = 99  # not a TE type: only reachable with wide_dtypes


TE_DType = {
    torch.uint8: DType.kByte,
    torch.int32: DType.kInt32,
    torch.float32: DType.kFloat32,
    torch.half: DType.kFloat16,
    torch.bfloat16: DType.kBFloat16,
    torch.float64: DType.kFloat64,
}
_TORCH_OF = {v: k for k, v in TE_DType.items()}

FusedAttnBackend = {
    "F16_max512_seqlen": NVTE_Fused_Attn_Backend.NVTE_F16_max512_seqlen,
    "F16_arbitrary_seqlen": NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen,
    "FP8": NVTE_Fused_Attn_Backend.NVTE_FP8,
    "No_Backend": NVTE_Fused_Attn_Backend.NVTE_No_Backend,
}

# separate-tensor layouts: format of Q and of K/V
_SEPARATE = {"bshd_bshd_bshd": "bshd", "sbhd_sbhd_sbhd": "sbhd"}
# packed dQ/dK/dV groups TE 2.15 allocates for ``dqkv_layout`` (format, group)
_PACKED = {
    "sb3hd": ("sbhd", "3hd"),
    "sbh3d": ("sbhd", "h3d"),
    "bs3hd": ("bshd", "3hd"),
    "bsh3d": ("bshd", "h3d"),
    "sbhd_sb2hd": ("sbhd", "2hd"),
    "sbhd_sbh2d": ("sbhd", "h2d"),
    "bshd_bs2hd": ("bshd", "2hd"),
    "bshd_bsh2d": ("bshd", "h2d"),
}


class Emulator:
    """State of one installed emulator: the version, the dtype policy and a log of calls."""

    def __init__(self, version: str, wide_dtypes: bool = False):
        if version not in VERSIONS:
            raise ValueError(f"emulated TE versions: {VERSIONS}, got {version!r}")
        self.version = version
        self.wide_dtypes = wide_dtypes
        self.calls: List[dict] = []

    # ---------------------------------------------------------------- helpers (the C++ side)

    def _check_dtype(self, t: torch.Tensor, what: str) -> None:
        ok = (torch.float16, torch.bfloat16)
        if self.wide_dtypes:
            ok += (torch.float32, torch.float64)
        if t.dtype not in ok:
            raise RuntimeError(
                f"Fused attention only supports FP8 and BF16/FP16 data types ({what}: {t.dtype})"
            )


def _dims(fmt: str, b: int, s: int, n: int, d: int):
    return (b, s, n, d) if fmt == "bshd" else (s, b, n, d)


def _contig_strides(shape):
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def _read(t: torch.Tensor, fmt: str, b: int, s: int, n: int, d: int) -> torch.Tensor:
    """What TE reads from ``t``'s data pointer: [b, n, s, d] float64, assuming the contiguous
    strides of ``fmt`` (the tensor's own strides are never looked at)."""
    shape = _dims(fmt, b, s, n, d)
    raw = t.as_strided(shape, _contig_strides(shape), t.storage_offset())
    raw = raw.double()
    return raw.permute(0, 2, 1, 3) if fmt == "bshd" else raw.permute(1, 2, 0, 3)


def _write(dest: torch.Tensor, value: torch.Tensor, fmt: str) -> None:
    """Write ``value`` [b, n, s, d] at ``dest``'s data pointer in the contiguous memory order of
    ``fmt`` (``dest``'s own shape and strides are ignored, as the kernel ignores them)."""
    b, n, s, d = value.shape
    shape = _dims(fmt, b, s, n, d)
    region = dest.as_strided(shape, _contig_strides(shape), dest.storage_offset())
    src = value.permute(0, 2, 1, 3) if fmt == "bshd" else value.permute(2, 0, 1, 3)
    with torch.no_grad():
        region.copy_(src.to(dest.dtype))


def _mask(kind: str, sq: int, sk: int, cu_q, cu_k, max_q, max_k) -> Optional[torch.Tensor]:
    """Boolean [sq, sk], True where a key is hidden; None for no mask."""
    if kind.startswith("padding"):
        lens_q = (cu_q[1:] - cu_q[:-1]).tolist()
        lens_k = (cu_k[1:] - cu_k[:-1]).tolist()
        if any(x != max_q for x in lens_q) or any(x != max_k for x in lens_k):
            raise NotImplementedError("emulator: padding masks with padded sequences")
        kind = kind[len("padding") :].lstrip("_") or "no_mask"
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(sk).unsqueeze(0)
    if kind == "no_mask":
        return None
    if kind == "causal":
        return j > i
    if kind == "causal_bottom_right":
        return j > i + (sk - sq)
    raise NotImplementedError(f"emulator: attn_mask_type={kind!r}")


def _layout_of(qkv_layout: str) -> str:
    if qkv_layout not in _SEPARATE:
        raise NotImplementedError(
            f"emulator: qkv_layout={qkv_layout!r} (emulated: {sorted(_SEPARATE)})"
        )
    return _SEPARATE[qkv_layout]


def _scores(q, k, scale, mask):
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, 1)  # TE: query head i reads key/value head i // (h / g)
    s = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    return s


def _fwd_impl(em: Emulator, a: dict):
    em.calls.append(dict(op="fwd", **a))
    if a["fused_attention_backend"] == FusedAttnBackend["No_Backend"]:
        raise AssertionError("Fused attention does not support this input combination.")
    if a["fused_attention_backend"] != FusedAttnBackend["F16_arbitrary_seqlen"]:
        raise NotImplementedError("emulator: only the F16 arbitrary-seqlen backend")
    if a.get("attn_bias_type", "no_bias") != "no_bias" or a.get("softmax_type") != "vanilla":
        raise NotImplementedError("emulator: bias / non-vanilla softmax")
    if tuple(a.get("window_size", (-1, -1))) not in ((-1, -1), (-1, 0)):
        raise NotImplementedError("emulator: sliding window")
    if a["dropout"] != 0.0:
        raise NotImplementedError("emulator: dropout")
    if not isinstance(a["fake_dtype"], torch.dtype):
        raise TypeError(f"fused_attn_fwd(): fake_dtype must be a torch.dtype: {a['fake_dtype']}")
    q, k, v = a["q"], a["k"], a["v"]
    for name in ("q", "k", "v"):
        em._check_dtype(a[name], name)
    for name in ("cu_seqlens_q", "cu_seqlens_kv"):
        if a[name].dtype != torch.int32:
            raise RuntimeError(f"{name} must be int32")
    fmt = _layout_of(a["qkv_layout"])
    b = a["cu_seqlens_q"].shape[0] - 1
    sq, sk = a["max_seqlen_q"], a["max_seqlen_kv"]
    h, d = q.shape[-2], q.shape[-1]
    g, dv = k.shape[-2], v.shape[-1]
    scale = a["attn_scale"] if a["attn_scale"] is not None else d**-0.5
    qr = _read(q, fmt, b, sq, h, d)
    kr = _read(k, fmt, b, sk, g, d)
    vr = _read(v, fmt, b, sk, g, dv)
    mask = _mask(a["attn_mask_type"], sq, sk, a["cu_seqlens_q"], a["cu_seqlens_kv"], sq, sk)
    s = _scores(qr, kr, scale, mask)
    lse = torch.logsumexp(s, dim=-1)  # [b, h, sq]
    rep = h // g
    out = torch.softmax(s, dim=-1) @ vr.repeat_interleave(rep, 1)  # [b, h, sq, dv]
    o_shape = list(q.shape[:-1]) + [dv]  # Q's sizes, last dim of V
    if em.version != "2.8":  # 2.15: Q's sizes converted from Q's format to o_format
        o_fmt = a["o_format"]
        if o_fmt not in ("bshd", "sbhd"):
            raise NotImplementedError(f"emulator: o_format={o_fmt!r}")
        if o_fmt != fmt:
            o_shape = [o_shape[1], o_shape[0]] + o_shape[2:]
    o = torch.empty(o_shape, dtype=a["fake_dtype"])
    _write(o, out, fmt)  # memory order of qkv_layout (F16 kernel: O strides from qkv_layout)
    stats = lse.unsqueeze(-1).to(torch.float32).contiguous()
    rng_state = torch.zeros(2, dtype=torch.int64)
    output_tensors = [o, stats, rng_state]
    return output_tensors[0], output_tensors[1:]


def _alloc_grads(em: Emulator, a: dict, fmt: str, b, sq, sk, h, g, d, dv):
    """dQ, dK, dV as TE's extension allocates them (views into one buffer for packed layouts)."""
    if em.version == "2.8":
        dqkv_dtype = a["dqkv_dtype"]
        if not isinstance(dqkv_dtype, DType):
            raise TypeError(f"fused_attn_bwd(): incompatible dqkv_dtype {dqkv_dtype!r}")
        dtype = _TORCH_OF[dqkv_dtype]
        layout = a["qkv_layout"]
    else:
        dtype = a["fake_dtype"]
        layout = a["dqkv_layout"]
    q, k, v = a["q"], a["k"], a["v"]
    if layout in _SEPARATE:
        dfmt = _SEPARATE[layout]

        def shaped(t):  # t's sizes, converted from the input format to the gradient format
            shp = list(t.shape)
            return shp if dfmt == fmt else [shp[1], shp[0]] + shp[2:]

        return tuple(torch.empty(shaped(t), dtype=dtype) for t in (q, k, v))
    if layout not in _PACKED:
        raise NotImplementedError(f"emulator: dqkv_layout={layout!r}")
    dfmt, group = _PACKED[layout]
    q_shape = list(_dims(dfmt, b, sq, h, d))
    k_shape = list(_dims(dfmt, b, sk, g, d))
    if group in ("3hd", "h3d"):  # one buffer shaped by Q for all three
        shape = q_shape[:-2] + [3] + q_shape[-2:] if group == "3hd" else q_shape[:-1] + [3, d]
        axis = len(shape) - (3 if group == "3hd" else 2)
        buf = torch.empty(shape, dtype=dtype)
        return tuple(buf.select(axis, i) for i in range(3))
    dq = torch.empty(q_shape, dtype=dtype)
    shape = k_shape[:-2] + [2] + k_shape[-2:] if group == "2hd" else k_shape[:-1] + [2, d]
    axis = len(shape) - (3 if group == "2hd" else 2)
    buf = torch.empty(shape, dtype=dtype)
    return (dq, buf.select(axis, 0), buf.select(axis, 1))


def _bwd_impl(em: Emulator, a: dict):
    em.calls.append(dict(op="bwd", **a))
    backend = a["fused_attention_backend"]
    aux = a["aux_ctx_tensors"]
    if em.version == "2.8":
        if backend == FusedAttnBackend["No_Backend"]:
            raise AssertionError("Fused attention does not support this input combination.")
        if backend != FusedAttnBackend["F16_max512_seqlen"]:
            assert len(aux) >= 1, "aux_ctx_tensors must contain rng_state as its last element."
    else:
        if backend == FusedAttnBackend["No_Backend"]:
            raise ValueError("Fused attention backward does not support this input combination")
        if backend != FusedAttnBackend["F16_max512_seqlen"]:
            if len(aux) < 1:
                raise ValueError("aux_ctx_tensors must contain rng_state as its last element")
    if backend != FusedAttnBackend["F16_arbitrary_seqlen"]:
        raise TypeError(f"fused_attn_bwd(): incompatible fused_attention_backend {backend!r}")
    if not isinstance(aux, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in aux):
        raise TypeError("fused_attn_bwd(): aux_ctx_tensors must be a list of tensors")
    if a["dropout"] != 0.0:
        raise NotImplementedError("emulator: dropout")
    for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        if a[name] is not None and not isinstance(a[name], torch.Tensor):
            raise TypeError(f"fused_attn_bwd(): incompatible {name} {a[name]!r}")
    q, k, v, o, do = a["q"], a["k"], a["v"], a["o"], a["d_o"]
    for name in ("q", "k", "v", "o", "d_o"):
        em._check_dtype(a[name], name)
    fmt = _layout_of(a["qkv_layout"])
    b = a["cu_seqlens_q"].shape[0] - 1
    sq, sk = a["max_seqlen_q"], a["max_seqlen_kv"]
    h, d = q.shape[-2], q.shape[-1]
    g, dv = k.shape[-2], v.shape[-1]
    scale = a["attn_scale"] if a["attn_scale"] is not None else d**-0.5
    qr = _read(q, fmt, b, sq, h, d)
    kr = _read(k, fmt, b, sk, g, d)
    vr = _read(v, fmt, b, sk, g, dv)
    # O and dO: the F16 kernel's strides for both come from qkv_layout (O_Matrix)
    o_r = _read(o, fmt, b, sq, h, dv)
    do_r = _read(do, fmt, b, sq, h, dv)
    stats = aux[0]
    if stats.dtype != torch.float32:
        raise RuntimeError(f"softmax stats must be float32, got {stats.dtype}")
    shape = (b, h, sq, 1)
    lse = stats.as_strided(shape, _contig_strides(shape), stats.storage_offset()).double()
    mask = _mask(a["attn_mask_type"], sq, sk, a["cu_seqlens_q"], a["cu_seqlens_kv"], sq, sk)
    s = _scores(qr, kr, scale, mask)
    p = torch.exp(s - lse)  # probabilities from the GIVEN statistics
    rep = h // g
    k_rep, v_rep = kr.repeat_interleave(rep, 1), vr.repeat_interleave(rep, 1)
    delta = (do_r * o_r).sum(-1, keepdim=True)  # from the GIVEN output
    dp = do_r @ v_rep.transpose(-1, -2)
    ds = p * (dp - delta)
    dq = scale * ds @ k_rep
    dk = (scale * ds.transpose(-1, -2) @ qr).unflatten(1, (g, rep)).sum(2)
    dvv = (p.transpose(-1, -2) @ do_r).unflatten(1, (g, rep)).sum(2)
    dQ, dK, dV = _alloc_grads(em, a, fmt, b, sq, sk, h, g, d, dv)
    for dest, value in ((dQ, dq), (dK, dk), (dV, dvv)):
        _write(dest, value, fmt)  # qkv_layout's memory order at each pointer
    return [dQ, dK, dV, None, None]


# ------------------------------------------------------------------------------------------
# the public functions, one signature per release


def _args(local_vars: dict) -> dict:
    return {k: v for k, v in local_vars.items() if k != "em"}


def _make_module(em: Emulator) -> types.ModuleType:
    mod = types.ModuleType("transformer_engine.pytorch.cpp_extensions.fused_attn")
    mod.FusedAttnBackend = FusedAttnBackend
    mod.__emulator__ = em
    if em.version == "2.8":

        def fused_attn_fwd(
            is_training,
            max_seqlen_q,
            max_seqlen_kv,
            cu_seqlens_q,
            cu_seqlens_kv,
            q,
            k,
            v,
            fake_dtype,
            fused_attention_backend,
            attn_bias=None,
            cu_seqlens_q_padded=None,
            cu_seqlens_kv_padded=None,
            page_table_k=None,
            page_table_v=None,
            s_quantizer=None,
            o_quantizer=None,
            attn_scale=None,
            dropout=0.0,
            fast_zero_fill=True,
            qkv_layout="sbh3d",
            attn_bias_type="no_bias",
            attn_mask_type="padding",
            softmax_type="vanilla",
            window_size=(-1, -1),
            rng_gen=None,
            softmax_offset=None,
        ):
            return _fwd_impl(em, _args(locals()))

        def fused_attn_bwd(
            max_seqlen_q,
            max_seqlen_kv,
            cu_seqlens_q,
            cu_seqlens_kv,
            q,
            k,
            v,
            o,
            d_o,
            fake_dtype,
            dqkv_dtype,
            aux_ctx_tensors,
            fused_attention_backend,
            cu_seqlens_q_padded=None,
            cu_seqlens_kv_padded=None,
            s_quantizer=None,
            dp_quantizer=None,
            dqkv_quantizer=None,
            attn_scale=None,
            dropout=0.0,
            fast_zero_fill=True,
            qkv_layout="sbh3d",
            attn_bias_type="no_bias",
            attn_mask_type="padding",
            softmax_type="vanilla",
            window_size=(-1, -1),
            deterministic=False,
        ):
            return _bwd_impl(em, _args(locals()))

    else:

        def fused_attn_fwd(
            is_training,
            max_seqlen_q,
            max_seqlen_kv,
            cu_seqlens_q,
            cu_seqlens_kv,
            q,
            k,
            v,
            fake_dtype,
            fused_attention_backend,
            attn_bias=None,
            cu_seqlens_q_padded=None,
            cu_seqlens_kv_padded=None,
            page_table_k=None,
            page_table_v=None,
            s_quantizer=None,
            o_quantizer=None,
            attn_scale=None,
            dropout=0.0,
            fast_zero_fill=True,
            qkv_layout="sbh3d",
            o_format="sbhd",
            qkv_scale_inv_format=None,
            attn_bias_type="no_bias",
            attn_mask_type="padding",
            softmax_type="vanilla",
            window_size=(-1, -1),
            bottom_right_diagonal=None,
            rng_gen=None,
            softmax_offset=None,
            return_max_logit=False,
            cuda_graph=False,
        ):
            if return_max_logit:
                raise NotImplementedError("emulator: return_max_logit")
            return _fwd_impl(em, _args(locals()))

        def fused_attn_bwd(
            max_seqlen_q,
            max_seqlen_kv,
            cu_seqlens_q,
            cu_seqlens_kv,
            q,
            k,
            v,
            o,
            d_o,
            fake_dtype,
            aux_ctx_tensors,
            fused_attention_backend,
            cu_seqlens_q_padded=None,
            cu_seqlens_kv_padded=None,
            s_quantizer=None,
            dp_quantizer=None,
            dqkv_quantizer=None,
            attn_scale=None,
            dropout=0.0,
            fast_zero_fill=True,
            qkv_layout="sbh3d",
            o_format="sbhd",
            do_format="sbhd",
            dqkv_layout="sbh3d",
            qkv_scale_inv_format=None,
            do_scale_inv_format=None,
            attn_bias_type="no_bias",
            attn_mask_type="padding",
            softmax_type="vanilla",
            window_size=(-1, -1),
            bottom_right_diagonal=None,
            deterministic=False,
            cuda_graph=False,
        ):
            return _bwd_impl(em, _args(locals()))

    mod.fused_attn_fwd = fused_attn_fwd
    mod.fused_attn_bwd = fused_attn_bwd
    return mod


def modules(em: Emulator) -> dict:
    """The ``sys.modules`` entries that stand in for TE (the names the te_fused kernel imports)."""
    fused_attn = _make_module(em)
    tex = types.ModuleType("transformer_engine_torch")
    tex.NVTE_Fused_Attn_Backend = NVTE_Fused_Attn_Backend
    tex.DType = DType
    constants = types.ModuleType("transformer_engine.pytorch.constants")
    constants.TE_DType = TE_DType
    cpp = types.ModuleType("transformer_engine.pytorch.cpp_extensions")
    cpp.fused_attn = fused_attn
    cpp.fused_attn_fwd, cpp.fused_attn_bwd = fused_attn.fused_attn_fwd, fused_attn.fused_attn_bwd
    pt = types.ModuleType("transformer_engine.pytorch")
    pt.cpp_extensions, pt.constants = cpp, constants
    te = types.ModuleType("transformer_engine")
    te.pytorch = pt
    te.__version__ = em.version + ".0+emulated"
    for m in (fused_attn, cpp, pt, te):
        m.__path__ = []  # packages, so "from transformer_engine.pytorch import x" resolves
    return {
        "transformer_engine": te,
        "transformer_engine.pytorch": pt,
        "transformer_engine.pytorch.cpp_extensions": cpp,
        "transformer_engine.pytorch.cpp_extensions.fused_attn": fused_attn,
        "transformer_engine.pytorch.constants": constants,
        "transformer_engine_torch": tex,
    }


@contextlib.contextmanager
def install(version: str, wide_dtypes: bool = False):
    """Put the emulated TE of ``version`` into ``sys.modules`` for the duration; yields the
    ``Emulator`` (its ``calls`` log every fused_attn call with its arguments)."""
    em = Emulator(version, wide_dtypes)
    saved = {}
    entries = modules(em)
    for name, mod in entries.items():
        saved[name] = sys.modules.get(name)
        sys.modules[name] = mod
    try:
        yield em
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
