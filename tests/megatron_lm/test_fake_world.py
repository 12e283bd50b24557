"""``megatron_lm.fake_world``: the one-rank world of the dry run and the estimator.

Run in a fresh interpreter: the checks create and replace the default process group, which must
not leak into (or depend on) the other tests of this process.
"""

import os
import subprocess
import sys
import textwrap

from tests.megatron_lm.common import REPO

_CHECKS = textwrap.dedent(
    """
    import os, random, torch, torch.distributed as dist
    from megatron_tsp.megatron_lm.fake_world import destroy_fake_world, init_fake_world

    world, rank = random.choice([(8, 3), (16, 15), (1024, 517)])
    init_fake_world(world, rank)
    group = dist.group.WORLD
    assert (dist.get_backend(), dist.get_world_size(), dist.get_rank()) == ("fake", world, rank)

    # collectives answer at once with their shapes (no peers)
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.shape == (3,)
    sub = dist.new_group(list(range(rank % 2, world, 2)))  # a group this rank belongs to
    assert dist.get_world_size(sub) == world // 2

    init_fake_world(world, rank)  # same world: kept
    assert dist.group.WORLD is group
    init_fake_world(world // 2, 0)  # another world: replaced
    assert (dist.get_world_size(), dist.get_rank()) == (world // 2, 0)

    for bad in [(4, 4), (4, -1)]:
        try:
            init_fake_world(*bad)
        except ValueError as e:
            assert f"rank {bad[1]} is outside a world of 4 ranks" in str(e), e
        else:
            raise AssertionError(f"rank {bad[1]} of 4 accepted")

    destroy_fake_world()
    assert not dist.is_initialized()

    # a real group is never replaced (its peers would hang)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(random.randint(20000, 40000)))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        init_fake_world(8, 0)
    except RuntimeError as e:
        assert "'gloo' process group is already initialised" in str(e), e
    else:
        raise AssertionError("a gloo group was replaced")
    destroy_fake_world()
    assert dist.get_backend() == "gloo"
    dist.destroy_process_group()
    print("FAKE_WORLD_OK", world, rank)
    """
)


def test_fake_world_lifecycle():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run(
        [sys.executable, "-c", _CHECKS], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and "FAKE_WORLD_OK" in run.stdout, run.stdout + run.stderr
