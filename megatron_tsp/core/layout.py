"""The zigzag sequence layout of a TSP group: the one place that knows which tokens a rank holds.

A sequence of S tokens is cut into 2D chunks of C = S / (2D) tokens. Rank r of a group of D ranks
holds chunks ``r`` and ``2D-1-r``, in that order, so every rank owns one early and one late chunk
and does the same causal-attention work. Concatenating the ranks' local tokens in rank order (what
an all-gather over the group returns, and what Megatron's contiguous sequence-parallel shards of a
permuted batch are) gives the *gathered order* ``[c0, c_{2D-1}, c1, c_{2D-2}, ...]``;
``permutation`` maps it to natural positions and ``inverse`` back.

Context parallelism (TSP x CP). The weight axis stays the TSP group (D ranks, Megatron's TP
group); the *sequence* group is megatron-core's tensor-and-context-parallel group of D*C ranks,
whose rank q = cp_rank * D + tsp_rank (TP is the stride-1 axis of megatron-core's default order
"tp-cp-ep-dp-pp", so the group's ranks are consecutive TP groups, one per CP rank;
``sequence_rank``). The zigzag then runs over all D*C ranks: ``TSPLayout(D*C, S, q,
context_parallel_size=C)``, 2DC chunks, rank q holding chunks q and 2DC-1-q. CP rank c's micro-batch
is the contiguous slice c of the gathered order (``cp_batch_positions``), which equals Megatron's
own CP split (CP chunks c and 2C-1-c of 2C) followed by the D-rank zigzag of that local sequence:
the same tokens, one permutation (``cp_local_positions`` gives the local indices of a rank's tokens
inside Megatron's CP-local sequence, e.g. for Megatron's CP-sliced RoPE table).

Every module that needs chunk ids, token positions, the permutation or the causal block structure
asks a ``TSPLayout``; nothing else does this arithmetic (``tests/test_layout.py`` scans the package
for it). This module imports only torch, so anything (validation, the layers, the tools) can import
it without an import cycle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

# A causal block's key rows (its dK or dV): one tensor, or tensors that follow one another
# along dim 0 (a top-left kernel's prefix and diagonal parts).
KeyRows = Union[torch.Tensor, Sequence[torch.Tensor]]


def check_sequence_length(seq_length: int, group_size: int, flag: str = "--seq-length") -> None:
    """Refuse a sequence that does not cut into 2D equal zigzag chunks, naming ``flag``."""
    if group_size < 1:
        raise ValueError(f"tensor-sequence-parallel size must be >= 1, got {group_size}")
    if seq_length % (2 * group_size) != 0:
        raise ValueError(
            f"{flag}={seq_length} must be divisible by 2 x tensor-sequence-parallel size "
            f"= {2 * group_size} (zigzag partition into 2D chunks)"
        )


@dataclass(frozen=True)
class CausalBlock:
    """One kernel call of causal attention: the local query rows ``[query_start, query_start +
    query_len)`` against the keys ``[key_start, key_start + key_len)`` of a key buffer, causal
    mask aligned bottom-right (the queries are the LAST ``query_len`` of those ``key_len``
    keys; every earlier key is visible). Natural-order keys start at 0
    (``TSPLayout.causal_blocks``); the gathered K/V buffer's do not (``gathered_blocks``)."""

    query_start: int
    query_len: int
    key_len: int
    key_start: int = 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def whole_sequence_blocks(seq_length: int) -> Tuple[CausalBlock]:
    """Plain causal attention over an unpartitioned sequence: one square block."""
    return (CausalBlock(0, seq_length, seq_length),)


