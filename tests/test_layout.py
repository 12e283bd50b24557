"""``TSPLayout`` against the zigzag definition written out here (not through layout code).

Definition: S tokens form 2D chunks of C = S / (2D); rank r holds chunk r then chunk 2D-1-r; the
gathered order is the ranks' local tokens concatenated in rank order. Plus: bad input is refused
with the numbers named, the batch's ``position_ids`` are the layout's positions (one definition of
token positions for the embedding and RoPE), and no module of the package outside
``core/layout.py`` does chunk arithmetic of its own.
"""

import pathlib
import re

import pytest
import torch

from megatron_tsp.core import zigzag
from megatron_tsp.core.layout import (
    CausalBlock,
    TSPLayout,
    check_sequence_length,
    padded_length,
    whole_sequence_blocks,
)

SIZES = [1, 2, 3, 4, 8]
CHUNK_LENS = [1, 2, 5]


def _definition(d: int, s: int):
    """Per rank: (chunk ids, natural positions in local order), by the definition."""
    c = s // (2 * d)
    ranks = []
    for r in range(d):
        first, second = r, 2 * d - 1 - r
        positions = [first * c + i for i in range(c)] + [second * c + i for i in range(c)]
        ranks.append(((first, second), positions))
    return ranks


@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("chunk_len", CHUNK_LENS)
def test_chunks_positions_and_permutation(d, chunk_len):
    s = 2 * d * chunk_len
    ranks = _definition(d, s)
    gathered = [p for _, positions in ranks for p in positions]
    whole = TSPLayout(d, s)
    assert (whole.num_chunks, whole.chunk_len, whole.local_len) == (2 * d, chunk_len, 2 * chunk_len)
    assert whole.permutation().tolist() == gathered
    inverse = whole.inverse().tolist()
    assert [gathered[i] for i in inverse] == list(range(s))  # inverse undoes the permutation
    assert [inverse[p] for p in gathered] == list(range(s))
    for r, (chunks, positions) in enumerate(ranks):
        mine = TSPLayout(d, s, r)
        assert mine.chunk_ids == chunks == whole.chunks_of(r)
        assert mine.positions().tolist() == positions == whole.positions_of(r).tolist()
        assert whole.spans_of(r) == [(c * chunk_len, (c + 1) * chunk_len) for c in chunks]
        for row, p in enumerate(positions):
            assert whole.owner(p) == (r, row), f"D={d} S={s} position {p}"


@pytest.mark.parametrize("d", SIZES)
def test_every_chunk_held_once(d):
    s = 4 * d
    held = sorted(c for r in range(d) for c in TSPLayout(d, s).chunks_of(r))
    assert held == list(range(2 * d))


@pytest.mark.parametrize("d", SIZES)
def test_causal_blocks(d):
    """Local chunk i (id c): query rows [iC, (i+1)C), keys [0, (c+1)C), for every rank."""
    chunk_len = 3
    s = 2 * d * chunk_len
    for r, (chunks, _) in enumerate(_definition(d, s)):
        want = tuple(
            CausalBlock(i * chunk_len, chunk_len, (c + 1) * chunk_len) for i, c in enumerate(chunks)
        )
        assert TSPLayout(d, s, r).causal_blocks == want
    assert whole_sequence_blocks(7) == (CausalBlock(0, 7, 7),)


def test_causal_blocks_mask_equals_full_causal_mask():
    """The blocks' bottom-right masks, placed at the tokens' positions, are the full causal mask
    restricted to the rank's rows (an independent check of the block structure)."""
    d, s = 3, 18
    full = torch.ones(s, s, dtype=torch.bool).tril()
    for r, (_, positions) in enumerate(_definition(d, s)):
        got = torch.zeros(len(positions), s, dtype=torch.bool)
        for block in TSPLayout(d, s, r).causal_blocks:
            q, k = block.query_len, block.key_len
            got[block.query_start : block.query_start + q, :k] = torch.ones(q, k).tril(k - q).bool()
        assert torch.equal(got, full[positions]), f"rank {r}"


