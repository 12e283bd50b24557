"""The attention-kernel contract (``megatron_tsp/core/layers/kernels.py``), single process, ~10 s.

* CPU kernels: ``(out, lse)`` and the backward from the saved ``(out, lse)`` against a float64
  dense reference, every causal alignment, MHA and GQA, sq < sk and sq == sk;
* the fp32 log-sum-exp merge of two key blocks is exact;
* the zigzag chunk helpers the layers use (one call per chunk, dK/dV summed in fp32);
* the backend selection table (only verified backends by default; cudnn / te_fused opt-in);
* ``te_fused`` through a CPU contract emulator of Transformer Engine
  (``tests/emulators/transformer_engine_emulator.py``) for each supported TE signature (2.8, 2.15):
  the same contract tests as the CPU kernel, the zigzag chunks read from packed K/V and QKV
  buffers with micro-batch 2; the previous TE call (kept below as ``OldTeFusedKernel``) fails it
  (misread strided inputs on 2.8, TypeError on 2.15), and so does each planted defect;
* the CUDA call sequence (aten_flash: one bottom-right call per chunk with native GQA; cudnn: two
  top-left calls per chunk) traced under ``FakeTensorMode`` with CUDA-device fake tensors.
"""

import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_tsp.core.layers import kernels
from tests.emulators import transformer_engine_emulator as te_emu

ALIGNMENTS = kernels.ALIGNMENTS
KERNELS = ["cpu_flash"] + [f"te_fused@{v}" for v in te_emu.VERSIONS]


@pytest.fixture
def make_kernel():
    """``make_kernel("cpu_flash")`` or ``make_kernel("te_fused@2.15")``: the kernel, with the TE
    emulator of that version installed (fp32/fp64 allowed) until the test ends."""
    import contextlib

    import tests.common  # noqa: F401  megatron.core probes for TE when first imported: not here

    with contextlib.ExitStack() as stack:

        def make(spec, cls=None):
            name, _, version = spec.partition("@")
            if version:
                stack.enter_context(te_emu.install(version, wide_dtypes=True))
            return cls() if cls is not None else kernels.get_kernel(name)

        yield make