def padded_length(length: int, group_size: int) -> int:
    """The shortest sequence length >= ``length`` that cuts into 2D equal chunks."""
    step = 2 * group_size
    return -(-length // step) * step


@dataclass(frozen=True)
class TSPLayout:
    """Zigzag layout of ``seq_length`` tokens over a group of ``group_size`` ranks.

    ``rank``: the rank whose view the ``chunk_ids`` / ``positions`` / ``causal_blocks``
    properties describe; ``None`` for a group-wide layout (permutation, every rank's chunks).
    Validated at construction: ``seq_length`` must be a positive multiple of 2D and
    ``0 <= rank < D``.

    ``context_parallel_size`` C: ``group_size`` is then the sequence group (D*C ranks, TSP x CP)
    and the weight group is ``weight_group_size`` = group_size / C ranks; rank q of the sequence
    group is TSP rank q mod D of CP rank q // D (``sequence_rank``, ``split_rank``).
    """

    group_size: int
    seq_length: int
    rank: Optional[int] = None
    context_parallel_size: int = 1

    def __post_init__(self) -> None:
        d, s = self.group_size, self.seq_length
        if not _is_int(d) or d < 1:
            raise ValueError(f"tensor-sequence-parallel size must be a positive integer, got {d!r}")
        if not _is_int(s) or s <= 0 or s % (2 * d) != 0:
            raise ValueError(
                f"sequence length {s!r} must be a positive multiple of 2 x "
                f"tensor-sequence-parallel size = {2 * d} (zigzag partition into {2 * d} chunks "
                "of equal length)"
            )
        if self.rank is not None and (not _is_int(self.rank) or not 0 <= self.rank < d):
            raise ValueError(
                f"rank {self.rank!r} is outside a tensor-sequence-parallel group of {d} ranks"
            )
        c = self.context_parallel_size
        if not _is_int(c) or c < 1 or d % c != 0:
            raise ValueError(
                f"context-parallel size {c!r} must be a positive integer dividing the sequence "
                f"group size {d} (= tensor-sequence-parallel size x context-parallel size)"
            )

    @classmethod
    def of_group(cls, group, seq_length: int) -> "TSPLayout":
        """The layout of ``seq_length`` tokens seen by this process's rank in ``group``."""
        import torch.distributed as dist

        return cls(dist.get_world_size(group), seq_length, dist.get_rank(group))

    @classmethod
    def of_groups(
        cls, weight_group, sequence_group, seq_length: int, context_parallel_size: int
    ) -> "TSPLayout":
        """This process's layout of ``seq_length`` tokens over ``sequence_group`` (TSP x CP: D*C
        ranks) whose weight group is ``weight_group`` (D ranks). Refuses a sequence group whose
        rank order is not ``sequence_rank``'s (the gathered order would not be the zigzag)."""
        import torch.distributed as dist

        d = dist.get_world_size(weight_group)
        size, q = dist.get_world_size(sequence_group), dist.get_rank(sequence_group)
        layout = cls(size, seq_length, q, context_parallel_size)
        if size != d * context_parallel_size or layout.split_rank(q)[0] != dist.get_rank(
            weight_group
        ):
            raise ValueError(
                f"sequence group (rank {q} of {size}) is not the tensor-and-context-parallel "
                f"group of a TSP group of {d} (rank {dist.get_rank(weight_group)}) x "
                f"context-parallel size {context_parallel_size}"
            )
        return layout

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def weight_group_size(self) -> int:
        """D: the TSP (weight) group's size; ``group_size`` when there is no CP."""
        return self.group_size // self.context_parallel_size

    @staticmethod
    def sequence_rank(tsp_rank: int, cp_rank: int, tsp_size: int) -> int:
        """Rank in the TSP x CP sequence group of TSP rank ``tsp_rank`` of CP rank ``cp_rank``
        (megatron-core's tensor-and-context-parallel group: TP is the stride-1 axis)."""
        if not 0 <= tsp_rank < tsp_size:
            raise ValueError(f"TSP rank {tsp_rank} is outside a group of {tsp_size} ranks")
        return cp_rank * tsp_size + tsp_rank

    def split_rank(self, rank: int) -> Tuple[int, int]:
        """(TSP rank, CP rank) of sequence-group rank ``rank``."""
        self.chunks_of(rank)  # validates the rank
        cp_rank, tsp_rank = divmod(rank, self.weight_group_size)
        return tsp_rank, cp_rank

    @property
    def cp_local_len(self) -> int:
        """Tokens of one CP rank's micro-batch (its D ranks' local tokens)."""
        return self.seq_length // self.context_parallel_size

    @property
    def num_chunks(self) -> int:
        return 2 * self.group_size

    @property
    def chunk_len(self) -> int:
        return self.seq_length // self.num_chunks

    @property
    def local_len(self) -> int:
        """Tokens per rank (two chunks)."""
        return 2 * self.chunk_len

    # ---- every rank ----------------------------------------------------------------------------
    def chunks_of(self, rank: int) -> Tuple[int, int]:
        """The two chunk ids ``rank`` holds, in its local order (r, 2D-1-r)."""
        if not 0 <= rank < self.group_size:
            raise ValueError(f"rank {rank} is outside a group of {self.group_size} ranks")
        return rank, self.num_chunks - 1 - rank

    def chunk_span(self, chunk: int) -> Tuple[int, int]:
        """Natural positions ``[start, end)`` of chunk ``chunk``."""
        return chunk * self.chunk_len, (chunk + 1) * self.chunk_len

    def spans_of(self, rank: int) -> List[Tuple[int, int]]:
        """Natural position spans of ``rank``'s two chunks, in its local order."""
        return [self.chunk_span(c) for c in self.chunks_of(rank)]

    def owner(self, position: int) -> Tuple[int, int]:
        """``(rank, local row)`` holding natural position ``position``."""
        if not 0 <= position < self.seq_length:
            raise ValueError(f"position {position} is outside a sequence of {self.seq_length}")
        chunk, row = divmod(position, self.chunk_len)
        if chunk < self.group_size:
            return chunk, row
        return self.num_chunks - 1 - chunk, self.chunk_len + row

    def permutation(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """Gathered order -> natural position: ``gathered = natural[permutation]`` (shared,
        read-only: do not modify)."""
        return _table("permutation", self.group_size, self.seq_length, device)

    def inverse(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """Natural position -> gathered index: ``natural = gathered[inverse]`` (shared,
        read-only)."""
        return _table("inverse", self.group_size, self.seq_length, device)

    def positions_of(self, rank: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """Natural positions of ``rank``'s local tokens, in local order (a shared view)."""
        self.chunks_of(rank)  # validates the rank
        return self.permutation(device).narrow(0, rank * self.local_len, self.local_len)

    def cp_batch_positions(
        self, cp_rank: int, device: Optional[torch.device] = None
    ) -> torch.Tensor:
        """Natural positions of CP rank ``cp_rank``'s micro-batch, in the order its TSP group's
        sequence-parallel embedding splits contiguously (slice ``cp_rank`` of the gathered
        order): ``local_batch = full_batch[..., cp_batch_positions(c)]`` is the one permutation
        of a batch under TSP x CP. ``cp_rank`` 0 of a layout without CP is the whole
        permutation."""
        if not 0 <= cp_rank < self.context_parallel_size:
            raise ValueError(
                f"CP rank {cp_rank} is outside a context-parallel group of "
                f"{self.context_parallel_size}"
            )
        return self.permutation(device).narrow(0, cp_rank * self.cp_local_len, self.cp_local_len)

    def cp_local_positions_of(
        self, rank: int, device: Optional[torch.device] = None
    ) -> torch.Tensor:
        """Indices of ``rank``'s local tokens (local order) inside Megatron's CP-local sequence
        of its CP rank c: natural order of CP chunks c and 2C-1-c of 2C (what
        ``get_batch_on_this_cp_rank`` and Megatron's CP-sliced RoPE table hold). Those are the
        same tokens as ``cp_batch_positions(c)``; inside them this rank holds the D-rank zigzag
        chunks of its TSP rank (see the module docstring)."""
        tsp_rank, _ = self.split_rank(rank)
        local = TSPLayout(self.weight_group_size, self.cp_local_len, tsp_rank)
        return local.positions(device)

    def cp_local_positions(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """``cp_local_positions_of`` this layout's rank."""
        return self.cp_local_positions_of(self._own_rank(), device)

    # ---- this rank -----------------------------------------------------------------------------
    def _own_rank(self) -> int:
        if self.rank is None:
            raise ValueError(
                f"TSPLayout(group_size={self.group_size}, seq_length="
                f"{self.seq_length}) has no rank: build it with rank=r"
            )
        return self.rank

    @property
    def chunk_ids(self) -> Tuple[int, int]:
        return self.chunks_of(self._own_rank())

    def positions(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """This rank's token positions (natural order index of each local row)."""
        return self.positions_of(self._own_rank(), device)

    @property
    def causal_blocks(self) -> Tuple[CausalBlock, ...]:
        """The kernel calls of this rank's causal attention against natural-order keys: local
        chunk i (id c) is query rows [iC, (i+1)C) and sees keys [0, (c+1)C)."""
        return tuple(
            CausalBlock(i * self.chunk_len, self.chunk_len, self.chunk_span(c)[1])
            for i, c in enumerate(self.chunk_ids)
        )

    @property
    def natural_runs(self) -> Tuple[Tuple[int, int, int], ...]:
        """This rank's local rows as contiguous runs of natural positions, in local order:
        ``(local row, natural start, length)`` per chunk (``DocumentMask.segments`` cuts them
        at document starts)."""
        c = self.chunk_len
        return tuple((i * c, self.chunk_span(k)[0], c) for i, k in enumerate(self.chunk_ids))

    @property
    def gathered_len(self) -> int:
        """Rows of the gathered K/V buffer (``gathered_blocks``): the S gathered rows and a copy
        of this rank's own late chunk after them (a group of one rank: S, natural order)."""
        return self.seq_length + (self.chunk_len if self.group_size > 1 else 0)

    @property
    def gathered_blocks(self) -> Tuple[CausalBlock, ...]:
        """This rank's causal attention against the K/V of the whole group as the two
        all-gathers leave it, without any reorder: ``[late chunks in owner order | early chunks
        | own late chunk]`` (owner o's late chunk 2G-1-o at rows [oC, (o+1)C), early chunk k at
        [GC + kC, GC + (k+1)C), and a local copy of this rank's late chunk at [2GC, (2G+1)C)).
        The early chunk r sees the early chunks 0..r: one bottom-right causal call over
        [GC, GC + (r+1)C). The late chunk 2G-1-r sees every early chunk, the late chunks
        G..2G-2-r (in owner order the contiguous run [(r+1)C, GC)) and itself: all of them end
        to end in [(r+1)C, (2G+1)C), with itself last, so one bottom-right causal call as well
        (no partial attentions to merge). A group of one rank keeps natural order."""
        g, c = self.group_size, self.chunk_len
        if g == 1:
            return self.causal_blocks
        r = self._own_rank()
        early = CausalBlock(0, c, (r + 1) * c, key_start=g * c)
        late = CausalBlock(c, c, (2 * g - r) * c, key_start=(r + 1) * c)
        return early, late

    def gathered_row(self, chunk: int) -> int:
        """First row of natural chunk ``chunk`` in the gathered K/V buffer
        (``gathered_blocks``; this rank's late chunk is also at row S, the local copy)."""
        g, c = self.group_size, self.chunk_len
        if g == 1:  # one rank keeps natural order
            return chunk * c
        if chunk < g:  # early chunk k, after the G late chunks
            return (g + chunk) * c
        return (2 * g - 1 - chunk) * c  # late chunk: its owner's row block

    def gathered_index(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """Natural position -> row of the gathered K/V buffer: ``natural = gathered[index]``
        (shared, read-only)."""
        return _table("gathered_index", self.group_size, self.seq_length, device)

    def sum_keys(self, dest: torch.Tensor, sources: Sequence[Tuple[int, KeyRows]]) -> torch.Tensor:
        """Write the sum of key-row tensors into ``dest`` (the S rows of the gathered K/V
        buffer, ``gathered_blocks``: what the dK/dV reduce-scatter sends) with torch ops
        (``sum_row_pieces`` of ``key_pieces``); returns ``dest``. No temporary of ``dest``'s
        size. (The attention layer sums the same pieces in one Triton launch where it can,
        ``row_sum_kernel``.)"""
        return sum_row_pieces(dest, self.key_pieces(dest.shape[0], sources))

    def key_pieces(
        self, rows: int, sources: Sequence[Tuple[int, KeyRows]]
    ) -> List[Tuple[int, int, torch.Tensor]]:
        """Where key-row tensors land in a buffer of ``rows`` rows laid out as the gathered K/V
        (``gathered_blocks``), as ``(lo, hi, tensor rows)`` pieces for ``sum_row_pieces``.
        ``sources``: ``(first row, rows)`` pairs, the rows one tensor or consecutive tensors
        (``KeyRows``: a top-left kernel's prefix and diagonal parts, never joined); rows from S
        on are the local copy of this rank's late chunk and land on that chunk's rows."""
        pieces = []
        for start, key_rows in sources:
            for part in _key_parts(key_rows):
                pieces += self._key_pieces(start, part, rows)
                start += part.shape[0]
        return pieces

    def _key_pieces(self, start: int, part: torch.Tensor, rows: int) -> list:
        """``(lo, hi, tensor)`` pieces of ``part`` (gathered rows from ``start``) in a buffer
        of ``rows`` rows, its rows in the own-late-chunk copy moved onto that chunk's rows."""
        n = part.shape[0]
        end = self.gathered_len if rows == self.seq_length else rows
        if start < 0 or start + n > end:
            raise ValueError(f"key_pieces: source rows [{start}, {start + n}) outside {end}")
        if start + n <= rows:
            return [(start, start + n, part)]
        own = self.gathered_row(self.chunk_ids[1])
        head = rows - start  # rows before the copy (the copy is the buffer's last C rows)
        tail = part.narrow(0, max(head, 0), n - max(head, 0))
        first = own + max(start - rows, 0)
        pieces = [(first, first + tail.shape[0], tail)]
        if head > 0:
            pieces.insert(0, (start, rows, part.narrow(0, 0, head)))
        return pieces


def sum_row_pieces(dest: torch.Tensor, pieces: Sequence[Tuple[int, int, torch.Tensor]]):
    """``dest`` row i = the sum of the ``(lo, hi, tensor)`` pieces covering it (``tensor`` holds
    rows [lo, hi)); returns ``dest``. Rows no piece covers are zeroed; a row one piece covers
    is copied; where pieces overlap their sum is computed in the wider of their and ``dest``'s
    precision (fp32 at least, in the pieces' order) and rounded once into ``dest``."""
    cuts = sorted({0, dest.shape[0]} | {lo for lo, _, _ in pieces} | {hi for _, hi, _ in pieces})
    for lo, hi in zip(cuts, cuts[1:]):
        views = [t.narrow(0, lo - a, hi - lo) for a, b, t in pieces if a <= lo and hi <= b]
        out = dest.narrow(0, lo, hi - lo)
        if not views:
            out.zero_()
        elif len(views) == 1:
            out.copy_(views[0])
        elif len(views) == 2 and torch.result_type(*views) == dest.dtype:
            torch.add(views[0], views[1], out=out)  # one rounding of the wide sum
        else:  # a wider destination, or more sources: sum in the widest precision
            wide = torch.promote_types(dest.dtype, torch.float32)
            for v in views:
                wide = torch.promote_types(wide, v.dtype)
            total = views[0].to(wide)
            for v in views[1:]:
                total = total + v
            out.copy_(total)
    return dest


def _key_parts(rows) -> List[torch.Tensor]:
    return [rows] if isinstance(rows, torch.Tensor) else list(rows)


def _outside_dispatch_modes(build):
    """Build a cached host table with no dispatch mode active: a table first asked for inside
    ``FakeTensorMode`` (the memory and traffic tools run the layers on fake tensors in-process)
    would otherwise be cached as a fake tensor and serve garbage to every real run after it."""

    @functools.wraps(build)
    def real(*args):
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return build(*args)

    return real


@functools.lru_cache(maxsize=64)
@_outside_dispatch_modes
def _host_permutation(group_size: int, seq_length: int) -> torch.Tensor:
    layout = TSPLayout(group_size, seq_length)
    spans = [span for r in range(group_size) for span in layout.spans_of(r)]
    return torch.cat([torch.arange(start, end) for start, end in spans])


@functools.lru_cache(maxsize=64)
@_outside_dispatch_modes
def _host_inverse(group_size: int, seq_length: int) -> torch.Tensor:
    perm = _host_permutation(group_size, seq_length)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(seq_length)
    return inv


@functools.lru_cache(maxsize=64)
@_outside_dispatch_modes
def _host_gathered_index(group_size: int, seq_length: int) -> torch.Tensor:
    layout = TSPLayout(group_size, seq_length)
    c = layout.chunk_len
    starts = [layout.gathered_row(k) for k in range(2 * group_size)]
    return torch.cat([torch.arange(start, start + c) for start in starts])


_DEVICE_TABLES: Dict[tuple, torch.Tensor] = {}


def _table(
    kind: str, group_size: int, seq_length: int, device: Optional[torch.device]
) -> torch.Tensor:
    """The (inverse) permutation, or the gathered K/V rows of the natural positions
    ("gathered_index"), built once per shape and copied once per device (no host-to-device copy per
    call on GPUs)."""
    builders = {
        "permutation": _host_permutation,
        "inverse": _host_inverse,
        "gathered_index": _host_gathered_index,
    }
    host = builders[kind](group_size, seq_length)
    if device is None or torch.device(device) == host.device:
        return host
    key = (kind, group_size, seq_length, torch.device(device))
    table = _DEVICE_TABLES.get(key)
    if table is None:
        table = host.to(device)
        # a copy made under FakeTensorMode is fake: used for that run only, never cached
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(table, FakeTensor):
            _DEVICE_TABLES[key] = table
    return table