@pytest.mark.parametrize("d", SIZES)
def test_gathered_blocks_see_exactly_the_causal_keys(d):
    """``gathered_blocks`` against the gathered K/V buffer (late chunks in owner order, the
    early chunks, then a copy of the rank's own late chunk): every local query sees, in its
    block's one bottom-right causal call, exactly the natural positions a full causal mask
    allows, each once, within ``gathered_len`` rows, and ``gathered_index`` / ``gathered_row``
    agree with where each natural chunk lands."""
    c = 3
    s = 2 * d * c
    rows_of = TSPLayout(d, s).gathered_index().tolist()  # natural position -> gathered row
    assert sorted(rows_of) == list(range(s))
    for k in range(2 * d):
        assert rows_of[k * c] == TSPLayout(d, s).gathered_row(k)
    for r in range(d):
        layout = TSPLayout(d, s, r)
        natural_at = {row: pos for pos, row in enumerate(rows_of)}
        late_start = layout.chunk_span(layout.chunk_ids[1])[0]
        for j in range(layout.gathered_len - s):  # the copy of the own late chunk
            natural_at[s + j] = late_start + j
        assert layout.gathered_len == (s + c if d > 1 else s)
        positions = layout.positions().tolist()
        for block in layout.gathered_blocks:
            assert block.key_start + block.key_len <= layout.gathered_len
            for i in range(block.query_len):
                query = positions[block.query_start + i]
                visible = block.key_len - block.query_len + i + 1
                seen = [natural_at[block.key_start + j] for j in range(visible)]
                assert sorted(seen) == list(range(query + 1)), (d, r, query, block)


@pytest.mark.parametrize("d", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "src_dtype,dest_dtype",
    [
        (torch.float64, torch.float64),
        (torch.bfloat16, torch.bfloat16),  # the default dK/dV wire: one rounding of the sum
        (torch.bfloat16, torch.float32),  # the fp32 wire
    ],
)
def test_sum_keys_sums_blocks_into_the_gathered_layout(d, src_dtype, dest_dtype):
    """``sum_keys`` (the dK/dV send buffer) equals the sum of the blocks' key rows placed at
    their rows (rows of the own-late-chunk copy on that chunk's rows), rounded once into
    ``dest``: each rank's blocks, a subset, and three sources over one row (the generic path);
    uncovered rows are zero, the rest of a strided ``dest`` (the packed dV half) untouched;
    sources given as parts give bitwise the same result."""
    c = 2
    s = 2 * d * c
    for r in range(d):
        layout = TSPLayout(d, s, r)
        late = layout.gathered_row(layout.chunk_ids[1])
        sources = [
            (b.key_start, torch.randn(b.key_len, 3, 2, dtype=torch.float64).to(src_dtype))
            for b in layout.gathered_blocks
        ]
        for chosen in (sources, sources[:1], sources[1:], sources + sources[:1]):
            packed = torch.full((s, 3, 4), float("nan"), dtype=dest_dtype)
            layout.sum_keys(packed.narrow(2, 0, 2), chosen)
            total = torch.zeros(layout.gathered_len, 3, 2, dtype=torch.float64)
            for start, t in chosen:
                total[start : start + t.shape[0]] += t.double()
            total[late : late + total.shape[0] - s] += total[s:]
            assert torch.equal(packed[..., :2], total[:s].to(dest_dtype)), (r, len(chosen))
            assert packed[..., 2:].isnan().all()
            for cut in ("diagonal", "every_chunk"):
                split = [(start, _split_rows(t, c, cut)) for start, t in chosen]
                parted = torch.full((s, 3, 4), float("nan"), dtype=dest_dtype)
                layout.sum_keys(parted.narrow(2, 0, 2), split)
                same = torch.equal(parted[..., :2], packed[..., :2])
                assert same and parted[..., 2:].isnan().all(), (r, len(chosen), cut)
    end = TSPLayout(d, s, 0).gathered_len
    with pytest.raises(ValueError, match="outside"):
        TSPLayout(d, s, 0).sum_keys(torch.zeros(s, 1), [(end - 1, torch.zeros(2, 1))])


