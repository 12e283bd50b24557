"""``megatron-tsp memory``: peak memory (and FLOPs, communication) of one rank, measured.

Runs one rank of the real model code for a full training step (forward, backward, gradient
finalisation, optimizer step) under ``FakeTensorMode`` with torch's ``fake`` process group, and
reports torch ``MemTracker``'s peak by category. See ``megatron_tsp/tools/estimator/fake_run.py``
for what is allocated and ``docs/memory.md`` for the assumptions and the 7B table.

Examples::

    megatron-tsp memory --scheme tsp --tp 8 --seq 131072              # one rank of 7B, D=8
    megatron-tsp memory --scheme tp_cp --tp 4 --cp 2 --seq 131072 --recompute full
    megatron-tsp memory --scheme hybrid --tp 8 --seq 131072         # TP+SP attention + TSP MLP
    megatron-tsp memory --scheme fsdp_cp --tp 1 --cp 8 --seq 131072   # FSDP2 ZeRO-3 x CP8
    megatron-tsp memory --scheme fsdp_cp --tp 1 --cp 8 --seq 131072 --cp-comm-type p2p  # TE ring
    megatron-tsp memory --table                                        # the paper's 7B table
    megatron-tsp memory --validate --model small --scheme tp_sp --tp 4 --world-size 4 --seq 2048
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Optional, Sequence

from megatron_tsp.console.args import (
    ToolParser,
    UsageError,
    from_value_error,
    non_negative_float,
    positive_int,
    positive_int_list,
)

from .strategies import RECOMPUTE_FC1_HELP

# The paper's per-GPU peaks (GB), 7B, one 8-GPU node, training. The two "TP x SP" 2-D layouts
# are listed beside our TP4xCP2 and TP2xCP4 runs (the paper does not name their split).
PAPER_GB = {
    ("tsp", 8, 1, 16384): 31.0,
    ("tp", 8, 1, 16384): 31.5,
    ("tsp", 8, 1, 131072): 38.8,
    ("tp", 8, 1, 131072): 70.0,
    ("tp_cp", 4, 2, 131072): 85.0,
    ("tp_cp", 2, 4, 131072): 140.0,
}

TABLE_LAYOUTS = [
    ("tsp", 8, 1),
    ("tp", 8, 1),
    ("tp_sp", 8, 1),
    ("hybrid", 8, 1),
    ("tp_cp", 4, 2),
    ("tp_cp", 2, 4),
]
# MoE models: TSP with the experts folded (EP = D, alltoall) and on the TSP expert ring, and the
# TP+SP baseline with the same expert layout as the folded row
MOE_TABLE_LAYOUTS = [("tsp", 8, 1), ("tsp", 8, 1), ("tp_sp", 8, 1)]
CATEGORIES = [
    ("Parameter", "params"),
    ("Gradient", "grads"),
    ("Optstate", "optim"),
    ("Activation", "activ"),
    ("Temp", "temp"),
]


def build_parser() -> argparse.ArgumentParser:
    p = ToolParser(
        prog="megatron-tsp memory",
        description="Measure one rank's peak memory, FLOPs and communication for a full training "
        "step with fake tensors (no GPU needed).",
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default="7b",
        help="model name (megatron_tsp/models: 7b, llama3-8b, small, tiny, ...) or a "
        "model .json; the flags below change single fields",
    )
    m.add_argument("--hidden-size", type=positive_int)
    m.add_argument("--num-layers", type=positive_int)
    m.add_argument("--num-attention-heads", type=positive_int)
    m.add_argument("--num-query-groups", type=positive_int)
    m.add_argument("--ffn-hidden-size", type=positive_int)
    m.add_argument("--vocab-size", type=positive_int, help="before Megatron's padding (7b: 32000)")
    m.add_argument("--swiglu", action="store_true", help="gated fc1 (SwiGLU) instead of GELU")
    m.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"])
    m.add_argument(
        "--tie-embeddings",
        action="store_true",
        help="share embedding and output weights (default: untied)",
    )
    r = p.add_argument_group("run")
    r.add_argument(
        "--scheme",
        choices=["tsp", "tp", "tp_sp", "hybrid", "tp_cp", "fsdp_cp"],
        default="tsp",
        help="tsp (TSP, D=--tp), tp (Megatron TP), tp_sp (TP + sequence parallel), "
        "hybrid (TP + SP attention with the TSP MLP ring, --tsp-mlp), "
        "tp_cp (TP x CP with SP), fsdp_cp (torch FSDP2 ZeRO-3 x CP over the whole group, "
        "K/V all-gathered: --tp 1 --cp N --world-size N)",
    )
    r.add_argument(
        "--cp-comm-type",
        choices=["all_gather", "p2p"],
        default="all_gather",
        help="--scheme tp_cp / fsdp_cp: TE's CP K/V exchange stood in: all_gather (K/V "
        "all-gathered, dK/dV reduce-scattered) or p2p (TE's default ring: K/V blocks of S/N "
        "tokens passed around the CP group, dK/dV with them in backward)",
    )
    r.add_argument("--tp", type=positive_int, default=8, help="TP size, or the TSP group size D")
    r.add_argument("--cp", type=positive_int, default=1)
    r.add_argument("--world-size", type=positive_int, default=8)
    r.add_argument("--seq", type=positive_int, default=16384, help="sequence length")
    r.add_argument("--micro-batch", type=positive_int, default=1)
    r.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    r.add_argument(
        "--recompute",
        choices=["none", "full"],
        default="none",
        help="full = Megatron recompute_granularity=full, method=uniform, 1 layer",
    )
    r.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="shard fp32 master weights and Adam state over data parallelism",
    )
    r.add_argument(
        "--tsp-attention-backward",
        choices=["saved", "recompute"],
        help="TSP attention: keep per-head-group q/k/v, out, lse (saved, the layer "
        "default) or only the input and recompute (lowest memory)",
    )
    r.add_argument(
        "--tsp-recompute-fc1",
        action="store_true",
        help=RECOMPUTE_FC1_HELP,
    )
    r.add_argument(
        "--tsp-kv-grad-reduce-in-fp32",
        action="store_true",
        help="TSP attention: reduce-scatter dK/dV in fp32 instead of the compute dtype "
        "(Megatron-LM's --tsp-kv-grad-reduce-in-fp32)",
    )
    r.add_argument(
        "--tsp-kv-grad-all-to-all",
        action="store_true",
        help="TSP attention: sum dK/dV with an all-to-all and an fp32 add at the owner instead "
        "of the reduce-scatter (Megatron-LM's --tsp-kv-grad-all-to-all)",
    )
    r.add_argument(
        "--tsp-activation-sums-in-fp32",
        action="store_true",
        help="TSP / hybrid: sum the MLP output and the input gradients over the weight shards "
        "in fp32 instead of in place in the compute dtype (Megatron-LM's "
        "--tsp-activation-sums-in-fp32)",
    )
    r.add_argument(
        "--tsp-vocab-ring",
        choices=("auto", "always", "never"),
        default="auto",
        help="TSP: the loss on the vocabulary ring where it receives fewer bytes than Megatron's "
        "output layer (auto), always or never (Megatron-LM's --tsp-vocab-ring)",
    )
    e = p.add_argument_group("mixture of experts (models with num_experts)")
    e.add_argument(
        "--moe-schedule",
        choices=("folded", "ring"),
        default="folded",
        help="TSP: experts whole on the expert-model-parallel ranks, folded onto the TSP axis "
        "(folded), or the TSP expert ring (ring, Megatron-LM's --tsp-moe-ring)",
    )
    e.add_argument(
        "--moe-token-dispatcher-type",
        choices=("allgather", "alltoall"),
        default="alltoall",
        help="megatron-core's token dispatcher of the folded layout (Megatron-LM's flag)",
    )
    e.add_argument(
        "--expert-model-parallel-size",
        type=positive_int,
        help="EP (default: the TSP / TP group size for folded, 1 for ring)",
    )
    r.add_argument(
        "--table-tsp-variants",
        action="store_true",
        help="--table: also TSP with attention recompute",
    )
    r.add_argument(
        "--real",
        action="store_true",
        help="real tensors (small shapes only); also reports the CPU allocator's peak",
    )
    r.add_argument(
        "--validate",
        action="store_true",
        help="run fake and real for the same configuration and compare the peaks",
    )
    r.add_argument(
        "--tolerance", type=non_negative_float, default=0.10, help="--validate: allowed rel. error"
    )
    r.add_argument(
        "--table",
        action="store_true",
        help="the 7B table: TSP D=8, TP=8, TP=8+SP, TP=8+SP+TSP-MLP, TP4xCP2, TP2xCP4 at --seqs; "
        "for an MoE model: TSP D=8 folded (EP 8, alltoall), TSP D=8 expert ring, TP=8+SP with "
        "EP 8 (alltoall)",
    )
    r.add_argument(
        "--seqs", type=positive_int_list, default="16384,131072", help="--table: sequence lengths"
    )
    r.add_argument("--no-flops", action="store_true")
    r.add_argument("--no-comm", action="store_true")
    o = p.add_argument_group("output")
    o.add_argument("--units", choices=["GB", "GiB"], default="GB", help="GB = 1e9 bytes")
    o.add_argument("--json", help="write the results to this file")
    o.add_argument("--quiet", action="store_true")
    p.add_check(check_args)
    return p


def check_args(args) -> None:
    """The model and the layout the run would measure, before any fake tensor: each
    configuration ``main`` runs (``--table``: the table's rows) must validate."""
    from megatron_tsp.core.rejections import TSPRejection

    if args.table:  # the table's layouts are fixed; its model must load
        _model(args)
        return
    try:
        _config(args, args.scheme, args.tp, args.cp, args.seq).validate()
    except TSPRejection as exc:  # the table's rows name Megatron's flag: here it is --tp
        raise from_value_error(exc, f"--tp {args.tp}") from exc
    except ValueError as exc:
        raise from_value_error(exc) from exc


def _model(args):
    from megatron_tsp.core.model_shape import load_model

    changes = {
        k: v
        for k, v in dict(
            hidden=args.hidden_size,
            num_layers=args.num_layers,
            heads=args.num_attention_heads,
            query_groups=args.num_query_groups,
            ffn=args.ffn_hidden_size,
            vocab=args.vocab_size,
            normalization=args.normalization,
        ).items()
        if v is not None
    }
    if args.swiglu:
        changes["gated"] = True
    if args.tie_embeddings:
        changes["tied_embeddings"] = True
    try:
        return load_model(args.model, **changes)
    except ValueError as exc:
        raise UsageError(f"--model {args.model}", str(exc)) from exc


def _config(args, scheme, tp, cp, seq, fake=True):
    from megatron_tsp.tools.estimator.fake_run import RunConfig

    return RunConfig(
        scheme=scheme,
        model=_model(args),
        world_size=args.world_size,
        tp=tp,
        cp=cp,
        seq=seq,
        micro_batch=args.micro_batch,
        dtype=args.dtype,
        recompute=args.recompute,
        distributed_optimizer=args.distributed_optimizer,
        fake=fake,
        count_flops=not args.no_flops,
        count_comm=not args.no_comm,
        tsp_attention_backward=(args.tsp_attention_backward if scheme == "tsp" else None),
        tsp_mlp_recompute_activation=(
            True if args.tsp_recompute_fc1 and scheme in ("tsp", "hybrid") else None
        ),
        tsp_kv_grad_fp32=(True if args.tsp_kv_grad_reduce_in_fp32 and scheme == "tsp" else None),
        tsp_kv_grad_a2a=bool(args.tsp_kv_grad_all_to_all and scheme == "tsp"),
        tsp_activation_sums_fp32=bool(
            args.tsp_activation_sums_in_fp32 and scheme in ("tsp", "hybrid")
        ),
        tsp_vocab_ring=args.tsp_vocab_ring,
        moe_schedule=args.moe_schedule if scheme == "tsp" else "folded",
        moe_dispatcher=args.moe_token_dispatcher_type,
        ep=args.expert_model_parallel_size,
        # --table's layouts are fixed (TE's all-gather for its TP x CP rows)
        cp_comm_type="all_gather" if args.table else args.cp_comm_type,
    )


def format_table(results, units: str = "GB", paper: bool = True, labels: Sequence[str] = ()) -> str:
    """The table of ``results``; ``labels``: more layout labels the column must fit (a table
    printed row by row under one header)."""
    div = 1e9 if units == "GB" else 2**30
    width = max([16] + [len(x) + 1 for x in [r.label for r in results] + list(labels)])
    head = (
        f"{'layout':<{width}}{'S':>8}{'rec':>5}"
        + "".join(f"{c:>8}" for _, c in CATEGORIES)
        + f"{'peak':>8}{'at':>10}"
        + (f"{'paper':>7}" if paper else "")
        + f"{'GEMM TF':>9}{'attn TF':>9}{'comm GB':>9}{'time s':>8}"
    )
    lines = [
        f"peak memory per rank in {units}; FLOPs = per rank per step (TFLOP = 1e12); "
        "comm = bytes received per rank per step",
        head,
        "-" * len(head),
    ]
    for r in results:
        c = r.config
        row = f"{r.label:<{width}}{c['seq']:>8}{c['recompute'][:4]:>5}"
        row += "".join(f"{r.peak_breakdown.get(k, 0) / div:>8.2f}" for k, _ in CATEGORIES)
        row += f"{r.peak_bytes / div:>8.2f}{r.peak_phase:>10}"
        if paper:
            ref = PAPER_GB.get((c["scheme"], c["tp"], c["cp"], c["seq"]))
            known = ref is not None and c["model"]["hidden"] == 4096
            row += f"{ref:>7.1f}" if known else f"{'-':>7}"
        fl = r.flops or {}
        row += f"{fl.get('matmul', 0) / 1e12:>9.1f}{fl.get('attention', 0) / 1e12:>9.1f}"
        comm = sum(v for k, v in (r.comm or {}).items() if k.startswith("recv_bytes"))
        row += f"{comm / 1e9:>9.2f}{r.wall_s:>8.0f}"
        if r.real_peak_bytes:
            row += f"   real allocator peak {r.real_peak_bytes / div:.4f}"
        lines.append(row)
    return "\n".join(lines)


def _table_configs(args) -> list:
    """The ``--table`` rows' configurations, in the order they are measured."""
    moe = _model(args).is_moe
    out = []
    for seq in args.seqs:
        layouts = list(MOE_TABLE_LAYOUTS if moe else TABLE_LAYOUTS)
        variants = [None] * len(layouts)
        if moe:  # the ring is the second TSP row
            variants = [None, "ring", None]
        if args.table_tsp_variants and not moe:
            layouts.insert(1, ("tsp", 8, 1))
            variants.insert(1, "recompute")
        for (scheme, tp, cp), variant in zip(layouts, variants):
            cfg = _config(args, scheme, tp, cp, seq)
            if variant == "ring":
                cfg.moe_schedule, cfg.ep = "ring", None
            elif variant is not None:
                cfg.tsp_attention_backward = variant
            out.append(cfg)
    return out


def _teardown() -> None:
    """Destroy the fake groups explicitly: interpreter shutdown with them alive can be slow."""
    import torch.distributed as dist

    from megatron_tsp.core import parallel_state as tsp_ps

    try:
        tsp_ps.destroy_model_parallel()
    except Exception:  # pragma: no cover - nothing was initialised
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_tsp.tools.estimator import fake_run

    results = []
    status = 0
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    # progress on stderr, one line per configuration and stage (a 7B step takes ~30 s)
    progress = (
        (lambda *a: None)
        if args.quiet
        else (lambda *a: print("megatron-tsp memory:", *a, file=sys.stderr, flush=True))
    )
    paper = args.model == "7b"
    try:
        if args.table:
            configs = _table_configs(args)
            labels = [cfg.label for cfg in configs]
            say(format_table([], args.units, paper=paper, labels=labels))  # the header, once
            for i, cfg in enumerate(configs, 1):
                progress(
                    f"[{i}/{len(configs)}] {cfg.label} S={cfg.seq} recompute={cfg.recompute} ..."
                )
                # one fresh process per configuration: no cache shared between runs
                results.append(fake_run.run_step_isolated(cfg))
                row = format_table(results[-1:], args.units, paper=paper, labels=labels)
                say(row.splitlines()[-1])
        elif args.validate:
            cfg = _config(args, args.scheme, args.tp, args.cp, args.seq, fake=True)
            progress(f"{cfg.label} S={args.seq}: fake-tensor step ...")
            fake = fake_run.run_step(cfg)
            progress(f"{cfg.label} S={args.seq}: real-tensor step (fresh process) ...")
            real = fake_run.run_step_isolated(
                _config(args, args.scheme, args.tp, args.cp, args.seq, fake=False)
            )
            results = [fake, real]
            err = abs(fake.peak_bytes - real.real_peak_bytes) / real.real_peak_bytes
            ok = err <= args.tolerance
            status = 0 if ok else 1
            say(
                f"fake-tensor MemTracker peak {fake.peak_bytes} B, real-tensor run's CPU-allocator "
                f"peak {real.real_peak_bytes} B: "
                f"rel. error {err:.2%} -> {'OK' if ok else 'FAIL'} "
                f"(tolerance {args.tolerance:.0%})"
            )
        elif args.real:
            cfg = _config(args, args.scheme, args.tp, args.cp, args.seq, fake=False)
            progress(f"{cfg.label} S={args.seq}: real-tensor step (fresh process) ...")
            results.append(fake_run.run_step_isolated(cfg))
        else:
            cfg = _config(args, args.scheme, args.tp, args.cp, args.seq)
            progress(f"{cfg.label} S={args.seq}: one training step under fake tensors ...")
            results.append(fake_run.run_step(cfg))
    finally:
        _teardown()
    if not args.table:  # the table's header and rows are out already
        say(format_table(results, args.units, paper=paper))
    model = _model(args)
    if model.is_moe:
        from megatron_tsp.tools.estimator.moe import ring_crossover_seq

        say(
            f"MoE: the expert ring receives fewer bytes than the alltoall dispatcher (EP = D = "
            f"{args.tp}, uniform routing) from S = "
            f"{ring_crossover_seq(model, args.tp, args.micro_batch):,.0f} tokens per micro-batch "
            f"of {args.micro_batch}; token dispatch here is the uniform-routing expectation"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1, default=str)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
