"""TSP group = Megatron's TP group; accessors; re-initialisation with another D in one process."""

from tests import common


def test_accessors_and_layout(pool4):
    for d in (1, 2, 4):
        results = pool4.run(common.accessors_after_init, d)
        for rank, r in enumerate(results):
            assert r["size"] == r["mpu_size"] == d and r["is_tsp"]
            assert r["mpu_unpatched"], "megatron.core.parallel_state must stay unpatched"
            assert r["rank"] == rank % d
            # TSP is the stride-1 axis: consecutive global ranks, like Megatron's TP
            assert r["group_ranks"] == list(range(rank - rank % d, rank - rank % d + d))
            assert r["dp_size"] == 4 // d


def test_reinitialisation_does_not_leak_groups(pool4):
    """Destroy frees the process groups it created: repeated re-init keeps the thread count flat."""
    first = pool4.run(common.reinit_cycles, 1)
    later = pool4.run(common.reinit_cycles, 6)
    assert all(b <= a + 2 for a, b in zip(first, later)), (first, later)