def _split_rows(t, c, cut):
    if cut == "diagonal":
        sizes = [t.shape[0] - c, c] if t.shape[0] > c else [c]
    else:
        sizes = [c] * (t.shape[0] // c)
    return tuple(t.split(sizes)) if len(sizes) > 1 else (t,)


def test_tables_on_a_device_are_cached():
    layout = TSPLayout(4, 32, 1)
    cpu = torch.device("cpu")
    assert layout.permutation(cpu) is layout.permutation(cpu)
    assert layout.positions(cpu).tolist() == layout.positions().tolist()


def test_padded_length():
    assert [padded_length(n, 2) for n in (1, 4, 5, 8, 9)] == [4, 4, 8, 8, 12]
    assert padded_length(6, 3) == 6 and padded_length(7, 3) == 12


@pytest.mark.parametrize(
    "args,message",
    [
        (
            (4, 20),
            "sequence length 20 must be a positive multiple of 2 x tensor-sequence-parallel "
            "size = 8 (zigzag partition into 8 chunks of equal length)",
        ),
        (
            (3, 0),
            "sequence length 0 must be a positive multiple of 2 x tensor-sequence-parallel "
            "size = 6 (zigzag partition into 6 chunks of equal length)",
        ),
        ((0, 8), "tensor-sequence-parallel size must be a positive integer, got 0"),
        ((2.0, 8), "tensor-sequence-parallel size must be a positive integer, got 2.0"),
        ((2, 8, 2), "rank 2 is outside a tensor-sequence-parallel group of 2 ranks"),
        ((2, 8, -1), "rank -1 is outside a tensor-sequence-parallel group of 2 ranks"),
    ],
)
def test_bad_layouts_are_refused(args, message):
    with pytest.raises(ValueError) as info:
        TSPLayout(*args)
    assert str(info.value) == message


def test_rank_queries_need_a_rank():
    with pytest.raises(ValueError, match=r"TSPLayout\(group_size=2, seq_length=8\) has no rank"):
        TSPLayout(2, 8).chunk_ids
    with pytest.raises(ValueError, match="rank 5 is outside a group of 2 ranks"):
        TSPLayout(2, 8).chunks_of(5)
    with pytest.raises(ValueError, match="position 8 is outside a sequence of 8"):
        TSPLayout(2, 8).owner(8)


def test_sequence_length_check_names_the_flag():
    with pytest.raises(ValueError) as info:
        check_sequence_length(36, 4, flag="--seq-length")
    assert str(info.value) == (
        "--seq-length=36 must be divisible by 2 x tensor-sequence-parallel "
        "size = 8 (zigzag partition into 2D chunks)"
    )


@pytest.mark.parametrize("d", [2, 3, 4])
def test_batch_position_ids_are_the_layout_positions(d):
    """The embedding reads the batch's ``position_ids``, RoPE the layout's positions: for the
    batches Megatron builds without ``--reset-position-ids`` (``arange``) they are the same
    numbers on every rank's contiguous shard (restarted ids: tests/test_packed_documents.py)."""
    s, b = 12 * d, 2
    batch = {
        "tokens": torch.zeros(b, s, dtype=torch.long),
        "position_ids": torch.arange(s).expand(b, s).contiguous(),
    }
    permuted = zigzag.get_batch_on_this_tsp_rank(batch, group_size=d)["position_ids"]
    for r, (_, positions) in enumerate(_definition(d, s)):
        shard = permuted.chunk(d, dim=1)[r]  # what Megatron's sequence-parallel embedding keeps
        assert shard.tolist() == [positions] * b
        assert torch.equal(shard[0], TSPLayout(d, s, r).positions())


# ------------------------------------------------------------------------------------------------
# no chunk arithmetic outside core/layout.py

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "megatron_tsp"
CHUNK_ARITHMETIC = {
    "mirror chunk id 2D-1-r": re.compile(r"2\s*\*\s*[\w.]+\s*-\s*1\s*-\s*[\w.(]"),
    "mirror chunk id 2D-r-1": re.compile(r"2\s*\*\s*[\w.]+\s*-\s*[\w.]+\s*-\s*1\b"),
    "chunk length S // (2D)": re.compile(r"//\s*\(\s*2\s*\*\s*[\w.]+\s*\)"),
}


def _code_lines(path: pathlib.Path):
    for number, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split("#", 1)[0]
        if code.strip():
            yield number, code


def _chunk_arithmetic(paths, root=PACKAGE.parent):
    return [
        f"{path.relative_to(root)}:{number}: {name}: {code.strip()}"
        for path in paths
        for number, code in _code_lines(path)
        for name, pattern in CHUNK_ARITHMETIC.items()
        if pattern.search(code)
    ]


def test_scan_finds_chunk_arithmetic(tmp_path):
    """The patterns catch the forms the layout replaced (so the scan below can fail)."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "a = 2 * size - 1 - rank\n"
        "b = 2*cp_size - cp_rank - 1\n"
        "c = seq // (2 * d)\n"
        "d = (2 * size - 1 - r) * c  # code before a comment is scanned\n"
        "# 2 * size - 1 - r in a comment is not\n"
        "e = 2 * hidden - 4\n"
    )
    found = _chunk_arithmetic([sample], root=tmp_path)
    assert [line.split(": ")[0:2] for line in found] == [
        ["sample.py:1", "mirror chunk id 2D-1-r"],
        ["sample.py:2", "mirror chunk id 2D-r-1"],
        ["sample.py:3", "chunk length S // (2D)"],
        ["sample.py:4", "mirror chunk id 2D-1-r"],
    ]


def test_no_chunk_arithmetic_outside_the_layout():
    paths = sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "core" / "layout.py")
    assert len(paths) > 20
    offenders = _chunk_arithmetic(paths)
    assert not offenders, (
        "chunk ids / positions computed outside megatron_tsp/core/layout.py "
        "(use TSPLayout):\n" + "\n".join(offenders)
    )


def test_layout_imports_nothing_from_the_package():
    source = (PACKAGE / "core" / "layout.py").read_text()
    assert not re.search(r"^\s*(from|import)\s+megatron_tsp", source, re.M)
