import os
import secrets
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: full-scale checks (still run in CI)")


@pytest.fixture(scope="session")
def pool4():
    """Four gloo ranks shared by every distributed test of the session."""
    from tests.harness import RankPool

    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.fixture
def seed():
    """A fresh seed per test run (printed on failure) so inputs differ every run."""
    value = secrets.randbelow(2**31)
    print(f"seed={value}")
    return value
