"""A pool of gloo ranks, spawned once and reused by many checks.

Process start-up (torch + megatron import) costs seconds per rank, so a test module starts one
``RankPool`` and sends it check functions: ``pool.run(fn, *args)`` calls ``fn(*args)`` on every
rank and returns the per-rank results, raising with every rank's traceback if any rank failed
and killing the pool if the ranks do not answer within the timeout (a hang is a failure).
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

import torch.multiprocessing as mp

from megatron_tsp.tools.cpu_ranks import free_port  # noqa: F401 (tests import it from here)

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
        module, name, args, kwargs = task
        try:
            fn = getattr(importlib.import_module(module), name)
            outbox.put((rank, "ok", fn(*args, **kwargs)))
        except BaseException:  # report everything, keep serving
            outbox.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world: int, start_timeout: float = 180.0):
        ctx = mp.get_context("spawn")
        self.world = world
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

    def run(self, fn, *args, timeout: float = 300.0, **kwargs):
        if not self.alive:
            raise RuntimeError("the rank pool is dead (an earlier check hung or crashed)")
        for q in self.inboxes:
            q.put((fn.__module__, fn.__name__, args, kwargs))
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
