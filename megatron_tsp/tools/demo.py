"""Main job on the embedded default: train a small GPT under TSP and under Megatron TP+SP.

``python -m megatron_tsp.tools.demo`` spawns 4 gloo ranks on this machine (CPU), builds the same GPT
twice from the same initial weights — once with Megatron's stock layers at TP=D +
sequence-parallel, once with the TSP layers at D — and trains both side by side on a generated
corpus. Every step prints both losses (they must agree), tokens/s and bytes communicated; the end
prints communication per step by operation kind. Exit status 1 if the losses disagree.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron_tsp.console.args import (
    ToolParser,
    from_value_error,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from megatron_tsp.megatron_lm.cpu_runner import free_port
from megatron_tsp.tools.cpu_ranks import init_gloo_rank, style_fields, unfused_config

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = ToolParser(prog="megatron-tsp demo", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=positive_int, default=4, help="gloo ranks to spawn")
    p.add_argument(
        "--tensor-sequence-parallel-size", "--tsp", dest="d", type=positive_int, default=4
    )
    p.add_argument("--steps", type=positive_int, default=30)
    p.add_argument("--seq-length", type=positive_int, default=256)
    p.add_argument("--micro-batch-size", type=positive_int, default=4)
    p.add_argument("--num-layers", type=positive_int, default=2)
    p.add_argument("--hidden-size", type=positive_int, default=128)
    p.add_argument("--num-attention-heads", type=positive_int, default=8)
    p.add_argument("--num-query-groups", type=positive_int, default=4)
    p.add_argument("--ffn-hidden-size", type=positive_int, default=256)
    p.add_argument(
        "--style",
        choices=["llama", "gpt2"],
        default="llama",
        help="llama: RMSNorm+SwiGLU+RoPE+GQA; gpt2: LayerNorm+GELU+learned positions",
    )
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    p.add_argument("--seed", type=non_negative_int, default=1234)
    p.add_argument(
        "--tolerance",
        type=non_negative_float,
        default=None,
        help="max relative loss difference (default 1e-5 fp64, 1e-3 fp32: "
        "Megatron's vocab-parallel cross-entropy computes in fp32, so the two "
        "runs' losses and gradients agree to fp32 rounding, which Adam carries "
        "across steps)",
    )
    p.add_check(check_args)
    return p.parse_args(argv)


def check_args(args) -> None:
    """The layout and the model shape must split over D before a rank is spawned (the
    validation module's messages name the flags and the numbers)."""
    from megatron_tsp.core.validation import check_model_shape, check_parallel_layout
    from megatron_tsp.tools.data import VOCAB_SIZE

    try:
        check_parallel_layout(args.world_size, args.d)
    except ValueError as exc:
        raise from_value_error(exc, f"--world-size {args.world_size}") from exc
    llama = args.style == "llama"
    check_model_shape(
        args.d,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if llama else None,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=VOCAB_SIZE,
        seq_length=args.seq_length,
        hidden_size=args.hidden_size,
    )


def _config(args):
    llama = args.style == "llama"
    return unfused_config(
        args.d,
        DTYPES[args.dtype],
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if llama else args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        **style_fields(args.style),
    )


def _build(args, config, spec):
    from megatron.core.models.gpt import GPTModel

    from megatron_tsp.tools.data import VOCAB_SIZE

    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB_SIZE,
        max_sequence_length=args.seq_length,
        position_embedding_type="rope" if args.style == "llama" else "learned_absolute",
        share_embeddings_and_output_weights=False,
    )


def _train_step(model, optimizer, batch, tp_group, dp_group):
    from megatron_tsp.core.sharding import allreduce_sequence_parallel_grads

    optimizer.zero_grad(set_to_none=True)
    losses = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    mask = batch["loss_mask"].to(losses.dtype)
    loss = (losses * mask).sum() / mask.sum()
    loss.backward()
    allreduce_sequence_parallel_grads(model, tp_group)
    dp = dist.get_world_size(dp_group)
    if dp > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=dp_group)
                p.grad.div_(dp)
    optimizer.step()
    dist.all_reduce(loss, group=dp_group)
    return loss.item() / dp


