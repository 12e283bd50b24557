"""The one-launch row sum (``megatron_tsp.core.layers.row_sum_kernel``) that TSP's attention
backward uses for each head group's dK and dV, its Triton kernel run in Triton's interpreter on
CPU tensors: equal to the torch path (``layout.sum_row_pieces``) at any strides and overlaps,
on TSP's own pieces for every rank, how the traffic recorder counts it (when it is chosen:
``tests/test_rope_kernel.py::test_when_the_triton_kernels_are_chosen``).
(The layer parity with it: ``tests/test_layers.py::test_attention_triton_kernels``.)"""

import pytest
import torch

from megatron_tsp.core.layers import row_sum_kernel
from megatron_tsp.core.layout import TSPLayout, sum_row_pieces

triton = pytest.importorskip("triton")


def _strided(shape, dtype, generator):
    """Random values in a non-contiguous [rows, b, n, d] view (rows not the outer stride)."""
    rows, b, n, d = shape
    base = torch.randn(b, n + 1, rows, 2 * d, generator=generator).to(dtype)
    return base[:, 1:, :, ::2].permute(2, 0, 1, 3)


def _check_equal(out, ref, dtype, seed):
    if dtype == torch.bfloat16:
        # Triton's interpreter converts fp32 to bf16 by truncation, torch rounds to nearest:
        # one bf16 ulp apart at most (a GPU rounds to nearest, as torch)
        ulp = 2.0 ** (torch.frexp(ref.float().abs())[1].float() - 8)
        excess = ((out.float() - ref.float()).abs() - ulp).max().item()
        assert excess <= 0, f"seed={seed}: more than one bf16 ulp from the torch path"
    else:
        assert torch.equal(out, ref), f"seed={seed}: {(out.double() - ref.double()).abs().max()}"


# (lo, hi) spans over 20 destination rows: disjoint, overlapping two and three deep, empty,
# rows no piece covers
SPANS = [
    [(0, 20)],
    [(4, 12), (6, 18)],
    [(0, 9), (9, 20)],
    [(2, 15), (5, 11), (7, 20)],
    [(3, 3), (1, 19), (0, 20), (10, 12)],
]


@pytest.mark.parametrize("spans", SPANS)
@pytest.mark.parametrize(
    "dest_dtype,piece_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.bfloat16),  # the fp32 dK/dV wire: bf16 blocks, fp32 send buffer
    ],
)
def test_kernel_equals_the_torch_path(seed, spans, dest_dtype, piece_dtype):
    g = torch.Generator().manual_seed(seed)
    shape = (20, 2, 3, 8)
    pieces = [(lo, hi, _strided((hi - lo,) + shape[1:], piece_dtype, g)) for lo, hi in spans]
    holder = torch.full((shape[0], shape[1], 2 * shape[2], shape[3]), float("nan"))
    holder = holder.to(dest_dtype)
    dest = holder[:, :, 1::2]  # a strided destination
    assert row_sum_kernel.sum_rows_into(dest, pieces) is dest
    ref = sum_row_pieces(torch.empty(shape, dtype=dest_dtype), pieces)
    _check_equal(dest, ref, dest_dtype, seed)
    assert holder[:, :, 0::2].isnan().all(), "wrote outside the destination"
    covered = torch.zeros(shape[0], dtype=torch.bool)
    for lo, hi in spans:
        covered[lo:hi] = True
    assert (dest[~covered] == 0).all(), "rows no piece covers must be zero"


@pytest.mark.parametrize("d", [1, 2, 4])
def test_tsp_key_pieces_of_every_rank(seed, d):
    """What the attention backward sums: each rank's causal blocks' dK rows (``gathered_blocks``)
    in the gathered layout, the own-late-chunk copy folded onto its rows; bf16 as on a GPU."""
    g = torch.Generator().manual_seed(seed)
    seq, b, n, dim = 8 * d, 2, 2, 8
    for rank in range(d):
        layout = TSPLayout(d, seq, rank)
        sources = [
            (blk.key_start, _strided((blk.key_len, b, n, dim), torch.bfloat16, g))
            for blk in layout.gathered_blocks
        ]
        pieces = layout.key_pieces(seq, sources)
        assert len(pieces) <= row_sum_kernel.MAX_PIECES
        dest = torch.empty(seq, b, n, dim, dtype=torch.bfloat16)
        ref = layout.sum_keys(torch.empty_like(dest), sources)
        _check_equal(row_sum_kernel.sum_rows_into(dest, pieces), ref, torch.bfloat16, seed)


def test_sum_pieces_takes_the_torch_path_where_the_kernel_does_not_apply(monkeypatch):
    """Too many pieces, a wider dtype, or not chosen: the torch path, same result."""
    launched = []
    monkeypatch.setattr(row_sum_kernel, "available", lambda device, dtype: True)
    monkeypatch.setattr(row_sum_kernel, "sum_rows_into", lambda *a: launched.append(a))
    five = [(i, i + 2, torch.ones(2, 3)) for i in range(5)]
    out = row_sum_kernel.sum_pieces(torch.empty(7, 3), five)
    assert not launched and out[:, 0].tolist() == [1, 2, 2, 2, 2, 1, 0]
    wide = [(0, 2, torch.ones(2, 3, dtype=torch.float64))]
    row_sum_kernel.sum_pieces(torch.empty(2, 3), wide)
    assert not launched
    row_sum_kernel.sum_pieces(torch.empty(2, 3), [(0, 2, torch.ones(2, 3))])
    assert len(launched) == 1


def test_refuses_pieces_that_do_not_fit():
    dest = torch.empty(6, 4)
    with pytest.raises(ValueError, match=r"piece rows \[4, 8\)"):
        row_sum_kernel.sum_rows_into(dest, [(4, 8, torch.ones(4, 4))])
    with pytest.raises(ValueError, match="shape"):
        row_sum_kernel.sum_rows_into(dest, [(0, 2, torch.ones(2, 5))])
    with pytest.raises(ValueError, match="at most 4"):
        row_sum_kernel.sum_rows_into(dest, [(0, 1, torch.ones(1, 4))] * 5)


def test_recorded_as_one_kernel_that_reads_the_pieces_and_writes_dest():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_tsp.tools.traffic import make_recorder

    with FakeTensorMode():
        dest = torch.empty(64, 2, 8, 16, dtype=torch.bfloat16)[:, :, :4]
        a = torch.empty(16, 2, 4, 16, dtype=torch.bfloat16)
        b = torch.empty(40, 2, 4, 16, dtype=torch.bfloat16)
        recorder = make_recorder(device_type="cpu")
        with recorder:
            row_sum_kernel.sum_rows_into(dest, [(0, 16, a), (8, 48, b)])
    kernels = [r for r in recorder.records if r.kind == "kernel"]
    assert [r.name for r in kernels] == ["sum_rows"]
    assert kernels[0].read == (a.numel() + b.numel()) * 2
    assert kernels[0].written == dest.numel() * 2