def reference(q, k, v, alignment, scale):
    """Dense float64 attention: (out, lse) for [b, h, sq, d] queries, [b, g, sk, d] keys."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) * scale
    sq, sk = q.shape[2], k.shape[2]
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(sk).unsqueeze(0)
    if alignment == kernels.TOP_LEFT:
        scores = scores.masked_fill(j > i, float("-inf"))
    elif alignment == kernels.BOTTOM_RIGHT:
        scores = scores.masked_fill(j > i + (sk - sq), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse


def _inputs(seed, dtype, b=2, h=4, g=4, sq=6, sk=10, d=8):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(b, h, sq, d), mk(b, g, sk, d), mk(b, g, sk, d), mk(b, h, sq, d)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("kernel_name", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alignment", ALIGNMENTS)
@pytest.mark.parametrize("groups,sq,sk", [(4, 6, 10), (2, 6, 10), (4, 8, 8), (1, 5, 12)])
def test_kernel_contract(seed, make_kernel, kernel_name, dtype, alignment, groups, sq, sk):
    if alignment == kernels.TOP_LEFT and sq != sk:
        sq = sk  # top-left with sq < sk is legal but not used; keep the square case
    q, k, v, dout = _inputs(seed, dtype, g=groups, sq=sq, sk=sk)
    kernel = make_kernel(kernel_name)
    scale = 0.3
    out, lse = kernel.forward(q, k, v, alignment, scale)
    assert out.dtype == dtype
    te = kernel_name.startswith("te_fused")  # TE's softmax statistics are fp32 at any dtype
    assert lse.dtype == (torch.float64 if dtype == torch.float64 and not te else torch.float32)
    assert lse.shape == q.shape[:3]
    # reference with autograd for the backward
    qr, kr, vr = (t.double().requires_grad_(True) for t in (q, k, v))
    out_ref, lse_ref = reference(qr, kr, vr, alignment, scale)
    out_ref.backward(dout.double())
    tol = max(TOL[dtype], TOL[torch.float32]) if te else TOL[dtype]
    assert _rel(out, out_ref) <= tol, f"seed={seed}"
    assert _rel(lse, lse_ref) <= tol, f"seed={seed}"
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, alignment, scale)
    assert dk.shape == k.shape and dv.shape == v.shape  # GQA folded back onto the key heads
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert _rel(got, want) <= 4 * tol, f"seed={seed}"


def test_merge_is_exact(seed):
    q, k, v, _ = _inputs(seed, torch.float64, sq=4, sk=9)
    oa, la = reference(q, k[:, :, :5], v[:, :, :5], kernels.NO_MASK, 0.5)
    ob, lb = reference(q, k[:, :, 5:], v[:, :, 5:], kernels.NO_MASK, 0.5)
    out, lse = kernels.merge_blocks(oa, la, ob, lb, torch.float64)
    full, full_lse = reference(q, k, v, kernels.NO_MASK, 0.5)
    assert _rel(out, full) <= 1e-14 and _rel(lse, full_lse) <= 1e-14, f"seed={seed}"


def _zigzag_case(seed, size, rank, heads, groups, b=2, c_len=3, d=8):
    """Full-sequence q/k/v/dy and this rank's local q/dy, laid out as the layer holds them: q a
    view into a wider QKV output buffer, K and V ``narrow`` views of one packed [S, b, 2g, d]
    buffer (the gathered natural-order K/V), micro-batch ``b``."""
    from tests.common import zigzag_rows  # the rank's rows by the definition, not the package's

    gen = torch.Generator().manual_seed(seed)
    s = 2 * size * c_len
    mk = lambda *sh: torch.randn(*sh, generator=gen, dtype=torch.float64)  # noqa: E731
    q_full, k_nat, v_nat = mk(s, b, heads, d), mk(s, b, groups, d), mk(s, b, groups, d)
    dy_full = mk(s, b, heads * d)
    return (
        q_full,
        k_nat,
        v_nat,
        dy_full,
        zigzag_rows(q_full, size, rank),
        zigzag_rows(dy_full, size, rank),
    )


def _as_layer_views(q_loc, k_nat, v_nat, dtype):
    """q as a view into a QKV-like [s, b, h + 2g, d] buffer; K/V as views of one packed buffer."""
    s_loc, b, heads, d = q_loc.shape
    groups = k_nat.shape[2]
    qkv = torch.zeros(s_loc, b, heads + 2 * groups, d, dtype=dtype)
    qkv.narrow(2, 0, heads).copy_(q_loc)
    kv = torch.cat([k_nat, v_nat], dim=2).to(dtype)
    return qkv.narrow(2, 0, heads), kv.narrow(2, 0, groups), kv.narrow(2, groups, groups)


def _zigzag_run(kernel, size, rank, q_loc, k_nat, v_nat, dy_loc, dtype):
    from megatron_tsp.core.layout import TSPLayout

    blocks = TSPLayout(size, k_nat.shape[0], rank).causal_blocks
    q, k, v = _as_layer_views(q_loc, k_nat, v_nat, dtype)
    outs, lses = kernels.zigzag_forward(kernel, q, k, v, blocks, 0.4)
    dq, dkv = kernels.zigzag_backward(kernel, dy_loc.to(dtype), q, k, v, blocks, 0.4, outs, lses)
    return outs, lses, dq, dkv


def _zigzag_reference(size, rank, q_full, k_nat, v_nat, dy_loc):
    """Full causal attention in float64, kept at the local rows: out, lse, dq (local), dk, dv."""
    from tests.common import zigzag_rows

    s, b = q_full.shape[:2]
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q_full, k_nat, v_nat))
    perm = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731
    ref, lse = reference(perm(qr), perm(kr), perm(vr), kernels.TOP_LEFT, 0.4)
    ref_rows = ref.permute(2, 0, 1, 3).reshape(s, b, -1)
    local_ref = zigzag_rows(ref_rows, size, rank)
    (local_ref * dy_loc).sum().backward()
    lse_loc = zigzag_rows(lse.permute(2, 0, 1), size, rank).permute(1, 2, 0)  # [b, h, s_loc]
    return local_ref, lse_loc, zigzag_rows(qr.grad, size, rank), kr.grad, vr.grad


def _zigzag_errors(seed, kernel, size, rank, heads, groups, dtype):
    """Relative errors of out, lse, dq, dk, dv of ``kernel`` on the zigzag chunks."""
    q_full, k_nat, v_nat, _, q_loc, dy_loc = _zigzag_case(seed, size, rank, heads, groups)
    outs, lses, dq, dkv = _zigzag_run(kernel, size, rank, q_loc, k_nat, v_nat, dy_loc, dtype)
    out_r, lse_r, dq_r, dk_r, dv_r = _zigzag_reference(size, rank, q_full, k_nat, v_nat, dy_loc)
    assert dkv.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)
    return {
        "out": _rel(torch.cat(outs), out_r),
        "lse": _rel(torch.cat(lses, dim=-1), lse_r),
        "dq": _rel(dq, dq_r),
        "dk": _rel(dkv[:, :, :groups], dk_r),
        "dv": _rel(dkv[:, :, groups:], dv_r),
    }


@pytest.mark.parametrize("kernel_name", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("size,rank,heads,groups", [(2, 0, 4, 4), (2, 1, 4, 2), (4, 1, 2, 1)])
def test_zigzag_chunks(seed, make_kernel, kernel_name, dtype, size, rank, heads, groups):
    """Local chunks (r, 2D-1-r) against natural-order K/V equal the causal attention of the full
    sequence at those rows (out, lse, dq, dK, dV); the inputs are the layer's strided views
    (packed K/V, q inside the QKV output) with micro-batch 2; dK/dV come back summed over the
    chunks in the accumulation dtype."""
    kernel = make_kernel(kernel_name)
    errors = _zigzag_errors(seed, kernel, size, rank, heads, groups, dtype)
    tol = TOL[dtype]
    if kernel_name.startswith("te_fused"):  # fp32 softmax statistics
        tol = max(tol, TOL[torch.float32])
    for name, err in errors.items():
        assert err <= (tol if name in ("out", "lse") else 4 * tol), f"seed={seed} {errors}"


class OldTeFusedKernel(kernels._TopLeftKernel):
    """The te_fused call before it was fixed, kept verbatim as the "before" of the emulator
    tests: positional arguments (``dqkv_dtype`` included), strided ``transpose`` views handed
    over as bshd, ``out.view(b, sq, h, d)``, prefix + diagonal calls with TE's "causal"."""

    name = "te_fused_old"
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
            [lse.unsqueeze(-1), kernels._no_rng(q.device)],
            self._backend,
            attn_scale=scale,
            dropout=0.0,
            qkv_layout="bshd_bshd_bshd",
            attn_mask_type="causal" if causal else "no_mask",
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_old_te_call_fails_the_emulator(seed, make_kernel, dtype):
    """The previous te_fused call on the zigzag chunks (D=4, rank 1, GQA 4:2, micro-batch 2):
    TE 2.8 reads the strided views at the wrong offsets (every output far off; the fixed kernel
    passes the same case in test_zigzag_chunks); TE 2.15 dropped the positional ``dqkv_dtype``,
    so the first backward raises TypeError."""
    kernel = make_kernel("te_fused@2.8", OldTeFusedKernel)
    errors = _zigzag_errors(seed, kernel, 4, 1, 4, 2, dtype)
    print("old te_fused call vs TE 2.8 emulator, relative errors:", errors)
    for name, err in errors.items():
        assert err > 0.1, f"seed={seed} {name}: {errors}"