VARIANTS = ("tsp", "tp_sp")


def _init_groups(rank: int, args):
    """TSP groups of size D (Megatron's tensor-parallel groups) and the seeded RNG; a bad layout
    is printed by rank 0 and ends the rank with exit code 2."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tsp.core import parallel_state
    from megatron_tsp.megatron_lm.cpu_support import enable_cpu_support

    enable_cpu_support()
    try:
        parallel_state.initialize_model_parallel(
            tensor_sequence_parallel_size=args.d, create_gloo_process_groups=False
        )
    except ValueError as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        dist.destroy_process_group()
        sys.exit(2)
    model_parallel_cuda_manual_seed(args.seed)
    return mpu.get_tensor_model_parallel_group(), mpu.get_data_parallel_group()


def _build_models(args) -> Dict[str, torch.nn.Module]:
    """The TP=D + SP model and the TSP model with the same initial weights: Megatron initialises
    the TP+SP one, the TSP one loads its state_dict (same names and shards)."""
    from megatron_tsp.core.model import build_tsp_gpt_model
    from megatron_tsp.core.specs import get_gpt_block_local_sp_spec
    from megatron_tsp.tools.data import VOCAB_SIZE

    config = _config(args)
    tp_model = _build(args, config, get_gpt_block_local_sp_spec(config))
    tsp_model = build_tsp_gpt_model(
        config,
        vocab_size=VOCAB_SIZE,
        max_sequence_length=args.seq_length,
        position_embedding_type="rope" if args.style == "llama" else "learned_absolute",
        share_embeddings_and_output_weights=False,
    )
    tsp_model.load_state_dict(tp_model.state_dict(), strict=True)
    return {"tsp": tsp_model, "tp_sp": tp_model}


def _print_header(args, models, dp_size: int) -> None:
    n_params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    print(
        f"megatron-tsp demo: {args.world_size} gloo ranks, D={args.d}, "
        f"DP={dp_size}, {args.style}-style GPT "
        f"(h={args.hidden_size}, layers={args.num_layers}, heads={args.num_attention_heads}"
        f", seq={args.seq_length}, micro-batch={args.micro_batch_size}, {args.dtype}); "
        f"params per rank: TSP {n_params['tsp']:,}, TP+SP {n_params['tp_sp']:,}",
        flush=True,
    )


def _print_step(args, step: int, row, tokens_per_step: int) -> None:
    (l1, t1, b1), (l2, t2, b2) = row["tsp"], row["tp_sp"]
    print(
        f"step {step:3d}/{args.steps} | loss TSP {l1:.6f}  TP+SP {l2:.6f}  "
        f"|diff| {abs(l1 - l2):.1e} | tok/s TSP {tokens_per_step / t1:8.0f}  "
        f"TP+SP {tokens_per_step / t2:8.0f} | recv MB/rank TSP {b1 / 2**20:.2f}  "
        f"TP+SP {b2 / 2**20:.2f}",
        flush=True,
    )


def _timed_step(name, models, opts, inputs, comm, tp_group, dp_group):
    """One training step of variant ``name``: (loss, seconds, bytes this rank received)."""
    before = len(comm[name].records)
    dist.barrier(group=tp_group)
    start = time.perf_counter()
    with comm[name]:
        loss = _train_step(models[name], opts[name], inputs[name], tp_group, dp_group)
    elapsed = time.perf_counter() - start
    return loss, elapsed, sum(r.recv_bytes for r in comm[name].records[before:])


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    init_gloo_rank(rank, args.world_size, port, timeout_s=120)
    from megatron.core import parallel_state as mpu

    from megatron_tsp.core import parallel_state, zigzag
    from megatron_tsp.tools.comm_counter import CommCounter
    from megatron_tsp.tools.data import batches

    tp_group, dp_group = _init_groups(rank, args)
    models = _build_models(args)
    opts = {
        name: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.0)
        for name, m in models.items()
    }
    dp_size = mpu.get_data_parallel_world_size()
    data = batches(
        args.micro_batch_size, args.seq_length, seed=args.seed + mpu.get_data_parallel_rank()
    )
    tokens_per_step = args.micro_batch_size * args.seq_length * dp_size
    history: Dict[str, List] = {name: [] for name in VARIANTS}
    comm = {name: CommCounter() for name in VARIANTS}
    if rank == 0:
        _print_header(args, models, dp_size)
    for step in range(1, args.steps + 1):
        batch = next(data)
        inputs = {"tsp": zigzag.get_batch_on_this_tsp_rank(batch, args.d), "tp_sp": batch}
        # Alternate which variant runs first so neither always gets the warmer caches.
        row = {
            name: _timed_step(name, models, opts, inputs, comm, tp_group, dp_group)
            for name in (VARIANTS if step % 2 else VARIANTS[::-1])
        }
        for name in VARIANTS:
            history[name].append(row[name])
        if rank == 0:
            _print_step(args, step, row, tokens_per_step)
    if rank == 0:
        _summary(args, history, comm, tokens_per_step)
    ok = _agree(args, history)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


def _tolerance(args) -> float:
    if args.tolerance is not None:
        return args.tolerance
    return 1e-5 if args.dtype == "float64" else 1e-3


def _agree(args, history) -> bool:
    worst = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(history["tsp"], history["tp_sp"]))
    return worst <= _tolerance(args)


def _summary(args, history, comm, tokens_per_step) -> None:
    import statistics

    steps = len(history["tsp"])
    worst = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(history["tsp"], history["tp_sp"]))
    first, last = history["tsp"][0][0], history["tsp"][-1][0]
    med = {k: statistics.median(t for _, t, _ in v[1:] or v) for k, v in history.items()}
    print(
        f"\nloss fell {first:.4f} -> {last:.4f}; max relative |TSP - TP+SP| = {worst:.2e} "
        f"(tolerance {_tolerance(args):.0e}): {'AGREE' if worst <= _tolerance(args) else 'DIFFER'}"
    )
    print(
        f"median step time: TSP {med['tsp'] * 1e3:.1f} ms, TP+SP {med['tp_sp'] * 1e3:.1f} ms, "
        f"tokens/s ratio TSP/TP+SP = {med['tp_sp'] / med['tsp']:.2f} "
        f"(gloo on CPU: says nothing about GPUs)"
    )
    print("\ncommunication per step per rank (rank 0), by operation:")
    print(f"{'op':<24}{'TSP calls':>10}{'TSP recv MB':>13}{'TP+SP calls':>13}{'TP+SP recv MB':>15}")
    ops = sorted(set(comm["tsp"].by_op()) | set(comm["tp_sp"].by_op()))
    totals = {"tsp": 0.0, "tp_sp": 0.0}
    for op in ops:
        cells = []
        for name in ("tsp", "tp_sp"):
            e = comm[name].by_op().get(op, {"calls": 0, "recv": 0.0})
            cells.append((e["calls"] / steps, e["recv"] / steps / 2**20))
            totals[name] += e["recv"] / steps / 2**20
        print(
            f"{op:<24}{cells[0][0]:>10.0f}{cells[0][1]:>13.3f}{cells[1][0]:>13.0f}{cells[1][1]:>15.3f}"
        )
    print(f"{'total':<24}{'':>10}{totals['tsp']:>13.3f}{'':>13}{totals['tp_sp']:>15.3f}")


def main(argv=None) -> int:
    args = parse_args(argv)  # every input checked, before any rank is spawned
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        _worker, args=(args, free_port()), nprocs=args.world_size, join=False, start_method="spawn"
    )
    try:
        while not ctx.join():
            pass
    except mp.ProcessExitedException as exc:
        return exc.exit_code if exc.exit_code else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
