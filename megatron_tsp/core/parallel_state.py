"""The TSP process group: Megatron's tensor-parallel ranks, run with sequence-parallel semantics.

TSP folds weight sharding (like TP) and sequence sharding (like SP) onto ONE axis of size D. We
reuse Megatron's tensor-parallel rank group for that axis (``tensor_model_parallel_size = D``,
``sequence_parallel = True``): TP is the stride-1, intra-node axis, and every piece of Megatron that
reasons about TP groups (data-parallel sizing, DDP and distributed-optimizer groups, the
``tensor_model_parallel`` / ``partition_dim`` parameter attributes, vocab-parallel embedding and
loss, the TP-rank-0 data broadcast, the SUM all-reduce of ``sequence_parallel`` parameters'
gradients, checkpoint sharding) keeps working unchanged. Only the transformer layers differ.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from megatron.core import parallel_state as mpu

from megatron_tsp.core.validation import check_parallel_layout

_TSP_SIZE: Optional[int] = None
_CREATED_GROUPS: list = []  # process groups made by our initialize, destroyed by our destroy


def _live_groups() -> set:
    return set(dist.distributed_c10d._world.pg_map.keys())


def _agree_on_config(local_error: Optional[str], signature: tuple) -> None:
    """Every rank learns whether any rank rejected the configuration, before any group exists.

    A rank whose arguments are bad must not leave the others waiting inside ``new_group``: all
    ranks exchange (error, config) once on the default group and raise together.
    """
    world = dist.get_world_size()
    gathered = [None] * world
    dist.all_gather_object(gathered, (local_error, signature))
    errors = [(r, e) for r, (e, _) in enumerate(gathered) if e is not None]
    if errors:
        if local_error is not None:
            raise ValueError(local_error)
        r, e = errors[0]
        raise ValueError(f"rank {r} rejected the TSP configuration: {e}")
    signatures = {s for _, s in gathered}
    if len(signatures) > 1:
        raise ValueError(
            "ranks disagree on the parallel configuration "
            f"(tensor_sequence_parallel_size, pipeline, tp, cp): {sorted(signatures)}"
        )


def initialize_model_parallel(
    tensor_sequence_parallel_size: int,
    pipeline_model_parallel_size: int = 1,
    **megatron_kwargs,
) -> None:
    """Create Megatron's groups with the TSP axis as the tensor-parallel group.

    ``megatron_kwargs`` go to ``megatron.core.parallel_state.initialize_model_parallel``.
    ``tensor_model_parallel_size`` may be omitted (or equal D); ``context_parallel_size`` C > 1
    makes TSP x CP: the sequence group is megatron-core's tensor-and-context-parallel group of
    D*C ranks (``get_tensor_sequence_and_context_parallel_group``). The check runs on every
    rank and is agreed on collectively before any group is made.
    """
    global _TSP_SIZE
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before TSP groups are created")
    tp = megatron_kwargs.pop("tensor_model_parallel_size", 1)
    cp = megatron_kwargs.get("context_parallel_size", 1)
    error = None
    try:
        check_parallel_layout(
            dist.get_world_size(),
            tensor_sequence_parallel_size,
            pipeline_model_parallel_size,
            tensor_model_parallel_size=tp,
            context_parallel_size=cp,
        )
    except ValueError as exc:
        error = str(exc)
    _agree_on_config(error, (tensor_sequence_parallel_size, pipeline_model_parallel_size, tp, cp))
    before = _live_groups()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tensor_sequence_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        **megatron_kwargs,
    )
    _CREATED_GROUPS.extend(g for g in _live_groups() - before if g is not dist.GroupMember.WORLD)
    _TSP_SIZE = tensor_sequence_parallel_size


def mark_initialized(tensor_sequence_parallel_size: int) -> None:
    """Declare that Megatron's groups, created by someone else (Megatron-LM's own
    ``initialize_megatron``), are the TSP groups: ``tensor_model_parallel_size`` must equal D."""
    global _TSP_SIZE
    size = mpu.get_tensor_model_parallel_world_size()
    if size != tensor_sequence_parallel_size:
        raise ValueError(
            f"--tensor-sequence-parallel-size={tensor_sequence_parallel_size} but Megatron's "
            f"tensor-parallel group has {size} ranks"
        )
    _TSP_SIZE = tensor_sequence_parallel_size


def destroy_model_parallel() -> None:
    """Destroy Megatron's groups and the TSP state, so the process can re-initialise with any D.

    Megatron's own destroy only drops its references; the process groups our initialize created
    are destroyed too, so repeated re-initialisation does not accumulate communicator threads
    and sockets (gloo keeps worker threads per group)."""
    global _TSP_SIZE
    _TSP_SIZE = None
    mpu.destroy_model_parallel()
    while _CREATED_GROUPS:
        group = _CREATED_GROUPS.pop()
        if group in _live_groups():
            dist.destroy_process_group(group)


def is_tensor_sequence_parallel() -> bool:
    return _TSP_SIZE is not None


def _require() -> None:
    if _TSP_SIZE is None:
        raise RuntimeError(
            "TSP groups are not initialized: call megatron_tsp.initialize_model_parallel("
            "tensor_sequence_parallel_size=D) first"
        )


def get_tensor_sequence_parallel_group(check_initialized: bool = True):
    if check_initialized:
        _require()
    return mpu.get_tensor_model_parallel_group(check_initialized=check_initialized)


def get_tensor_sequence_parallel_world_size() -> int:
    _require()
    return mpu.get_tensor_model_parallel_world_size()


def get_tensor_sequence_parallel_rank() -> int:
    _require()
    return mpu.get_tensor_model_parallel_rank()


def get_tensor_sequence_parallel_src_rank() -> int:
    _require()
    return mpu.get_tensor_model_parallel_src_rank()


def get_tensor_sequence_and_context_parallel_group():
    """The sequence group of TSP x CP: megatron-core's tensor-and-context-parallel group (D*C
    ranks, rank = cp_rank * D + tsp_rank; ``TSPLayout.sequence_rank``). Without CP it is the TSP
    group itself."""
    _require()
    if mpu.get_context_parallel_world_size() == 1:
        return get_tensor_sequence_parallel_group()
    return mpu.get_tensor_and_context_parallel_group()


def resolve_sequence_group(tsp_group, pg_collection=None):
    """The sequence group of a layer whose TSP group is ``tsp_group``: ``pg_collection.tp_cp``
    (or the global tensor-and-context-parallel group) when context parallelism is on, else
    ``tsp_group``."""
    cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if cp is None:
        cp = mpu.get_context_parallel_group(check_initialized=False)
    if cp is None or dist.get_world_size(cp) == 1:
        return tsp_group
    group = getattr(pg_collection, "tp_cp", None) if pg_collection is not None else None
    return group if group is not None else mpu.get_tensor_and_context_parallel_group()


def resolve_group(pg_collection=None, tp_group=None):
    """The TSP group for a layer: explicit ``tp_group``, ``pg_collection.tp``, or the global one."""
    if tp_group is not None:
        return tp_group
    if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
        return pg_collection.tp
    group = mpu.get_tensor_model_parallel_group(check_initialized=False)
    if group is None:
        raise RuntimeError(
            "TSP layer built without a process group: pass pg_collection/tp_group or call "
            "megatron_tsp.initialize_model_parallel(tensor_sequence_parallel_size=D)"
        )
    return group