def test_old_te_call_raises_on_te_2_15(seed, make_kernel):
    kernel = make_kernel("te_fused@2.15", OldTeFusedKernel)
    with pytest.raises(TypeError, match="has no len"):
        _zigzag_errors(seed, kernel, 4, 1, 4, 2, torch.bfloat16)


class _Planted(kernels.TeFusedKernel):
    """The fixed kernel with one defect planted (``defect``), to show the emulator catches it."""

    defect = None

    def __init__(self):
        super().__init__()
        if self.defect == "no_dqkv_layout":
            self._bwd_extra.pop("dqkv_layout", None)
        if self.defect == "no_o_format":
            self._fwd_extra.pop("o_format", None)

    def forward(self, q, k, v, alignment, scale):
        if self.defect == "top_left_mask":
            alignment = kernels.TOP_LEFT if alignment == kernels.BOTTOM_RIGHT else alignment
        if self.defect == "strided_views":
            original = kernels._bshd
            kernels._bshd = lambda t: t.transpose(1, 2)
            try:
                return super().forward(q, k, v, alignment, scale)
            finally:
                kernels._bshd = original
        return super().forward(q, k, v, alignment, scale)

    def backward(self, d_out, q, k, v, out, lse, alignment, scale):
        if self.defect == "top_left_mask":
            alignment = kernels.TOP_LEFT if alignment == kernels.BOTTOM_RIGHT else alignment
        if self.defect == "strided_views":
            original = kernels._bshd
            kernels._bshd = lambda t: t.transpose(1, 2)
            try:
                return super().backward(d_out, q, k, v, out, lse, alignment, scale)
            finally:
                kernels._bshd = original
        return super().backward(d_out, q, k, v, out, lse, alignment, scale)


