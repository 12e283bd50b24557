"""One rank of a full-size world, without the other ranks: torch's ``fake`` process group.

The dry run (``--tsp-dry-run``) and the estimator (``tools/estimator/fake_run.py``, the memory
tool, ``scripts/gpu_check.py``) build one rank's model at its real world size and parallel layout
in a single process. torch's ``fake`` backend answers every collective at once without peers
(outputs keep their shapes; nothing is sent), so Megatron's ``parallel_state`` can create every
group of a 1,024-rank layout and the layers can post their real communication.
"""

from __future__ import annotations

import torch.distributed as dist


def init_fake_world(world_size: int, rank: int = 0) -> None:
    """Make the default process group a ``fake`` one of ``world_size`` ranks, this one ``rank``.

    Idempotent for the same world; a fake world of another size or rank is replaced. A real
    (non-fake) default group is never replaced: that would strand its peers, so it raises.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} ranks")
    if dist.is_initialized():
        backend = dist.get_backend()
        if backend != "fake":
            raise RuntimeError(
                f"a {backend!r} process group is already initialised in this process; the fake "
                "world (dry run, estimator) needs a process of its own"
            )
        if dist.get_world_size() == world_size and dist.get_rank() == rank:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def destroy_fake_world() -> None:
    """Tear down a fake default group (a real one is left alone)."""
    if dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()
