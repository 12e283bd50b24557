import os
import secrets
import subprocess
import sys

import pytest

# Megatron's fusions (on by default, as in Megatron-LM) are torch.compile'd functions; compiling
# them on CPU takes minutes and changes nothing numerically, so the suite runs them eagerly. Set
# before torch is imported: the rank pool and the subprocesses inherit it.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _unpack_megatron_lm_trees() -> None:
    """The README's test command runs the Megatron-LM tests too: where ``MEGATRON_LM_PATH`` is
    unset and the trees' archives are beside the checkout (``../shared/third_party``, as in CI),
    unpack them as ``.ci/run`` does (``scripts/megatron_lm_sources.sh``) and export the paths
    before any test module reads them. A failing unpack fails the session (no silent skips)."""
    if os.environ.get("MEGATRON_LM_PATH"):
        return
    archives = os.environ.get(
        "MEGATRON_LM_ARCHIVES", os.path.join(ROOT, os.pardir, "shared", "third_party")
    )
    if not os.path.isfile(os.path.join(archives, "Megatron-LM-core_v0.16.1.tar.gz")):
        return
    script = os.path.join(ROOT, "scripts", "megatron_lm_sources.sh")
    done = subprocess.run(
        ["bash", script, sys.executable], capture_output=True, text=True, cwd=ROOT
    )
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed ({done.returncode}):\n{done.stderr}")
    for line in done.stdout.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        if line.startswith("export ") and value:
            os.environ.setdefault(key, value)


_unpack_megatron_lm_trees()


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