@pytest.mark.parametrize(
    "version,defect",
    [
        ("2.8", "top_left_mask"),
        ("2.15", "top_left_mask"),
        ("2.8", "strided_views"),
        ("2.15", "strided_views"),
        ("2.15", "no_dqkv_layout"),
        ("2.15", "no_o_format"),
    ],
)
def test_te_emulator_catches_planted_defects(seed, make_kernel, version, defect):
    """Each defect the fixed kernel avoids makes the zigzag check fail through the emulator: by a
    wrong result (some relative error > 0.1) or by an error raised (TE's shape check in the
    kernel, a read/write past a buffer)."""
    planted = type("Planted", (_Planted,), {"defect": defect})
    kernel = make_kernel(f"te_fused@{version}", planted)
    try:
        errors = _zigzag_errors(seed, kernel, 4, 1, 4, 2, torch.float64)
    except RuntimeError as exc:
        print(f"{defect} on TE {version}: raised {exc}")
        return
    print(f"{defect} on TE {version}: relative errors {errors}")
    assert max(errors.values()) > 0.1, errors


@pytest.mark.parametrize("version", te_emu.VERSIONS)
def test_te_fused_call_is_by_keyword_in_the_named_layout(make_kernel, version):
    """Every fused_attn argument goes by keyword, the tensors are contiguous bshd, one call per
    chunk with "causal_bottom_right", and the 2.15 layout keywords name bshd separately."""
    kernel = make_kernel(f"te_fused@{version}")
    em = sys.modules["transformer_engine.pytorch.cpp_extensions.fused_attn"].__emulator__
    q_full, k_nat, v_nat, _, q_loc, dy_loc = _zigzag_case(0, 4, 1, 4, 2)
    _zigzag_run(kernel, 4, 1, q_loc, k_nat, v_nat, dy_loc, torch.bfloat16)
    assert [c["op"] for c in em.calls] == ["fwd", "fwd", "bwd", "bwd"]
    for call in em.calls:
        assert call["qkv_layout"] == "bshd_bshd_bshd"
        assert call["attn_mask_type"] == "causal_bottom_right"
        names = ("q", "k", "v") + (("o", "d_o") if call["op"] == "bwd" else ())
        for name in names:
            assert call[name].is_contiguous(), name
        if version != "2.8":
            assert call["o_format"] == "bshd"
            if call["op"] == "bwd":
                assert call["do_format"] == "bshd" and call["dqkv_layout"] == "bshd_bshd_bshd"
        elif call["op"] == "bwd":
            assert call["dqkv_dtype"] == te_emu.DType.kBFloat16


