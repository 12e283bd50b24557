"""The CPU runner's pieces that need no Megatron-LM checkout (its real use is in
test_training_loop.py / test_long_sequence_mask.py)."""

import torch

from megatron_tsp.megatron_lm import cpu_runner


def test_nothing_is_applied_on_import():
    assert torch.cuda.is_available() is False or torch.cuda.device_count() > 0
    from megatron_tsp.megatron_lm import patches

    assert not patches.is_active(patches.CPU_RUNNER, "torch.cuda:is_available")
    assert cpu_runner._MODE is None
    assert "fused_weight_gradient_mlp_cuda" not in __import__("sys").modules or not getattr(
        __import__("sys").modules["fused_weight_gradient_mlp_cuda"], "__tsp_cpu_stand_in__", False
    )


def test_every_answer_is_documented():
    targets = [a.target for a in cpu_runner.CUDA_ANSWERS]
    assert len(targets) == len(set(targets))
    for answer in cpu_runner.CUDA_ANSWERS:
        module, attr = answer.target.split(":")
        assert module and attr and len(answer.why) > 8, answer


def test_gradient_accumulation_stand_in_accumulates_in_fp32(seed):
    gen = torch.Generator().manual_seed(seed)
    fused = cpu_runner._fused_weight_gradient_module()
    x = torch.randn(96, 24, generator=gen).bfloat16()
    dy = torch.randn(96, 40, generator=gen).bfloat16()
    start = torch.randn(40, 24, generator=gen)
    main_grad = start.clone()
    fused.wgrad_gemm_accum_fp32(x, dy, main_grad)
    exact = start.double() + dy.double().t() @ x.double()
    assert main_grad.dtype == torch.float32
    err = (main_grad.double() - exact).abs().max() / exact.abs().max()
    assert err < 1e-6, err  # fp32 accumulation of exactly upcast bf16 operands
    # a bf16 product would be off by ~1e-3
    lossy = start.double() + (dy.t() @ x).double()
    assert (lossy - exact).abs().max() / exact.abs().max() > 10 * err


def test_cuda_to_cpu_mode_redirects_device_arguments():
    mode = cpu_runner.CudaToCpuMode()
    with mode:
        t = torch.zeros(3, device="cuda")
        u = torch.tensor([1.0], device=torch.device("cuda", 0)).cuda()
        v = torch.ones(2).to("cuda")
        assert t.device.type == u.device.type == v.device.type == "cpu"
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        assert torch.ones(1).type(torch.float64).dtype == torch.float64


def test_spawned_children_import_the_runner_not_the_script():
    # Megatron's checkpoint writer starts a 'spawn' Manager; its child must not re-run
    # pretrain_gpt.py (as __mp_main__) without the CPU answers.
    def preparation_data(name):
        return {"init_main_from_path": "/x/pretrain_gpt.py", "sys_path": ["/x"], "name": name}

    data = cpu_runner._spawn_children_import_the_runner(preparation_data)("SyncManager")
    assert data == {
        "init_main_from_name": "megatron_tsp.megatron_lm.cpu_runner",
        "sys_path": ["/x"],
        "name": "SyncManager",
    }
    import importlib.util

    assert importlib.util.find_spec(data["init_main_from_name"]) is not None


def test_stage_outputs_pseudo_freed_mid_send_are_held_until_the_next_interleaved_step(seed):
    """Megatron's interleaved schedule pseudo-frees a stage output (``out.data = empty(1)``) right
    after posting its overlapped isend; gloo's send work does not keep the storage, so the runner
    holds it (values intact) until the next interleaved step starts, and only inside that
    schedule (the other schedules wait on their sends before freeing)."""
    from megatron.core.pipeline_parallel import schedules

    deallocate = cpu_runner._hold_sent_output_storage(schedules.deallocate_output_tensor)
    seen = []

    def one_step(output):
        deallocate(output, True)
        assert output.numel() == 1  # Megatron's pseudo-free itself still happens
        seen.append(list(cpu_runner._HELD_STAGE_OUTPUTS))

    step = cpu_runner._release_held_outputs_each_step(one_step)
    gen = torch.Generator().manual_seed(seed)
    first, second = torch.randn(8, 2, 4, generator=gen), torch.randn(8, 2, 4, generator=gen)
    expected = [first.clone(), second.clone()]
    try:
        step(first)
        assert len(seen[0]) == 1 and torch.equal(seen[0][0], expected[0]), seed
        deallocate(torch.randn(3, generator=gen), True)  # outside the interleaved schedule
        assert len(cpu_runner._HELD_STAGE_OUTPUTS) == 1
        step(second)  # releases the previous step's storage, holds this one's
        assert len(seen[1]) == 1 and torch.equal(seen[1][0], expected[1]), seed
    finally:
        cpu_runner._HELD_STAGE_OUTPUTS.clear()


