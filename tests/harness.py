"""A pool of gloo ranks, spawned once and reused by many checks.

Process start-up (torch + megatron import) costs seconds per rank, so a test module starts one
``RankPool`` and sends it check functions: ``pool.run(fn, *args)`` calls ``fn(*args)`` on every
rank and returns the per-rank results, raising with every rank's traceback if any rank failed
and killing the pool if the ranks do not answer within the timeout (a hang is a failure).

Late completion (``tests/late_completion.py``): ``pool.run(fn, ..., late_completion=True)`` runs
one check with the asynchronous transfers of ``megatron_tsp.core.comm`` completing as late as on a
GPU (send buffers read at ``wait()``, receive buffers garbage until then); a pool created with
``late_completion=True``, or any pool when ``TSP_TEST_LATE_COMPLETION=1``, runs every check that
way unless the call says ``late_completion=False``.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Optional

import torch.multiprocessing as mp

from megatron_tsp.megatron_lm.cpu_runner import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def init_gloo_rank(rank: int, world: int, port: int, timeout_s: float = 90) -> None:
    """Start one CPU rank: repo on sys.path, one thread, gloo on loopback, megatron CPU shims."""
    sys.path.insert(0, REPO)
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # see tests/conftest.py
    import torch

    from megatron_tsp.megatron_lm.cpu_support import enable_cpu_support
    from megatron_tsp.tools.cpu_ranks import init_gloo_rank as start_gloo

    torch._dynamo.config.disable = True
    start_gloo(rank, world, port, timeout_s)

    enable_cpu_support()


def _worker(rank: int, world: int, port: int, inbox, outbox) -> None:
    init_gloo_rank(rank, world, port)
    import torch.distributed as dist

    outbox.put((rank, "ready", None))
    while True:
        task = inbox.get()
        if task is None:
            break
        module, name, args, kwargs, late = task
        try:
            from tests.late_completion import maybe_enabled

            fn = getattr(importlib.import_module(module), name)
            with maybe_enabled(late):
                result = fn(*args, **kwargs)
            outbox.put((rank, "ok", result))
        except BaseException:  # report everything, keep serving
            outbox.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(
        self, world: int, start_timeout: float = 180.0, late_completion: Optional[bool] = None
    ):
        from tests.late_completion import env_enabled

        ctx = mp.get_context("spawn")
        self.world = world
        self.late_completion = env_enabled() if late_completion is None else late_completion
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_worker, args=(r, world, port, self.inboxes[r], self.outbox), daemon=True
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self._collect("ready", start_timeout)

    def _collect(self, expect: str, timeout: float):
        import queue

        results, errors = [None] * self.world, []
        for _ in range(self.world):
            try:
                rank, status, value = self.outbox.get(timeout=timeout)
            except queue.Empty:
                self.close(kill=True)
                raise TimeoutError(f"ranks did not answer within {timeout:.0f} s (hang?)")
            if status == "error":
                errors.append(f"--- rank {rank} ---\n{value}")
            results[rank] = value
        if errors:
            raise AssertionError("check failed on some ranks:\n" + "\n".join(errors))
        return results

    def run(
        self, fn, *args, timeout: float = 300.0, late_completion: Optional[bool] = None, **kwargs
    ):
        """``fn(*args, **kwargs)`` on every rank; ``late_completion``: None = the pool's mode."""
        if not self.alive:
            raise RuntimeError("the rank pool is dead (an earlier check hung or crashed)")
        late = self.late_completion if late_completion is None else late_completion
        for q in self.inboxes:
            q.put((fn.__module__, fn.__name__, args, kwargs, late))
        return self._collect("ok", timeout)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.inboxes:
                q.put(None)
            for p in self.procs:
                p.join(timeout=3)
        for p in self.procs:
            if p.is_alive():
                p.kill()