@pytest.mark.parametrize(
    "kw,expected",
    [
        (dict(device_type="cpu", dtype=torch.float32, head_dim=64, gqa=True), "cpu_flash"),
        (
            dict(device_type="cpu", dtype=torch.float32, head_dim=64, gqa=False, dropout_p=0.1),
            "sdpa_recompute",
        ),
        (
            dict(
                device_type="cuda", dtype=torch.bfloat16, head_dim=128, gqa=True, capability=(9, 0)
            ),
            "aten_flash",
        ),
        # sm90+, MHA, head_dim 64 / 128: cuDNN (faster than FA2 on an H200, docs/gpu_check.md)
        (
            dict(
                device_type="cuda", dtype=torch.bfloat16, head_dim=128, gqa=False, capability=(9, 0)
            ),
            "cudnn",
        ),
        (
            dict(
                device_type="cuda", dtype=torch.float16, head_dim=64, gqa=False, capability=(10, 0)
            ),
            "cudnn",
        ),
        (
            dict(
                device_type="cuda", dtype=torch.bfloat16, head_dim=96, gqa=False, capability=(9, 0)
            ),
            "aten_flash",
        ),
        (
            dict(
                device_type="cuda", dtype=torch.bfloat16, head_dim=128, gqa=False, capability=(8, 0)
            ),
            "aten_flash",
        ),
        (
            dict(
                device_type="cuda",
                dtype=torch.bfloat16,
                head_dim=128,
                gqa=False,
                capability=(9, 0),
                dropout_p=0.1,
            ),
            "sdpa_recompute",
        ),
        (dict(device_type="cuda", dtype=torch.float32, head_dim=128, gqa=False), "sdpa_recompute"),
        (dict(device_type="cuda", dtype=torch.float16, head_dim=320, gqa=False), "sdpa_recompute"),
        # TE importable: still ATen flash unless te_fused is asked for by name
        (
            dict(
                device_type="cuda", dtype=torch.bfloat16, head_dim=128, gqa=False, te_available=True
            ),
            "aten_flash",
        ),
        (
            dict(
                device_type="cuda",
                dtype=torch.bfloat16,
                head_dim=128,
                gqa=True,
                te_available=True,
                override="te_fused",
            ),
            "te_fused",
        ),
        (
            dict(
                device_type="cuda",
                dtype=torch.bfloat16,
                head_dim=128,
                gqa=False,
                capability=(9, 0),
                override="cudnn",
            ),
            "cudnn",
        ),
    ],
)
def test_selection_table(kw, expected):
    assert kernels.kernel_choice(**kw) == expected


@pytest.mark.parametrize(
    "kw",
    [
        dict(
            device_type="cuda",
            dtype=torch.bfloat16,
            head_dim=128,
            gqa=True,
            capability=(9, 0),
            override="cudnn",
        ),  # cuDNN path is MHA only
        dict(
            device_type="cuda",
            dtype=torch.bfloat16,
            head_dim=128,
            gqa=False,
            capability=(8, 0),
            override="cudnn",
        ),  # sm90+
        dict(device_type="cpu", dtype=torch.float32, head_dim=64, gqa=False, override="aten_flash"),
        dict(
            device_type="cuda",
            dtype=torch.bfloat16,
            head_dim=128,
            gqa=False,
            te_available=False,
            override="te_fused",
        ),  # TE not importable
        dict(device_type="cpu", dtype=torch.float32, head_dim=64, gqa=False, override="nope"),
    ],
)
def test_selection_refuses_impossible_override(kw):
    with pytest.raises(ValueError, match=kernels.ENV_OVERRIDE):
        kernels.kernel_choice(**kw)


def test_select_kernel_default_and_env_override(monkeypatch):
    """With TE importable (the emulator) a GPU-bound layer still gets ATen flash by default; the
    environment variable selects te_fused and the kernel records why."""
    monkeypatch.delenv(kernels.ENV_OVERRIDE, raising=False)
    with te_emu.install("2.15"):
        meta = torch.device("meta")
        k = kernels.select_kernel(meta, torch.bfloat16, 128, True)
        assert (k.name, k.selected_by) == ("aten_flash", "default")
        assert k.describe() == "aten_flash (default)"
        monkeypatch.setenv(kernels.ENV_OVERRIDE, "te_fused")
        k = kernels.select_kernel(meta, torch.bfloat16, 128, True)
        assert isinstance(k, kernels.TeFusedKernel) and k.selected_by == kernels.ENV_OVERRIDE
        k = kernels.select_kernel(meta, torch.bfloat16, 128, True, override="aten_flash")
        assert (k.name, k.selected_by) == ("aten_flash", "override")
    monkeypatch.setenv(kernels.ENV_OVERRIDE, "te_fused")  # no TE (the emulator is gone)
    with pytest.raises(ValueError, match="transformer_engine_importable=False"):
        kernels.select_kernel(torch.device("meta"), torch.bfloat16, 128, True)


