"""Benchmark TSP against Megatron TP+SP and plain TP: step time and bytes communicated.

``megatron-tsp bench`` (or ``python -m megatron_tsp.tools.bench``) spawns one gloo group per world
size D (default 2 and 4 ranks on this machine's CPUs) and, inside it, builds the same transformer
layer stack (a Megatron ``TransformerBlock``, same initial weights) three times:

* ``tsp``   - the TSP layers (``get_gpt_block_tsp_spec``), D-way weight AND zigzag-token shards;
* ``tp_sp`` - Megatron's stock local layers at TP=D with ``sequence_parallel=True``;
* ``tp``    - the same stock layers at TP=D with ``sequence_parallel=False``.

For every sequence length of the sweep it times fwd+bwd of the stack (loss = mean of squares of
the output, then backward, then the SUM all-reduce of replicated-parameter gradients that
Megatron's ``finalize_model_grads`` does under sequence parallelism), interleaving the variants
step by step with a rotating order, after warm-up steps. The step time of a variant is the
slowest rank's; the table reports medians. Every step runs under a ``CommCounter``: received
bytes per rank, by operation kind and by (block, phase), are compared with the closed forms of
:mod:`megatron_tsp.tools.estimator.formulas`. The three variants compute the same function, so their
losses must agree (exit status 1 otherwise).

gloo over loopback on a few CPU cores measures CPU compute plus Python overhead, not GPU
behaviour: the timing ratios are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_tsp.console.args import (
    ToolParser,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    positive_int_list,
)
from megatron_tsp.core import rejections
from megatron_tsp.megatron_lm.cpu_runner import free_port
from megatron_tsp.tools.cpu_ranks import init_gloo_rank, style_fields, unfused_config

VARIANTS = ("tsp", "tp_sp", "tp")
LABELS = {"tsp": "TSP", "tp_sp": "TP+SP", "tp": "TP"}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
PHASE_KEYS = ("attn_fwd", "attn_bwd", "mlp_fwd", "mlp_bwd", "grad_sync", "other")
MiB = 2.0**20


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------
def _int_list(text: str) -> List[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    p = ToolParser(prog="megatron-tsp bench", description=__doc__.splitlines()[0])
    p.add_argument(
        "--traffic",
        action="store_true",
        help="instead: one rank's layer fwd+bwd op by op on shape-only CUDA tensors (kernel "
        "launches, bytes read + written, FLOPs, TSP vs TP+SP); see 'bench --traffic --help'",
    )
    p.add_argument(
        "--world-sizes",
        type=positive_int_list,
        default=[2, 4],
        help="comma list of group sizes D; one spawned gloo group each (default 2,4)",
    )
    p.add_argument(
        "--seq-lengths",
        type=positive_int_list,
        default=[256, 512, 1024, 2048, 4096],
        help="comma list of sequence lengths S (each divisible by 2*D)",
    )
    p.add_argument(
        "--steps", type=positive_int, default=3, help="measured steps per (D, S, variant)"
    )
    p.add_argument(
        "--warmup", type=non_negative_int, default=1, help="warm-up steps (not measured)"
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list among tsp,tp_sp,tp")
    p.add_argument("--num-layers", type=positive_int, default=2)
    p.add_argument("--hidden-size", type=positive_int, default=256)
    p.add_argument("--num-attention-heads", type=positive_int, default=8)
    p.add_argument(
        "--num-query-groups", type=positive_int, default=None, help="default: heads (MHA)"
    )
    p.add_argument("--ffn-hidden-size", type=positive_int, default=None, help="default: 4 * hidden")
    p.add_argument("--micro-batch-size", type=positive_int, default=1)
    p.add_argument(
        "--style",
        choices=["llama", "gpt2"],
        default="llama",
        help="llama: RMSNorm+SwiGLU+RoPE, no biases; gpt2: LayerNorm+GELU+biases",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument(
        "--baseline-attention",
        choices=["sdpa", "local"],
        default="sdpa",
        help="core attention of the TP / TP+SP baselines: torch SDPA (flash-style "
        "fused kernel, like TSP's and like TE flash on GPUs; default) or Megatron's "
        "unfused DotProductAttention (materialises [b, np/D, S, S] scores)",
    )
    p.add_argument("--threads-per-rank", type=positive_int, default=1)
    p.add_argument("--seed", type=non_negative_int, default=1234)
    p.add_argument(
        "--tolerance",
        type=non_negative_float,
        default=None,
        help="max relative loss difference between variants (default 1e-4 fp32, "
        "1e-9 fp64, 3e-2 bf16)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="S in {256, 1024}, 2 measured steps: a sanity run of ~1 minute",
    )
    p.add_argument("--timeout", type=positive_float, default=600.0, help="gloo timeout (s)")
    p.add_argument("--out", default=None, help="write the markdown report here too")
    p.add_argument("--json", dest="json_path", default=None, help="write the raw results here")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_lengths, args.steps, args.warmup = [256, 1024], 2, 1
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}; choose among {','.join(VARIANTS)}")
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.tolerance is None:
        args.tolerance = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 3e-2}[args.dtype]
    for d in args.world_sizes:
        if d < 2:
            p.error("--world-sizes: every D must be >= 2 (D=1 has no communication)")
        try:
            rejections.check_divisible(
                d,
                num_attention_heads=args.num_attention_heads,
                num_query_groups=args.num_query_groups,
                ffn_hidden_size=args.ffn_hidden_size,
            )
        except rejections.TSPRejection as exc:
            p.error(f"--world-sizes D={d}: {exc}")
        for s in args.seq_lengths:
            if s % (2 * d):
                p.error(f"--seq-lengths: S={s} is not divisible by 2*D={2 * d} (zigzag chunks)")
    return args


# ---------------------------------------------------------------------------------------------
# machine description
# ---------------------------------------------------------------------------------------------
def machine_info(threads_per_rank: int) -> Dict[str, object]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    try:
        import megatron.core

        mcore = getattr(megatron.core, "__version__", "?")
    except Exception:  # pragma: no cover
        mcore = "not importable"
    try:
        with open("/proc/meminfo") as f:
            mem_gib = int(f.readline().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        mem_gib = None
    return {
        "cpu_model": cpu,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "memory_gib": round(mem_gib, 1) if mem_gib else None,
        "torch": torch.__version__,
        "megatron_core": mcore,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads_per_rank": threads_per_rank,
        "backend": "gloo (TCP loopback)",
    }


def load_average() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        return None


# ---------------------------------------------------------------------------------------------
# analytic bytes
# ---------------------------------------------------------------------------------------------
def layer_shape(args, seq: int):
    from megatron_tsp.tools.estimator.formulas import LayerShape

    llama = args.style == "llama"
    return LayerShape(
        batch=args.micro_batch_size,
        seq=seq,
        hidden=args.hidden_size,
        heads=args.num_attention_heads,
        query_groups=args.num_query_groups,
        ffn=args.ffn_hidden_size,
        gated=llama,
        bias=not llama,
        dtype_bytes=torch.tensor([], dtype=DTYPES[args.dtype]).element_size(),
        normalization="RMSNorm" if llama else "LayerNorm",
    )


def analytic_bytes(args, d: int, seq: int) -> Dict[str, Dict[str, float]]:
    """Received bytes per rank per step, by phase, for the whole stack (layers x formula + the
    replicated-gradient all-reduce of the SP variants)."""
    from megatron_tsp.tools.estimator import formulas as fm

    shape = layer_shape(args, seq)
    final_norm = args.hidden_size * (1 if args.style == "llama" else 2)
    per_layer = {
        "tsp": fm.tsp_layer_comm(shape, d),
        "tp_sp": fm.tp_sp_layer_comm(shape, d),
        "tp": fm.tp_layer_comm(shape, d),
    }
    out = {}
    for name, comm in per_layer.items():
        e = {k: args.num_layers * v for k, v in comm.items()}
        e["grad_sync"] = (
            0.0
            if name == "tp"
            else fm.replicated_grad_allreduce(
                shape,
                d,
                args.num_layers,
                extra_params=final_norm,
                grad_dtype_bytes=shape.dtype_bytes,
            )
        )
        e["total"] = sum(e[k] for k in fm.PHASES) + e["grad_sync"]
        out[name] = e
    return out


def crossovers(args, d: int) -> Dict[str, float]:
    """Sequence lengths (B as configured) above which TSP receives fewer bytes than TP+SP / TP."""
    from megatron_tsp.tools.estimator import formulas as fm

    shape = layer_shape(args, 1024)
    out = {}
    for direction in ("fwd", "total"):
        for base in ("tp_sp", "tp"):
            out[f"{direction}_vs_{base}"] = fm.crossover_seq_length(shape, d, direction, base)
    return out


# ---------------------------------------------------------------------------------------------
# inside each rank
# ---------------------------------------------------------------------------------------------
def _config(args, d: int, sequence_parallel: bool):
    return unfused_config(
        d,
        DTYPES[args.dtype],
        sequence_parallel,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        **style_fields(args.style),
    )


def _sdpa_core_attention():
    """Megatron's ``DotProductAttention`` with its unfused score/softmax/bmm path replaced by
    ``F.scaled_dot_product_attention(is_causal=True)`` (same inputs, outputs and parameters)."""
    import torch.nn.functional as F
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPACoreAttention(DotProductAttention):
        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
        ):
            if packed_seq_params is not None or attention_bias is not None:
                raise ValueError("bench SDPA core attention: no packed sequences / bias")
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, hn]
            ctx = F.scaled_dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                scale=self.softmax_scale,
                dropout_p=self.config.attention_dropout if self.training else 0.0,
                enable_gqa=q.shape[1] != k.shape[1],
            )
            ctx = ctx.permute(2, 0, 1, 3).contiguous()
            return ctx.view(*ctx.shape[:2], self.hidden_size_per_partition)

    return SDPACoreAttention


def _baseline_spec(args, config):
    import copy

    from megatron_tsp.core.specs import get_gpt_block_local_sp_spec

    spec = get_gpt_block_local_sp_spec(config)
    if args.baseline_attention == "sdpa":
        spec = copy.deepcopy(spec)
        core = _sdpa_core_attention()
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = core
    return spec


def _build_blocks(args, d: int) -> Dict[str, torch.nn.Module]:
    """The three stacks, with identical weights (Megatron initialises TP+SP; others load it)."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_tsp.core.specs import get_gpt_block_tsp_spec
    from megatron_tsp.tools.comm_counter import label_modules

    blocks = {}
    cfg_sp = _config(args, d, True)
    blocks["tp_sp"] = TransformerBlock(cfg_sp, _baseline_spec(args, cfg_sp))
    state = blocks["tp_sp"].state_dict()
    cfg_tsp = _config(args, d, True)
    blocks["tsp"] = TransformerBlock(cfg_tsp, get_gpt_block_tsp_spec(cfg_tsp))
    cfg_tp = _config(args, d, False)
    blocks["tp"] = TransformerBlock(cfg_tp, _baseline_spec(args, cfg_tp))
    for name in ("tsp", "tp"):
        blocks[name].load_state_dict(state, strict=True)
    for block in blocks.values():
        block.train()
        label_modules(block, {SelfAttention: "attn", MLP: "mlp"})
    return {k: blocks[k] for k in args.variants}


