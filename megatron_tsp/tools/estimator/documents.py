"""Packed documents: how much causal attention work each rank of a TSP group does, per layout.

A packed sequence of S tokens holds documents end to end; a query at natural position p attends
the keys ``[doc_start(p), p]`` of its own document. The attention kernels' FLOPs follow the
in-document (query, key) pairs, ``sum_d L_d (L_d + 1) / 2``, not ``S (S + 1) / 2``; which rank
computes which pairs depends on the layout, and the slowest rank sets the layer's pace.

Layouts (``LAYOUTS``), D ranks:

- ``zigzag``: today's TSP layout (``core/layout.py`` ``TSPLayout``): the sequence cut into 2D
  equal chunks, rank r holds chunks r and 2D-1-r whatever the documents.
- ``thd``: Transformer Engine's THD + context-parallel convention (Megatron-LM pads
  ``cu_seqlens`` so under CP): every document padded to a multiple of 2D, cut into 2D chunks,
  rank r holds chunks r and 2D-1-r of every document. Padding tokens do no attention work.
- ``chunks-K``: document-aware chunk assignment: the sequence cut into K*D equal chunks; each
  chunk's in-document pairs are known before the step, and the chunks go to ranks largest
  first, each to the least-loaded rank holding fewer than K (every rank holds S/D tokens, no
  padding). K = 2 is a different pairing of today's 2D chunks.
- ``split-T``: per-document zigzag only for documents of at least T tokens (padded as ``thd``);
  the shorter ones end to end in one stream, zigzagged like ``zigzag`` (padded to a multiple
  of 2D at its end).

Work per rank: its queries' in-document pairs (the kernel FLOPs are proportional), and the tiles
a tiled flash kernel computes: each rank's queries are cut at chunk and document boundaries,
every piece one bottom-right causal call (as ``core/documents.py`` plans TSP's document
attention, and as a varlen THD kernel runs), query tiles aligned at the piece's start and key
tiles at its document's start; a tile is computed when it holds at least one in-document causal
pair (empty tiles skipped, partial ones computed whole). Balance = max / mean over ranks.

K/V exchange: every layout all-gathers the K/V of all its tokens per head group (S, plus the
padding for ``thd`` / ``split-T``). Today's zigzag needs no reorder for one causal document
(``TSPLayout.gathered_blocks``); with documents its late chunks arrive in descending natural
order, and TSP's document path copies the whole gathered K/V into natural order (one
``index_select`` per head group, ``core/layers/attention.py``; the late half alone would do);
``thd``, ``split-T`` and ``chunks-K`` reorder the whole gathered buffer too.

Document-length mixes (``parse_mix``), sizes in tokens with ``k`` = 1024 and ``M`` = 1024^2:

- ``single``: one document of S tokens (unpacked causal attention).
- ``uniform:LO-HI``: lengths uniform in [LO, HI].
- ``heavy:ALPHA,LO-HI``: heavy-tailed: a Pareto of shape ALPHA truncated to [LO, HI]
  (inverse CDF ``LO (1 - u (1 - (LO/HI)^ALPHA))^(-1/ALPHA)``); ALPHA < 1 gives many short
  documents and a few near HI.
- ``long+short:L,LO-HI``: one document of L tokens at a uniformly drawn place among documents
  uniform in [LO, HI].
- ``fixed:L1,L2,...``: these lengths, in order, repeated.

A sequence is filled with documents drawn in order until S tokens; the last is cut at S (packing
cuts a document at the sequence boundary). Draw i uses ``random.Random(seed * 1_000_003 + i)``.

Standard library only: host-side integer arithmetic, milliseconds per draw at S = 128k.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import math
import random
import re
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from megatron_tsp.console.args import ToolParser, UsageError, positive_int
from megatron_tsp.core.layout import TSPLayout, padded_length

MIX_FLAG = "--documents"
TILE = 128  # a flash kernel's query x key tile (FlashAttention-2/3 on H100: 128 x 128)
DRAWS = 8  # the planner's draws per sequence length (seed 0)

_UNITS = {"": 1, "k": 1024, "m": 1024**2}


# ---------------------------------------------------------------------------------------------
# mixes
# ---------------------------------------------------------------------------------------------
def parse_size(text: str, flag: str = MIX_FLAG) -> int:
    """``"32k"`` -> 32768, ``"1M"`` -> 1048576, ``"4096"`` -> 4096; refused naming ``flag``."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not m or int(m.group(1)) < 1:
        raise ValueError(f"{flag}: {text!r} is not a positive token count (e.g. 4096, 32k, 1M)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def _range(text: str, flag: str) -> Tuple[int, int]:
    lo_hi = text.split("-")
    if len(lo_hi) != 2:
        raise ValueError(f"{flag}: {text!r} is not a length range LO-HI (e.g. 1k-32k)")
    lo, hi = (parse_size(x, flag) for x in lo_hi)
    if lo > hi:
        raise ValueError(f"{flag}: range {text!r} has LO {lo} > HI {hi}")
    return lo, hi


@dataclass(frozen=True)
class DocumentMix:
    """A document-length distribution (see the module docstring); ``text`` is its spec."""

    text: str
    kind: str  # single | uniform | heavy | long+short | fixed
    lo: int = 0
    hi: int = 0
    alpha: float = 0.0
    long: int = 0
    lengths: Tuple[int, ...] = ()

    def _short(self, rng: random.Random) -> int:
        if self.kind == "heavy":
            a, lo, hi = self.alpha, self.lo, self.hi
            u = rng.random()
            return min(hi, max(lo, int(lo * (1 - u * (1 - (lo / hi) ** a)) ** (-1 / a))))
        return rng.randint(self.lo, self.hi)

    def draw(self, seq: int, rng: random.Random) -> List[int]:
        """Document lengths of one sequence of ``seq`` tokens (sum = ``seq``)."""
        if self.kind == "single":
            return [seq]
        out: List[int] = []
        left = seq
        if self.kind == "fixed":
            i = 0
            while left:
                out.append(min(self.lengths[i % len(self.lengths)], left))
                left -= out[-1]
                i += 1
            return out
        if self.kind == "long+short":
            left -= min(self.long, seq)
        while left > 0:
            out.append(min(self._short(rng), left))
            left -= out[-1]
        if self.kind == "long+short":
            out.insert(rng.randint(0, len(out)), min(self.long, seq))
        return out


def parse_mix(text: str, flag: str = MIX_FLAG) -> DocumentMix:
    """A mix from its spec (module docstring); a malformed spec raises ``ValueError`` naming
    ``flag`` and the offending numbers."""
    kind, _, rest = text.strip().partition(":")
    kind = kind.strip().lower()
    if kind == "single":
        if rest.strip():
            raise ValueError(f"{flag}: 'single' takes no parameters, got {text!r}")
        return DocumentMix(text, "single")
    if kind == "uniform":
        lo, hi = _range(rest, flag)
        return DocumentMix(text, "uniform", lo=lo, hi=hi)
    if kind == "heavy":
        alpha, _, rng = rest.partition(",")
        try:
            a = float(alpha)
        except ValueError:
            a = float("nan")
        if not 0 < a < math.inf:
            raise ValueError(f"{flag}: heavy:ALPHA,LO-HI needs ALPHA > 0, got {alpha!r}")
        lo, hi = _range(rng, flag)
        return DocumentMix(text, "heavy", lo=lo, hi=hi, alpha=a)
    if kind == "long+short":
        long, comma, rng = rest.partition(",")
        if not comma:
            raise ValueError(f"{flag}: long+short:L,LO-HI needs the short range, got {text!r}")
        lo, hi = _range(rng, flag)
        return DocumentMix(text, "long+short", lo=lo, hi=hi, long=parse_size(long, flag))
    if kind == "fixed":
        lengths = tuple(parse_size(x, flag) for x in rest.split(","))
        return DocumentMix(text, "fixed", lengths=lengths)
    raise ValueError(
        f"{flag}: unknown mix {text!r} (single, uniform:LO-HI, heavy:ALPHA,LO-HI, "
        "long+short:L,LO-HI, fixed:L1,L2,...)"
    )


def draws(mix: DocumentMix, seq: int, n: int, seed: int = 0) -> List[List[int]]:
    """``n`` sequences' document lengths (draw i seeded ``seed * 1_000_003 + i``)."""
    return [mix.draw(seq, random.Random(seed * 1_000_003 + i)) for i in range(n)]


# ---------------------------------------------------------------------------------------------
# pairs and tiles
# ---------------------------------------------------------------------------------------------
def document_pairs(lengths: Sequence[int]) -> int:
    """In-document causal (query, key) pairs: sum L (L + 1) / 2."""
    return sum(n * (n + 1) // 2 for n in lengths)


def _starts(lengths: Sequence[int]) -> List[int]:
    out, pos = [], 0
    for n in lengths:
        out.append(pos)
        pos += n
    return out


def _pieces(starts: Sequence[int], total: int, a: int, b: int):
    """(start, end, doc start) of the pieces of query span [a, b) cut at document starts;
    positions >= ``total`` (padding) are in no document."""
    b = min(b, total)
    i = bisect.bisect_right(starts, a) - 1
    while a < b:
        end = min(b, starts[i + 1] if i + 1 < len(starts) else total)
        yield a, end, starts[i]
        a, i = end, i + 1


def _piece_pairs(x: int, y: int, s: int) -> int:
    """Pairs of queries [x, y) whose document starts at s: sum_{p=x}^{y-1} (p - s + 1)."""
    n = y - x
    return n * (x - s + 1) + n * (n - 1) // 2


def _piece_tiles(x: int, y: int, s: int, tile: int) -> int:
    """Tiles of one bottom-right causal call: queries [x, y) against keys [s, y), query tiles
    from x, key tiles from s. The keys a query tile [q0, q1) touches are [s, q1) (contiguous),
    so it computes ceil((q1 - s) / tile) key tiles."""
    out = 0
    for q0 in range(x, y, tile):
        q1 = min(q0 + tile, y)
        out += -(-(q1 - s) // tile)
    return out


@dataclass
class RankWork:
    """Per-rank attention work of one sequence under one layout."""

    layout: str
    pairs: List[int]
    tiles: List[int]
    padding: int  # tokens added (all ranks together)
    kv_tokens: int  # tokens whose K/V every rank all-gathers per head group
    reorder_tokens: int  # gathered rows reordered to natural order before the kernels

    @property
    def balance(self) -> float:
        return max(self.pairs) * len(self.pairs) / sum(self.pairs)

    @property
    def tile_balance(self) -> float:
        return max(self.tiles) * len(self.tiles) / sum(self.tiles)


def _add_spans(work, ranks_spans, starts, total, tile):
    """Add the pairs / tiles of each rank's query spans (segment coordinates) to ``work``."""
    pairs, tiles = work
    for r, spans in enumerate(ranks_spans):
        for a, b in spans:
            for x, y, s in _pieces(starts, total, a, b):
                pairs[r] += _piece_pairs(x, y, s)
                tiles[r] += _piece_tiles(x, y, s, tile) if tile else 0


def _zigzag_segment(work, lengths: Sequence[int], D: int, tile: int) -> int:
    """Zigzag one segment (documents end to end, padded at its end to a multiple of 2D) over D
    ranks, adding to ``work``; returns the padding tokens."""
    total = sum(lengths)
    if not total:
        return 0
    padded = padded_length(total, D)
    layout = TSPLayout(D, padded)
    spans = [layout.spans_of(r) for r in range(D)]
    _add_spans(work, spans, _starts(lengths), total, tile)
    return padded - total


def zigzag(lengths: Sequence[int], D: int, tile: int = TILE) -> RankWork:
    """Layout (a), today's TSP: 2D global chunks, rank r holds chunks r and 2D-1-r."""
    S = sum(lengths)
    if S % (2 * D):
        raise ValueError(f"--seq-length {S} is not a multiple of 2D = {2 * D} (zigzag)")
    work = ([0] * D, [0] * D)
    _zigzag_segment(work, lengths, D, tile)
    reorder = S if len(lengths) > 1 and D > 1 else 0  # TSP's document path: all S rows
    return RankWork("zigzag", *work, padding=0, kv_tokens=S, reorder_tokens=reorder)


def split(lengths: Sequence[int], D: int, threshold: int, tile: int = TILE) -> RankWork:
    """Per-document zigzag for documents of >= ``threshold`` tokens, the others zigzagged as one
    stream; ``threshold`` 1 is layout (b), Transformer Engine's THD + CP."""
    work = ([0] * D, [0] * D)
    pad = sum(_zigzag_segment(work, [n], D, tile) for n in lengths if n >= threshold)
    pad += _zigzag_segment(work, [n for n in lengths if n < threshold], D, tile)
    total = sum(lengths) + pad
    name = "thd" if threshold <= 1 else f"split-{_size_text(threshold)}"
    reorder = total if len(lengths) > 1 and D > 1 else 0  # one document: today's zigzag
    return RankWork(name, *work, padding=pad, kv_tokens=total, reorder_tokens=reorder)


def thd(lengths: Sequence[int], D: int, tile: int = TILE) -> RankWork:
    """Layout (b): every document padded to a multiple of 2D, rank r holds its chunks r and
    2D-1-r (Transformer Engine's THD + CP)."""
    return split(lengths, D, 1, tile)


def assign_chunks(chunk_work: Sequence[int], D: int, per_rank: int) -> List[List[int]]:
    """Chunk ids per rank: largest first, each to the least-loaded rank holding fewer than
    ``per_rank`` (ties: the lower rank)."""
    load, owned = [0] * D, [[] for _ in range(D)]
    for i in sorted(range(len(chunk_work)), key=lambda i: (-chunk_work[i], i)):
        r = min((r for r in range(D) if len(owned[r]) < per_rank), key=lambda r: (load[r], r))
        owned[r].append(i)
        load[r] += chunk_work[i]
    return owned


def chunks(lengths: Sequence[int], D: int, per_rank: int, tile: int = TILE) -> RankWork:
    """Document-aware chunks: K*D equal chunks assigned by ``assign_chunks`` (no padding)."""
    S, n = sum(lengths), D * per_rank
    if S % n:
        raise ValueError(
            f"--layouts chunks-{per_rank}: --seq-length {S} is not a multiple of {per_rank} x "
            f"--degree {D} = {n} chunks"
        )
    c, starts = S // n, _starts(lengths)
    per_chunk = [0] * n
    for i in range(n):
        for x, y, s in _pieces(starts, S, i * c, (i + 1) * c):
            per_chunk[i] += _piece_pairs(x, y, s)
    owned = assign_chunks(per_chunk, D, per_rank)
    work = ([0] * D, [0] * D)
    _add_spans(work, [[(i * c, (i + 1) * c) for i in ids] for ids in owned], starts, S, tile)
    return RankWork(f"chunks-{per_rank}", *work, padding=0, kv_tokens=S, reorder_tokens=S)


def _size_text(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def layout_work(name: str, lengths: Sequence[int], D: int, tile: int = TILE) -> RankWork:
    """``zigzag``, ``thd``, ``chunks-K`` or ``split-T`` (T a size: ``split-16k``)."""
    if name == "zigzag":
        return zigzag(lengths, D, tile)
    if name == "thd":
        return thd(lengths, D, tile)
    if name.startswith("chunks-") and name[7:].isdigit() and int(name[7:]) >= 1:
        return chunks(lengths, D, int(name[7:]), tile)
    if name.startswith("split-"):
        return split(lengths, D, parse_size(name[6:], "--layouts"), tile)
    raise ValueError(f"--layouts: unknown layout {name!r} (zigzag, thd, chunks-K, split-T)")


# ---------------------------------------------------------------------------------------------
# the planner's factors
# ---------------------------------------------------------------------------------------------
def strategy_layout(s) -> Tuple[Optional[str], int]:
    """(layout, ranks) of a planner ``Strategy``'s attention with packed documents: TSP today's
    ``zigzag`` over its group (TSP x CP: over the D*C sequence group, ``core/layout.py``);
    Megatron's CP layouts (CP, TP+SP x CP, ZeRO-3 x CP, GTP x CP) Transformer Engine's ``thd``
    over the CP ranks; (None, 1) where every rank runs every token of its heads (TP, TP+SP, the
    hybrid, GTP without CP)."""
    if s.kind in ("tsp", "tsp_cp"):
        return "zigzag", s.degree
    if s.layout in ("cp", "tp_cp"):
        return "thd", s.cp
    return None, 1


@functools.lru_cache(maxsize=4096)
def attention_factors(
    mix_text: str, seq: int, ranks: int, layout: Optional[str], n: int = DRAWS
) -> Tuple[float, float]:
    """(pairs, time) factors of the planner's causal attention term ``2*2*B*S^2*h*f`` for one
    mix at ``seq``, mean over ``n`` draws (seed 0): pairs = sum L^2 / S^2 (the documents' share
    of today's S^2 / 2 convention: 1.0 for one document); time = pairs x the layout's max / mean
    over ``ranks`` (the slowest rank's work; 1.0 balance without a layout or with one rank)."""
    mix = parse_mix(mix_text)
    pair_f = time_f = 0.0
    pad = -seq % (2 * ranks)  # a length the zigzag does not cut (a sweep's point): the last
    for lengths in draws(mix, seq, n):  # document runs on into the padding
        p = sum(x * x for x in lengths) / seq**2
        bal = 1.0
        if layout and ranks > 1:
            bal = layout_work(layout, lengths[:-1] + [lengths[-1] + pad], ranks, tile=0).balance
        pair_f += p
        time_f += p * bal
    return pair_f / n, time_f / n


# ---------------------------------------------------------------------------------------------
# the report (``megatron-tsp documents``)
# ---------------------------------------------------------------------------------------------
def summarize(
    mix: DocumentMix, seq: int, D: int, layouts: Sequence[str], n: int, seed: int, tile: int = TILE
) -> List[dict]:
    """Per layout: balance (pairs, tiles) mean / worst over the draws, padding %, tiles of the
    slowest rank (mean) and the K/V tokens gathered and reordered per head group (mean)."""
    seqs = draws(mix, seq, n, seed)
    rows = []
    for name in layouts:
        ws = [layout_work(name, lengths, D, tile) for lengths in seqs]
        rows.append(
            {
                "mix": mix.text,
                "layout": ws[0].layout,
                "docs": sum(len(x) for x in seqs) / n,
                "balance_mean": sum(w.balance for w in ws) / n,
                "balance_worst": max(w.balance for w in ws),
                "tile_balance_mean": sum(w.tile_balance for w in ws) / n,
                "tile_balance_worst": max(w.tile_balance for w in ws),
                "padding_pct_mean": 100 * sum(w.padding for w in ws) / n / seq,
                "padding_pct_worst": 100 * max(w.padding for w in ws) / seq,
                "max_tiles": sum(max(w.tiles) for w in ws) / n,
                "kv_tokens": sum(w.kv_tokens for w in ws) / n,
                "reorder_tokens": sum(w.reorder_tokens for w in ws) / n,
                "pair_share": sum(document_pairs(x) for x in seqs) / n / (seq * (seq + 1) / 2),
            }
        )
    return rows


def format_rows(rows: List[dict]) -> str:
    head = (
        "| mix | layout | docs | balance mean / worst | tile balance mean / worst | "
        "padding % mean / worst | tiles (slowest rank) | K/V gathered / reordered |"
    )
    out = [head, "|" + "---|" * 8]
    for r in rows:
        out.append(
            f"| `{r['mix']}` | {r['layout']} | {r['docs']:.1f} | "
            f"{r['balance_mean']:.3f} / {r['balance_worst']:.3f} | "
            f"{r['tile_balance_mean']:.3f} / {r['tile_balance_worst']:.3f} | "
            f"{r['padding_pct_mean']:.3f} / {r['padding_pct_worst']:.3f} | "
            f"{r['max_tiles']:,.0f} | {r['kv_tokens']:,.0f} / {r['reorder_tokens']:,.0f} |"
        )
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = ToolParser(
        prog="megatron-tsp documents",
        description="Attention balance of packed documents across a TSP group: per-rank "
        "in-document causal pairs and flash tiles for today's zigzag, Transformer Engine's "
        "THD + CP and document-aware layouts (host-side arithmetic, no model).",
    )
    ap.add_argument(
        MIX_FLAG,
        action="append",
        required=True,
        help="a document-length mix (repeatable): single, uniform:LO-HI, heavy:ALPHA,LO-HI "
        "(Pareto truncated to [LO, HI]), long+short:L,LO-HI, fixed:L1,L2,...; k = 1024",
    )
    ap.add_argument("--seq-length", type=positive_int, default=131072)
    ap.add_argument("--degree", type=positive_int, default=8, help="TSP group size D")
    ap.add_argument(
        "--layouts",
        default="zigzag,thd,chunks-2,chunks-4,chunks-8,split-16k",
        help="comma-separated: zigzag (today's TSP), thd (TE THD + CP), chunks-K (K*D chunks, "
        "document-aware assignment), split-T (per-document zigzag for documents >= T tokens)",
    )
    ap.add_argument("--draws", type=positive_int, default=16, help="sequences per mix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tile", type=positive_int, default=TILE, help="flash kernel tile edge")
    ap.add_check(_check_args)
    return ap


def _check_args(args) -> None:
    try:
        args.mixes = [parse_mix(x) for x in args.documents]
    except ValueError as exc:
        raise UsageError("", str(exc)) from None
    args.layout_names = [x.strip() for x in args.layouts.split(",") if x.strip()]
    S, D = args.seq_length, args.degree
    if S % (2 * D):
        raise UsageError("--seq-length", f"{S} is not a multiple of 2 x --degree = {2 * D}")
    for name in args.layout_names:
        try:
            layout_work(name, [S], D, tile=0)
        except ValueError as exc:
            raise UsageError("", str(exc)) from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    rows = []
    for mix in args.mixes:
        rows += summarize(
            mix, args.seq_length, args.degree, args.layout_names, args.draws, args.seed, args.tile
        )
    print(
        f"S = {args.seq_length:,} tokens, D = {args.degree}, {args.draws} draws per mix (seed "
        f"{args.seed}), {args.tile}x{args.tile} tiles"
    )
    print()
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
