"""Zigzag sequence partition for causal load balance.

The sequence of length S is cut into 2D chunks of C = S / (2D) tokens. Rank r of a group of size D
holds chunks ``r`` and ``2D-1-r`` in that order, so every rank owns one "early" and one "late" chunk
and does the same amount of causal-attention work.

Two views of the same layout are used:

* split / unsplit: a rank's local ``[2C]`` slice of a tensor, and the inverse;
* permute / unpermute: the whole sequence reordered as ``[c0, c_{2D-1}, c1, c_{2D-2}, ...]`` so that
  Megatron's *contiguous* sequence-parallel shards are exactly the zigzag chunks. This is what
  ``get_batch_on_this_tsp_rank`` applies to a batch.
"""

from __future__ import annotations

import functools
from typing import Dict, Optional, Sequence

import torch

from megatron_tsp.core.validation import check_sequence_length  # noqa: F401 (re-exported)


def chunk_ids(group_size: int, rank: int) -> tuple[int, int]:
    """The two zigzag chunk indices held by ``rank``, in local order."""
    return rank, 2 * group_size - 1 - rank


@functools.lru_cache(maxsize=64)
def _permutation(seq_length: int, group_size: int) -> torch.Tensor:
    check_sequence_length(seq_length, group_size)
    chunk = seq_length // (2 * group_size)
    order = []
    for rank in range(group_size):
        for c in chunk_ids(group_size, rank):
            order.append(torch.arange(c * chunk, (c + 1) * chunk))
    return torch.cat(order)


def permutation(seq_length: int, group_size: int) -> torch.Tensor:
    """Index ``perm`` with ``permuted = full[perm]``: positions of the zigzag order."""
    return _permutation(seq_length, group_size).clone()


@functools.lru_cache(maxsize=64)
def _inverse(seq_length: int, group_size: int) -> torch.Tensor:
    perm = _permutation(seq_length, group_size)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(seq_length)
    return inv


def inverse_permutation(seq_length: int, group_size: int) -> torch.Tensor:
    return _inverse(seq_length, group_size).clone()


_device_index_cache: dict = {}


def _index_on(kind: str, seq_length: int, group_size: int, device: torch.device) -> torch.Tensor:
    """The (inverse) permutation as an index tensor on ``device``, built once per shape and device
    (avoids a host-to-device copy per call on GPUs)."""
    key = (kind, seq_length, group_size, device)
    index = _device_index_cache.get(key)
    if index is None:
        table = _permutation if kind == "perm" else _inverse
        index = _device_index_cache[key] = table(seq_length, group_size).to(device)
    return index


def local_positions(seq_length: int, group_size: int, rank: int,
                    device: Optional[torch.device] = None) -> torch.Tensor:
    """True sequence positions of the ``2C`` tokens held by ``rank``, in local order."""
    local = seq_length // group_size
    if device is not None:
        return _index_on("perm", seq_length, group_size, device)[rank * local:(rank + 1) * local]
    return _permutation(seq_length, group_size)[rank * local : (rank + 1) * local].clone()


def permute(x: torch.Tensor, group_size: int, dim: int) -> torch.Tensor:
    return x.index_select(dim, _index_on("perm", x.shape[dim], group_size, x.device))


def unpermute(x: torch.Tensor, group_size: int, dim: int) -> torch.Tensor:
    return x.index_select(dim, _index_on("inv", x.shape[dim], group_size, x.device))


def permute_into(x: torch.Tensor, group_size: int, dim: int, out: torch.Tensor) -> torch.Tensor:
    """``permute`` written into a preallocated ``out`` (a persistent communication buffer)."""
    return torch.index_select(x, dim, _index_on("perm", x.shape[dim], group_size, x.device),
                              out=out)


def unpermute_into(x: torch.Tensor, group_size: int, dim: int, out: torch.Tensor) -> torch.Tensor:
    """``unpermute`` written into a preallocated ``out``."""
    return torch.index_select(x, dim, _index_on("inv", x.shape[dim], group_size, x.device),
                              out=out)


def split(x: torch.Tensor, group_size: int, rank: int, dim: int) -> torch.Tensor:
    """This rank's local slice (chunks r and 2D-1-r, concatenated) of a full-sequence tensor."""
    check_sequence_length(x.shape[dim], group_size)
    chunks = x.chunk(2 * group_size, dim=dim)
    a, b = chunk_ids(group_size, rank)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def unsplit(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of ``split``: ``parts[r]`` is rank r's local slice."""
    group_size = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    ordered = [halves[c][0] for c in range(group_size)]
    ordered += [halves[group_size - 1 - i][1] for i in range(group_size)]
    return torch.cat(ordered, dim=dim)


def natural_order_from_gathered(x: torch.Tensor, group_size: int, dim: int) -> torch.Tensor:
    """Reorder a tensor all-gathered over the group (rank-major zigzag order) to natural order."""
    return unpermute(x, group_size, dim)


BATCH_SEQ_DIM = 1


def get_batch_on_this_tsp_rank(
    batch: Dict[str, Optional[torch.Tensor]],
    group_size: Optional[int] = None,
    permute_attention_mask: bool = True,
) -> Dict[str, Optional[torch.Tensor]]:
    """Zigzag-permute a Megatron ``get_batch`` dict along the sequence.

    In: the full-sequence batch every TP/TSP rank receives from Megatron's data broadcast:
    ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` as ``[b, s]`` and ``attention_mask`` as
    ``[b, 1, s, s]`` (any key may be missing or None).

    Out: the same keys, reordered along ``s`` to ``[c0, c_{2D-1}, c1, c_{2D-2}, ...]``. Fed to a
    ``GPTModel`` running with sequence parallelism, Megatron's embedding scatters contiguous
    sequence shards, so TSP rank r works on chunks r and 2D-1-r. ``position_ids`` keep the tokens'
    true positions. The per-token losses the model returns (``[b, s]``) are in the same permuted
    order; ``loss_mask`` is permuted identically, so ``sum(loss * mask) / sum(mask)`` equals the
    unpermuted objective. ``zigzag.unpermute(losses, D, dim=1)`` restores natural order.

    ``permute_attention_mask=False`` passes ``attention_mask`` through untouched (TSP attention
    never reads it: causality comes from the zigzag positions; the Megatron-LM hook uses this so
    that no S x S tensor is permuted). The returned tensors are marked for
    ``megatron_tsp.core.batch_guard`` (TSP attention refuses unmarked micro-batches under the
    launcher).
    """
    from megatron_tsp.core.batch_guard import mark_zigzagged

    if group_size is None:
        from megatron_tsp.core import parallel_state

        group_size = parallel_state.get_tensor_sequence_parallel_world_size()
    out: Dict[str, Optional[torch.Tensor]] = {}
    for key, value in batch.items():
        if value is None or group_size == 1:
            out[key] = value
        elif key == "attention_mask":
            out[key] = (permute(permute(value, group_size, dim=-1), group_size, dim=-2)
                        if permute_attention_mask else value)
        elif torch.is_tensor(value) and value.dim() >= 2:
            check_sequence_length(value.shape[BATCH_SEQ_DIM], group_size)
            out[key] = permute(value, group_size, dim=BATCH_SEQ_DIM)
        else:
            out[key] = value
    for key in ("tokens", "position_ids", "labels"):
        mark_zigzagged(out.get(key), group_size)
    return out
