"""The fake-tensor memory tests' module teardown: the fake world and the tool's caches go, and CPU
support is switched off again if the module switched it on (``run_step`` enables it)."""

import pytest


@pytest.fixture(scope="module", autouse=True)
def _fake_world_teardown():
    from megatron_tsp.megatron_lm import cpu_support

    was_enabled = cpu_support.is_enabled()
    yield
    from megatron_tsp.tools.estimator.memory import _teardown

    _teardown()
    if not was_enabled:
        cpu_support.disable_cpu_support()
