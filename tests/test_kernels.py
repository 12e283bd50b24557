"""The attention-kernel contract (``megatron_tsp/core/layers/kernels.py``), single process, ~10 s.

* CPU kernels: ``(out, lse)`` and the backward from the saved ``(out, lse)`` against a float64
  dense reference, every causal alignment, MHA and GQA, sq < sk and sq == sk;
* the fp32 log-sum-exp merge of two key blocks is exact;
* the zigzag chunk helpers the layers use (one call per chunk, dK/dV summed in fp32);
* the backend selection table;
* the CUDA call sequence (aten_flash: one bottom-right call per chunk with native GQA; cudnn: two
  top-left calls per chunk) traced under ``FakeTensorMode`` with CUDA-device fake tensors.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_tsp.core.layers import kernels

ALIGNMENTS = kernels.ALIGNMENTS


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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alignment", ALIGNMENTS)
@pytest.mark.parametrize("groups,sq,sk", [(4, 6, 10), (2, 6, 10), (4, 8, 8), (1, 5, 12)])
def test_cpu_flash_contract(seed, dtype, alignment, groups, sq, sk):
    if alignment == kernels.TOP_LEFT and sq != sk:
        sq = sk  # top-left with sq < sk is legal but not used; keep the square case
    q, k, v, dout = _inputs(seed, dtype, g=groups, sq=sq, sk=sk)
    kernel = kernels.CpuFlashKernel()
    scale = 0.3
    out, lse = kernel.forward(q, k, v, alignment, scale)
    assert out.dtype == dtype
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == q.shape[:3]
    # reference with autograd for the backward
    qr, kr, vr = (t.double().requires_grad_(True) for t in (q, k, v))
    out_ref, lse_ref = reference(qr, kr, vr, alignment, scale)
    out_ref.backward(dout.double())
    tol = TOL[dtype]
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


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("size,rank,heads,groups", [(2, 0, 4, 4), (2, 1, 4, 2), (4, 1, 2, 1)])
def test_zigzag_chunks(seed, dtype, size, rank, heads, groups):
    """Local chunks (r, 2D-1-r) against natural-order K/V equal the causal attention of the full
    sequence at those rows; dK/dV come back summed over the chunks in the accumulation dtype."""
    from megatron_tsp.core.layout import TSPLayout
    from tests.common import zigzag_rows  # the rank's rows by the definition, not the package's

    gen = torch.Generator().manual_seed(seed)
    c_len, b, d = 3, 2, 8
    s = 2 * size * c_len
    mk = lambda *sh: torch.randn(*sh, generator=gen, dtype=torch.float64)  # noqa: E731
    q_full, k_nat, v_nat = mk(s, b, heads, d), mk(s, b, groups, d), mk(s, b, groups, d)
    dy_full = mk(s, b, heads * d)
    blocks = TSPLayout(size, s, rank).causal_blocks
    q_loc = zigzag_rows(q_full, size, rank)
    dy_loc = zigzag_rows(dy_full, size, rank)
    kernel = kernels.CpuFlashKernel()
    outs, lses = kernels.zigzag_forward(
        kernel, q_loc.to(dtype), k_nat.to(dtype), v_nat.to(dtype), blocks, 0.4
    )
    dq, dkv = kernels.zigzag_backward(
        kernel,
        dy_loc.to(dtype),
        q_loc.to(dtype),
        k_nat.to(dtype),
        v_nat.to(dtype),
        blocks,
        0.4,
        outs,
        lses,
    )
    assert dkv.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)
    # reference: full causal attention, then keep the local rows
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q_full, k_nat, v_nat))
    perm = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731
    ref, _ = reference(perm(qr), perm(kr), perm(vr), kernels.TOP_LEFT, 0.4)
    ref_rows = ref.permute(2, 0, 1, 3).reshape(s, b, -1)
    local_ref = zigzag_rows(ref_rows, size, rank)
    (local_ref * dy_loc).sum().backward()
    tol = TOL[dtype]
    assert _rel(torch.cat(outs), local_ref) <= tol, f"seed={seed}"
    assert _rel(dq, zigzag_rows(qr.grad, size, rank)) <= 4 * tol, f"seed={seed}"
    assert _rel(dkv[:, :, :groups], kr.grad) <= 4 * tol, f"seed={seed}"
    assert _rel(dkv[:, :, groups:], vr.grad) <= 4 * tol, f"seed={seed}"


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
        (
            dict(
                device_type="cuda", dtype=torch.bfloat16, head_dim=128, gqa=False, capability=(9, 0)
            ),
            "aten_flash",
        ),
        (dict(device_type="cuda", dtype=torch.float32, head_dim=128, gqa=False), "sdpa_recompute"),
        (dict(device_type="cuda", dtype=torch.float16, head_dim=320, gqa=False), "sdpa_recompute"),
        (
            dict(
                device_type="cuda",
                dtype=torch.bfloat16,
                head_dim=128,
                gqa=False,
                transformer_impl="transformer_engine",
                te_available=True,
            ),
            "te_fused",
        ),
        (
            dict(
                device_type="cuda",
                dtype=torch.bfloat16,
                head_dim=128,
                gqa=False,
                transformer_impl="transformer_engine",
                te_available=False,
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
        dict(device_type="cpu", dtype=torch.float32, head_dim=64, gqa=False, override="nope"),
    ],
)
def test_selection_refuses_impossible_override(kw):
    with pytest.raises(ValueError, match=kernels.ENV_OVERRIDE):
        kernels.kernel_choice(**kw)


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