def test_te_fused_refuses_an_unknown_te_signature_at_construction(monkeypatch):
    """A TE whose fused_attn_bwd requires a parameter the kernel does not know is refused when
    the kernel is built (not in the first backward), naming the parameter; no fallback."""
    with te_emu.install("2.15"):
        mod = sys.modules["transformer_engine.pytorch.cpp_extensions.fused_attn"]
        original = mod.fused_attn_bwd

        def fused_attn_bwd(max_seqlen_q, new_required, **kw):  # noqa: ARG001
            return original(max_seqlen_q, **kw)

        monkeypatch.setattr(mod, "fused_attn_bwd", fused_attn_bwd)
        monkeypatch.setenv(kernels.ENV_OVERRIDE, "te_fused")
        with pytest.raises(RuntimeError, match="new_required"):
            kernels.select_kernel(torch.device("meta"), torch.bfloat16, 128, True)


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "attention" in name:
            self.ops.append(
                (
                    name,
                    tuple(args[0].shape),
                    tuple(args[1].shape),
                    args[4] if "flash" in name and "backward" not in name else None,
                )
            )
        return func(*args, **(kwargs or {}))


def _fake_cuda_chunks(kernel, size, rank, heads, groups):
    """Run the layers' zigzag helpers on CUDA-device fake tensors; return the attention ops."""
    from megatron_tsp.core.layout import TSPLayout

    c_len, b, d = 16, 1, 64
    s = 2 * size * c_len
    blocks = TSPLayout(size, s, rank).causal_blocks
    with FakeTensorMode(allow_non_fake_inputs=True):
        dev = torch.device("cuda")
        q = torch.empty(2 * c_len, b, heads, d, dtype=torch.bfloat16, device=dev)
        k = torch.empty(s, b, groups, d, dtype=torch.bfloat16, device=dev)
        dy = torch.empty(2 * c_len, b, heads * d, dtype=torch.bfloat16, device=dev)
        log = _OpLog()
        with log:
            outs, lses = kernels.zigzag_forward(kernel, q, k, k, blocks, 0.125)
            dq, dkv = kernels.zigzag_backward(kernel, dy, q, k, k, blocks, 0.125, outs, lses)
        assert dq.device.type == "cuda" and dkv.dtype == torch.float32
        assert [tuple(o.shape) for o in outs] == [(c_len, b, heads * d)] * 2
    return log.ops, (rank, 2 * size - 1 - rank), c_len  # the chunk ids, written out


@pytest.mark.parametrize("heads,groups", [(8, 8), (8, 2)])
def test_fake_cuda_aten_flash_one_call_per_chunk(heads, groups):
    ops, chunks, c_len = _fake_cuda_chunks(kernels.AtenFlashKernel(), 4, 1, heads, groups)
    fwd = [o for o in ops if o[0] == "_scaled_dot_product_flash_attention"]
    bwd = [o for o in ops if o[0] == "_scaled_dot_product_flash_attention_backward"]
    assert len(fwd) == 2 and len(bwd) == 2 and len(ops) == 4
    for (name, q_shape, k_shape, causal), c in zip(fwd, chunks):
        # bottom-right causal over keys [0, (c+1)C); key heads stay ``groups`` (native GQA)
        assert q_shape == (1, heads, c_len, 64) and k_shape == (1, groups, (c + 1) * c_len, 64)
        assert causal is True


def test_fake_cuda_cudnn_two_calls_and_merge():
    ops, chunks, c_len = _fake_cuda_chunks(kernels.CudnnKernel(), 4, 1, 8, 8)
    fwd = [o for o in ops if o[0] == "_scaled_dot_product_cudnn_attention"]
    bwd = [o for o in ops if o[0] == "_scaled_dot_product_cudnn_attention_backward"]
    # chunk c > 0: unmasked prefix [0, cC) + square causal diagonal, in both directions
    assert len(fwd) == 4 and len(bwd) == 4
    key_lens = sorted(o[2][2] for o in fwd)
    expected = sorted(n for c in chunks for n in (c * c_len, c_len))
    assert key_lens == expected