_ONE_RANK_FAILS = """
import os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
failing = int(os.environ["FAILING_RANK"])
if dist.get_rank() == failing:
    time.sleep(1.0)  # the other ranks are already waiting in the barrier
    print("planted failure on rank", failing, flush=True)
    sys.exit(7)
dist.barrier()  # never completes: the failing rank does not arrive
"""


def test_a_failing_rank_is_named_and_the_others_do_not_hang(tmp_path):
    """One rank exits 7 while the other ranks (rank 0 among them) wait for it in a barrier: the
    run must stop the waiting ranks, report exit 7 and name that rank. A runner that waits on rank
    0 first would sit until the timeout and report 124 on rank 0."""
    import random

    nproc = 3
    failing = random.randrange(1, nproc)
    script = tmp_path / "one_rank_fails.py"
    script.write_text(_ONE_RANK_FAILS)
    run = cpu_runner.run_training(
        str(script),
        [],
        nproc=nproc,
        env={"FAILING_RANK": str(failing)},
        stock=True,
        timeout=120,
        check=False,
    )
    assert (run.returncode, run.failed_rank) == (7, failing), (failing, run.log[-3000:])
    assert "planted failure on rank" in run.rank_log(failing)
    try:
        run.check()
    except RuntimeError as e:
        assert f"training run failed (exit 7), rank {failing}:" in str(e)
    else:
        raise AssertionError("check() accepted a failed run")


class _ExitedRank:
    """A rank process as ``_wait_for_ranks`` sees it: ``poll`` answers its exit code, or None
    while it runs (``exits_after`` polls)."""

    def __init__(self, code, exits_after=0):
        self.code, self.polls_left, self.killed = code, exits_after, False

    def poll(self):
        if self.killed:
            return -9
        if self.polls_left > 0:
            self.polls_left -= 1
            return None
        return self.code

    def kill(self):
        self.killed = True


def test_the_rank_that_failed_first_is_named_when_several_are_seen_dead_at_once(tmp_path):
    """The failing rank exits; the ranks waiting for it in a collective fail a few ms later, and
    on a loaded machine the launcher first sees them all dead at once. The earliest failure time
    the ranks noted names the culprit (and its code is the run's), not the lowest rank."""
    import random
    import time

    nproc = 4
    culprit = random.randrange(1, nproc)
    now = time.monotonic()
    paths = []
    for rank in range(nproc):
        path = tmp_path / f"rank{rank}.failed_at"
        path.write_text(repr(now - (1.0 if rank == culprit else 0.99)))
        paths.append(str(path))
    procs = [_ExitedRank(7 if rank == culprit else 1) for rank in range(nproc)]
    assert cpu_runner._wait_for_ranks(procs, 30, paths) == (7, culprit), culprit

    # the culprit noted its failure and is still in its exit handlers when the others are seen
    # dead: the launcher waits for its code
    procs = [_ExitedRank(7, exits_after=3) if r == culprit else _ExitedRank(1) for r in range(4)]
    assert cpu_runner._wait_for_ranks(procs, 30, paths) == (7, culprit), culprit

    # a rank killed by a signal notes nothing: the time it was seen dead stands in
    (tmp_path / f"rank{culprit}.failed_at").unlink()
    procs = [_ExitedRank(-9) if r == culprit else _ExitedRank(1, exits_after=2) for r in range(4)]
    for rank in range(nproc):
        if rank != culprit:
            (tmp_path / f"rank{rank}.failed_at").unlink()
    assert cpu_runner._wait_for_ranks(procs, 30, paths) == (-9, culprit), culprit


_BARRIER = """
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
print("rank", dist.get_rank(), "passed the barrier", flush=True)
"""


def test_a_port_taken_before_rank_0_binds_it_is_retried(tmp_path, monkeypatch):
    """The rendezvous port is probed free, then bound by rank 0's store: another process can take
    it in between (CI saw EADDRINUSE). The run is then relaunched on another port."""
    import socket

    script = tmp_path / "barrier.py"
    script.write_text(_BARRIER)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    probe = cpu_runner.free_port

    def next_port():
        return ports.pop(0) if ports else probe()

    launches = []
    run_once = cpu_runner._run_once

    def recorded(*args):
        launches.append(run_once(*args))
        return launches[-1]

    monkeypatch.setattr(cpu_runner, "free_port", next_port)
    monkeypatch.setattr(cpu_runner, "_run_once", recorded)
    try:
        run = cpu_runner.run_training(str(script), [], nproc=2, stock=True, timeout=120)
    finally:
        taken.close()
    assert [r.returncode != 0 for r in launches] == [True, False], [r.log for r in launches]
    assert "EADDRINUSE" in launches[0].log
    assert "passed the barrier" in run.rank_log(1), run.log[-2000:]
