import os
import secrets
import sys

import pytest

# Megatron's fusions (on by default, as in Megatron-LM) are torch.compile'd functions; compiling
# them on CPU takes minutes and changes nothing numerically, so the suite runs them eagerly. Set
# before torch is imported: the rank pool and the subprocesses inherit it.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: full-scale checks (still run in CI)")


_pools = {}


@pytest.fixture
def pool4():
    """Four gloo ranks shared by the distributed tests of the session; restarted if a previous
    check killed it (a hang is reported by that check, not by every later one)."""
    from tests.harness import RankPool

    pool = _pools.get(4)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.close(kill=True)
        pool = _pools[4] = RankPool(4)
    return pool


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()


@pytest.fixture
def seed():
    """A fresh seed per test run (printed on failure) so inputs differ every run."""
    value = secrets.randbelow(2**31)
    print(f"seed={value}")
    return value