def _phase_key(record) -> str:
    parts = record.scope.split("/") if record.scope else []
    if "grad_sync" in parts:
        return "grad_sync"
    for block in ("attn", "mlp"):
        if block in parts or f"tsp_{'attention' if block == 'attn' else 'mlp'}" in parts:
            return f"{block}_{record.phase}"
    return "other"


def _summarise(records) -> Dict[str, object]:
    by_op: Dict[str, Dict[str, float]] = {}
    by_phase = {k: 0.0 for k in PHASE_KEYS}
    for r in records:
        e = by_op.setdefault(r.op, {"calls": 0, "recv": 0.0, "payload": 0})
        e["calls"] += 1
        e["recv"] += r.recv_bytes
        e["payload"] += r.payload_bytes
        by_phase[_phase_key(r)] += r.recv_bytes
    return {"recv": sum(r.recv_bytes for r in records), "by_op": by_op, "by_phase": by_phase}


def _run_step(block, x, rope, sync_grads: bool, group):
    from megatron_tsp.core.sharding import allreduce_sequence_parallel_grads
    from megatron_tsp.tools.comm_counter import comm_scope

    out = block(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
    loss = out.float().pow(2).sum()
    loss.backward()
    if sync_grads:
        with comm_scope("grad_sync"):
            allreduce_sequence_parallel_grads(block, group)
    return loss.detach()


def _bench_seq(args, d: int, rank: int, seq: int, blocks, group) -> Dict[str, object]:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_tsp.core import zigzag
    from megatron_tsp.core.comm import all_gather_single
    from megatron_tsp.tools.comm_counter import CommCounter

    dtype = DTYPES[args.dtype]
    h, b = args.hidden_size, args.micro_batch_size
    gen = torch.Generator().manual_seed(args.seed + seq)
    full = torch.randn(seq, b, h, generator=gen).to(dtype)
    scale = 1.0 / (seq * b * h)
    local = {
        "tsp": zigzag.split(full, d, rank, dim=0),
        "tp_sp": full.chunk(d, dim=0)[rank],
        "tp": full,
    }
    rope = None
    if args.style == "llama":
        rope = RotaryEmbedding(
            kv_channels=h // args.num_attention_heads,
            rotary_percent=1.0,
            use_cpu_initialization=True,
        )(seq)
    variants = list(blocks)
    times = {v: [] for v in variants}
    losses = {v: [] for v in variants}
    comm = {v: [] for v in variants}
    for step in range(args.warmup + args.steps):
        k = step % len(variants)
        order = variants[k:] + variants[:k]
        for name in order:
            block = blocks[name]
            block.zero_grad(set_to_none=True)
            x = local[name].detach().clone().requires_grad_(True)
            counter = CommCounter()
            dist.barrier(group=group)
            start = time.perf_counter()
            with counter:
                loss = _run_step(block, x, rope, name != "tp", group)
            elapsed = time.perf_counter() - start
            # slowest rank's time; global loss (SP variants hold 1/D of the tokens each)
            vec = torch.tensor([elapsed, float(loss) * scale], dtype=torch.float64)
            gathered = torch.empty(2 * d, dtype=torch.float64)
            all_gather_single(gathered, vec, group)
            gathered = gathered.view(d, 2)
            if step < args.warmup:
                continue
            times[name].append(float(gathered[:, 0].max()))
            losses[name].append(
                float(gathered[0, 1]) if name == "tp" else float(gathered[:, 1].sum())
            )
            comm[name].append(_summarise(counter.records))
            del x, loss
    result = {"seq_length": seq, "world_size": d, "variants": {}}
    for name in variants:
        recvs = [c["recv"] for c in comm[name]]
        result["variants"][name] = {
            "step_s": times[name],
            "step_s_median": statistics.median(times[name]),
            "loss": losses[name],
            "recv_bytes_per_step": recvs[-1],
            "recv_consistent_across_steps": max(recvs) - min(recvs) <= 1e-9 * max(max(recvs), 1),
            "by_op": comm[name][-1]["by_op"],
            "by_phase": comm[name][-1]["by_phase"],
        }
    return result


def _quiet() -> None:
    """Silence megatron-core's import-time and per-call advisories (no apex/TE, CUDA hints)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("megatron").setLevel(logging.ERROR)


def _worker(rank: int, d: int, args: argparse.Namespace, port: int, path: str) -> None:
    _quiet()
    os.environ["OMP_NUM_THREADS"] = str(args.threads_per_rank)
    init_gloo_rank(rank, d, port, args.timeout, threads=args.threads_per_rank)
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tsp.core import parallel_state
    from megatron_tsp.megatron_lm.cpu_support import enable_cpu_support

    enable_cpu_support()
    parallel_state.initialize_model_parallel(
        tensor_sequence_parallel_size=d, create_gloo_process_groups=False
    )
    model_parallel_cuda_manual_seed(args.seed)
    group = mpu.get_tensor_model_parallel_group()
    blocks = _build_blocks(args, d)
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in blocks.items()}
    results = []
    for seq in args.seq_lengths:
        res = _bench_seq(args, d, rank, seq, blocks, group)
        results.append(res)
        if rank == 0:
            cells = "  ".join(
                f"{LABELS[v]} {r['step_s_median'] * 1e3:8.1f} ms "
                f"{r['recv_bytes_per_step'] / MiB:7.2f} MiB"
                for v, r in res["variants"].items()
            )
            print(f"[bench] D={d} S={seq:6d}: {cells}", file=sys.stderr, flush=True)
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"world_size": d, "params_per_rank": params, "results": results}, f)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _run_group(args, d: int) -> Dict[str, object]:
    import torch.multiprocessing as mp

    from megatron_tsp.tools import bench as this  # picklable by module name even under ``-m``

    fd, path = tempfile.mkstemp(prefix=f"tsp-bench-d{d}-", suffix=".json")
    os.close(fd)
    try:
        ctx = mp.start_processes(
            this._worker,
            args=(d, args, free_port(), path),
            nprocs=d,
            join=False,
            start_method="spawn",
        )
        while not ctx.join():
            pass
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _agreement(res, tolerance: float) -> float:
    """Worst relative loss difference between variants over the measured steps."""
    v = res["variants"]
    names = list(v)
    worst = 0.0
    for other in names[1:]:
        for a, b in zip(v[names[0]]["loss"], v[other]["loss"]):
            worst = max(worst, abs(a - b) / max(abs(b), 1e-30))
    return worst


def _fmt_ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


def _table(head: List[str], rows: List[List[str]], first_column: str = "---:") -> List[str]:
    """Markdown table lines: header, separator (numbers right-aligned; the first column as
    ``first_column`` says), rows, and a blank line."""
    return (
        ["| " + " | ".join(head) + " |", f"|{first_column}|" + "---:|" * (len(head) - 1)]
        + ["| " + " | ".join(row) + " |" for row in rows]
        + [""]
    )


def _vs_tsp(variants) -> List[str]:
    """The baselines TSP is compared with (none when TSP was not run)."""
    return [n for n in variants if n != "tsp"] if "tsp" in variants else []


def _render_preamble(report) -> List[str]:
    cfg, m = report["config"], report["machine"]
    return [
        "## TSP vs Megatron TP+SP vs TP: fwd+bwd step time and communication (gloo, CPU)",
        "",
        f"Machine: {m['cpu_model']}, {m['usable_cpus']} usable CPUs ({m['logical_cpus']} logical), "
        f"{m['memory_gib']} GiB; torch {m['torch']}, megatron-core {m['megatron_core']}, "
        f"Python {m['python']}; {m['threads_per_rank']} thread(s) per rank; {m['backend']}.",
        f"Load average (1/5/15 min) at start {report['load_average']['start']}, "
        f"at end {report['load_average']['end']}.",
        "",
        f"Model: TransformerBlock of {cfg['num_layers']} layers, {cfg['style']}-style, "
        f"h={cfg['hidden_size']}, heads={cfg['num_attention_heads']}, "
        f"query groups={cfg['num_query_groups']}, FFN={cfg['ffn_hidden_size']}, "
        f"micro-batch={cfg['micro_batch_size']}, {cfg['dtype']}; baseline core attention: "
        f"{cfg['baseline_attention']}. Step = forward + backward of the "
        f"stack (+ replicated-grad all-reduce for the SP variants). Median of {cfg['steps']} "
        f"measured steps after {cfg['warmup']} warm-up, variants interleaved with rotating "
        f"order; step time = slowest rank. Wall time of the run: {report['wall_s']:.0f} s.",
        "",
    ]


def _render_times(group, variants) -> List[str]:
    """Median step time per variant and S, TSP's time ratios, and the loss agreement."""
    head = (
        ["S"]
        + [f"{LABELS[v]} ms" for v in variants]
        + [f"TSP/{LABELS[v]} time" for v in _vs_tsp(variants)]
        + ["loss rel. diff"]
    )
    rows = []
    for res in group["results"]:
        v = res["variants"]
        rows.append(
            [str(res["seq_length"])]
            + [f"{v[n]['step_s_median'] * 1e3:.1f}" for n in variants]
            + [
                _fmt_ratio(v["tsp"]["step_s_median"], v[n]["step_s_median"])
                for n in _vs_tsp(variants)
            ]
            + [f"{res['loss_rel_diff']:.1e}"]
        )
    return _table(head, rows)


def _render_bytes(group, variants) -> List[str]:
    """Received MiB per rank and step, measured and as a ratio to the closed forms."""
    head = (
        ["S"]
        + [f"{LABELS[v]} MiB (meas/analytic)" for v in variants]
        + [f"TSP/{LABELS[v]} bytes" for v in _vs_tsp(variants)]
    )
    rows = []
    for res in group["results"]:
        v = res["variants"]
        row = [str(res["seq_length"])]
        for n in variants:
            meas, ana = v[n]["recv_bytes_per_step"], v[n]["analytic"]["total"]
            row.append(f"{meas / MiB:.2f} ({_fmt_ratio(meas, ana)})")
        rows.append(
            row
            + [
                _fmt_ratio(v["tsp"]["recv_bytes_per_step"], v[n]["recv_bytes_per_step"])
                for n in _vs_tsp(variants)
            ]
        )
    return [
        "Received MiB per rank per step (measured by CommCounter, and measured / "
        "analytic from `estimator.formulas`):",
        "",
    ] + _table(head, rows)


def _render_ops(last, variants) -> List[str]:
    """Calls and received MiB per collective at the longest sequence."""
    ops = sorted({op for n in variants for op in last["variants"][n]["by_op"]})
    rows = []
    for op in ops:
        cells = [op]
        for n in variants:
            e = last["variants"][n]["by_op"].get(op, {"calls": 0, "recv": 0.0})
            cells += [str(e["calls"]), f"{e['recv'] / MiB:.3f}"]
        rows.append(cells)
    head = ["op"] + [f"{LABELS[n]} {what}" for n in variants for what in ("calls", "MiB")]
    return [
        f"By operation at S = {last['seq_length']} (calls and received MiB per rank per step):",
        "",
    ] + _table(head, rows, first_column="---")


def _render_phases(last, variants) -> List[str]:
    """Received MiB per block and phase at the longest sequence, measured / analytic ("other"
    only when some variant has traffic there)."""
    rows = []
    for key in PHASE_KEYS:
        by_phase = [last["variants"][n]["by_phase"].get(key, 0.0) for n in variants]
        if key == "other" and all(meas == 0 for meas in by_phase):
            continue
        rows.append(
            [key]
            + [
                f"{meas / MiB:.3f} / {last['variants'][n]['analytic'].get(key, 0.0) / MiB:.3f}"
                for meas, n in zip(by_phase, variants)
            ]
        )
    return [
        f"By block and phase at S = {last['seq_length']} (received MiB per rank per "
        "step, measured / analytic):",
        "",
    ] + _table(["phase"] + [LABELS[n] for n in variants], rows, first_column="---")


def _render_group(group, variants) -> List[str]:
    d, cross = group["world_size"], group["crossover_seq_length"]
    lines = [
        f"### D = {d} ({d} gloo ranks)",
        "",
        "Analytic crossover (TSP receives fewer bytes per rank than the baseline for S "
        f"above): forward vs TP+SP {cross['fwd_vs_tp_sp']:.0f}, fwd+bwd vs TP+SP "
        f"{cross['total_vs_tp_sp']:.0f}, fwd+bwd vs TP {cross['total_vs_tp']:.0f}.",
        "",
    ]
    last = group["results"][-1]
    return (
        lines
        + _render_times(group, variants)
        + _render_bytes(group, variants)
        + _render_ops(last, variants)
        + _render_phases(last, variants)
    )


def render(report: Dict[str, object]) -> str:
    """The Markdown report: machine and model, then per group size D the step times, the
    received bytes, and (at the longest sequence) the bytes by operation and by phase."""
    variants = report["config"]["variants"]
    lines = _render_preamble(report)
    for group in report["groups"]:
        lines += _render_group(group, variants)
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--traffic" in argv:  # a different benchmark: one layer's kernels, bytes and FLOPs
        from megatron_tsp.tools import traffic

        return traffic.main([a for a in argv if a != "--traffic"])
    args = parse_args(argv)
    _quiet()
    load_start = load_average()
    t0 = time.time()
    groups = []
    for d in args.world_sizes:
        print(f"[bench] spawning {d} gloo ranks ...", file=sys.stderr, flush=True)
        try:
            data = _run_group(args, d)
        except Exception as exc:  # a rank died: report and fail
            print(f"error: benchmark group D={d} failed: {exc}", file=sys.stderr)
            return 1
        for res in data["results"]:
            ana = analytic_bytes(args, d, res["seq_length"])
            for name, v in res["variants"].items():
                v["analytic"] = ana[name]
            res["loss_rel_diff"] = _agreement(res, args.tolerance)
        data["crossover_seq_length"] = crossovers(args, d)
        groups.append(data)
    report = {
        "machine": machine_info(args.threads_per_rank),
        "load_average": {"start": load_start, "end": load_average()},
        "wall_s": time.time() - t0,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "json_path")},
        "groups": groups,
    }
    text = render(report)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=1, default=str)
    worst = max(r["loss_rel_diff"] for g in groups for r in g["results"])
    if worst > args.tolerance:
        print(
            f"error: the variants' losses differ by {worst:.2e} > {args.tolerance:.0e}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
