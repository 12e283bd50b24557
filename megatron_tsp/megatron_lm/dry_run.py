"""``--tsp-dry-run``: the real Megatron argument path and model builder, on one CPU process.

The script runs unmodified up to Megatron's ``pretrain``. There, instead of initializing CUDA and
NCCL, the dry run

1. parses and validates the command line with Megatron's own ``parse_args`` / ``validate_args``
   (core_v0.16; on 0.19 / main the script has already done so with ``parse_and_validate_args``),
   which includes the TSP translation and checks;
2. creates a ``fake`` process group of the full world size (no memory, no peers) holding the
   requested rank, and Megatron's model-parallel groups on it;
3. builds that rank's model with the script's own model provider / builder, every tensor on the
   ``meta`` device (a 7B model at D=8 needs no RAM);
4. prints the parallel layout (TSP / DP / PP sizes and the ranks of every group), the per-rank
   parameter count and the zigzag chunks of every TSP rank; with experts, the MoE layout (the
   schedule, experts per rank and this rank's experts, the EP / expert-TP / expert-DP groups, the
   MoE layers of this stage);
5. checks every target of the patch registry in the imported megatron-core and torch and in the
   Megatron-LM checkout the script runs from (``patch_checks.check_everywhere``), then exits with
   status 0, or 1 when a target is missing or lacks a parameter the patch relies on.

CUDA is never initialized (checked and printed at the end).
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Dict, List, Optional

import torch

from megatron_tsp.megatron_lm import arguments as tsp_args
from megatron_tsp.megatron_lm import patch_checks, patches

_MAX_GROUPS_SHOWN = 8


def default_world_size(args) -> int:
    env = int(os.environ.get("WORLD_SIZE", "1"))
    if env > 1:
        return env
    d = tsp_args.tsp_size(args) or args.tensor_model_parallel_size
    cp = args.context_parallel_size or 1
    return d * (args.pipeline_model_parallel_size or 1) * cp


def prepare_args(args) -> None:
    """Before validation: the world the dry run describes (not the single process it runs in)."""
    world = args.tsp_dry_run_world_size or default_world_size(args)
    if world < 1:
        raise tsp_args.TSPArgumentError(f"--tsp-dry-run-world-size must be >= 1, got {world}")
    rank = args.tsp_dry_run_rank
    if not 0 <= rank < world:
        raise tsp_args.TSPArgumentError(
            f"--tsp-dry-run-rank={rank} is outside the world of {world} ranks"
        )
    args.world_size = world
    args.rank = 0  # Megatron prints from rank 0; the model built is --tsp-dry-run-rank's.
    # Meta-device build: never materialize a full master weight on the CPU.
    args.use_cpu_initialization = False
    # The fused weight-gradient kernel is a CUDA extension; it does not change any parameter.
    args.gradient_accumulation_fusion = False
    if not _have_transformer_engine():
        # Megatron's config refuses fused RoPE without TE; fusion does not change any parameter.
        args.apply_rope_fusion = False


def _have_transformer_engine() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


# Compute capability the dry run reports to Megatron's validate_args, which reads the GPU
# architecture when TP > 1 (CUDA_DEVICE_MAX_CONNECTIONS advice); asking the device would
# initialize CUDA. 9 = Hopper (H100/H200); set TSP_DRY_RUN_ARCH to change it.
DEFAULT_DRY_RUN_ARCH = 9


def dry_run_arch() -> int:
    return int(os.environ.get("TSP_DRY_RUN_ARCH", DEFAULT_DRY_RUN_ARCH))


_ARCH_QUERY, _CURRENT_DEVICE, _TENSOR_CUDA = patches.declare(
    [
        patches.row(
            patches.DRY_RUN,
            "megatron.training.arguments:get_device_arch_version",
            "validate_args asks the GPU architecture; the dry run reports TSP_DRY_RUN_ARCH "
            "(during validation only)",
            (),
        ),
        patches.row(
            patches.DRY_RUN,
            "torch.cuda:current_device",
            "the model is built on the meta device",
            (),
        ),
        patches.row(
            patches.DRY_RUN,
            "torch:Tensor.cuda",
            "tied embeddings across stages call weight.data.cuda(); a meta tensor stays put",
        ),
    ]
)
# what a launch with --tsp-dry-run applies, and so what it checks against the installed packages
# and the script's Megatron-LM tree
LAUNCH_MODES = (patches.LAUNCH, patches.CPU_SUPPORT, patches.DRY_RUN)


@contextlib.contextmanager
def no_cuda_in_validation():
    """During ``validate_args``: Megatron's architecture query answers ``dry_run_arch()``."""
    with patches.applied(_ARCH_QUERY.mode, _ARCH_QUERY.target, dry_run_arch):
        yield


# ---------------------------------------------------------------------------------------------
# Entry from the wrapped ``pretrain``.


def _is_config_container(obj) -> bool:
    model = getattr(obj, "model", None)
    return model is not None and hasattr(model, "get_builder_cls")


def dry_run_from_pretrain(pos_args, kwargs):
    """Called instead of Megatron's ``pretrain`` when ``--tsp-dry-run`` is on the command line."""
    from megatron.training.global_vars import get_args

    first = pos_args[0] if pos_args else kwargs.get("cfg_container")
    if _is_config_container(first):  # 0.18+ / main: args already parsed, validated and global
        args = get_args()
        model_provider = kwargs.get("model_provider")
        if model_provider is None and len(pos_args) > 4:
            model_provider = pos_args[4]
        builder = _config_builder(first.model, model_provider)
        version_path = "pretrain(cfg_container) / GPTModelBuilder"
    else:  # core_v0.16: pretrain(datasets_provider, model_provider, model_type, forward_step, ...)
        from megatron.training import arguments as megatron_arguments
        from megatron.training.global_vars import set_global_variables

        model_provider = pos_args[1] if len(pos_args) > 1 else kwargs["model_provider"]
        extra_args_provider = kwargs.get("extra_args_provider")
        args_defaults = kwargs.get("args_defaults") or {}
        args = megatron_arguments.parse_args(extra_args_provider)
        megatron_arguments.validate_args(args, args_defaults)
        set_global_variables(args)
        builder = _provider_builder(model_provider)
        version_path = "pretrain(model_provider) / gpt_builder"
    report = run(args, builder)
    report["builder"] = version_path
    print_report(report)
    raise SystemExit(exit_status(report))


def exit_status(report: dict) -> int:
    """1 when a patch target does not match this installation (the real run would break), else 0."""
    return 1 if report["patch_check"]["problems"] else 0


def _provider_builder(model_provider) -> Callable:
    def build(pre_process: bool, post_process: bool, vp_stage: Optional[int]):
        return model_provider(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)

    return build


def _config_builder(model_config, model_provider) -> Callable:
    def build(pre_process: bool, post_process: bool, vp_stage: Optional[int]):
        from megatron.core.process_groups_config import ProcessGroupCollection

        if model_provider is not None:
            return model_provider(
                pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
            )
        builder = model_config.get_builder_cls()(model_config)
        return builder.build_model(
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
            pre_process=pre_process,
            post_process=post_process,
            vp_stage=vp_stage,
        )

    return build


# ---------------------------------------------------------------------------------------------
# The dry run proper.


@contextlib.contextmanager
def _meta_device():
    """Megatron allocates parameters on ``torch.cuda.current_device()``: make that ``meta``."""
    # Tied embeddings across pipeline stages call ``weight.data.cuda()`` before an all-reduce on
    # the embedding group; a meta tensor stays where it is.
    with (
        patches.applied(_CURRENT_DEVICE.mode, _CURRENT_DEVICE.target, lambda: torch.device("meta")),
        patches.applied(_TENSOR_CUDA.mode, _TENSOR_CUDA.target, lambda self, *a, **k: self),
        torch.device("meta"),
    ):
        yield


def _init_model_parallel(args) -> None:
    import inspect

    from megatron.core import parallel_state as mpu

    wanted = dict(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=getattr(
            args, "virtual_pipeline_model_parallel_size", None
        ),
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None),
        order="tp-cp-ep-dp-pp"
        if not getattr(args, "use_tp_pp_dp_mapping", False)
        else "tp-cp-ep-pp-dp",
        create_gloo_process_groups=False,
    )
    accepted = inspect.signature(mpu.initialize_model_parallel).parameters
    mpu.initialize_model_parallel(**{k: v for k, v in wanted.items() if k in accepted})


def group_layout(args) -> Dict[str, List[List[int]]]:
    """Ranks of every TSP(=TP) / DP / PP group, from Megatron's own rank generator."""
    from megatron.core.parallel_state import RankGenerator

    tp = args.tensor_model_parallel_size
    pp = args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    dp = args.world_size // (tp * pp * cp)
    order = (
        "tp-cp-ep-dp-pp" if not getattr(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-pp-dp"
    )
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    return {
        "tp": gen.get_ranks("tp"),
        "dp": gen.get_ranks("dp"),
        "pp": gen.get_ranks("pp"),
        "cp": gen.get_ranks("cp"),
        "tp-cp": gen.get_ranks("tp-cp"),
    }


def _moe_schedule(args) -> str:
    """Which MoE schedule the run uses, in words (the dry run prints it)."""
    if not tsp_args.tsp_size(args):
        return "Megatron's MoELayer"
    if getattr(args, "tsp_moe_ring", False):
        return (
            "TSP expert ring (--tsp-moe-ring: every expert sharded 1/D per rank, its weight "
            "shards on the TSP P2P ring; tokens stay, no dispatcher communication)"
        )
    return (
        "experts folded onto the TSP axis (megatron-core MoELayer behind TSP attention; "
        "--tsp-moe-ring would shard every expert over the TSP ranks instead)"
    )


def _output_head(args) -> str:
    """How the last stage computes the loss, in words (the dry run prints it)."""
    from megatron_tsp.core import output_head

    if not tsp_args.tsp_size(args):
        return "Megatron's output layer and vocab-parallel cross-entropy"
    return output_head.describe(
        getattr(args, "tsp_vocab_ring", "auto"),
        args.padded_vocab_size,
        args.hidden_size,
        2 if (args.bf16 or args.fp16) else 4,
        tokens=args.micro_batch_size * args.seq_length // (args.context_parallel_size or 1),
    )


def moe_layout(args, models) -> Optional[dict]:
    """The MoE layout of the run (None without experts): schedule, experts per rank and this
    rank's global expert ids, the expert groups from Megatron's own rank generator (same order
    as ``initialize_model_parallel``'s expert grid), and the layers of this stage that are MoE."""
    from megatron.core import parallel_state as mpu
    from megatron.core.parallel_state import RankGenerator
    from megatron.core.transformer.moe.moe_layer import MoELayer

    experts = vars(args).get("num_experts")
    if not experts:
        return None
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    etp = getattr(args, "expert_tensor_parallel_size", None) or args.tensor_model_parallel_size
    pp = args.pipeline_model_parallel_size
    order = (
        "tp-cp-ep-dp-pp" if not getattr(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-pp-dp"
    )
    gen = RankGenerator(
        tp=etp, ep=ep, dp=args.world_size // (etp * ep * pp), pp=pp, cp=1, order=order
    )
    ep_rank = mpu.get_expert_model_parallel_rank()
    per_rank = experts // ep
    moe_layers = []
    for model in models:
        decoder = getattr(model, "decoder", None)
        for layer in getattr(decoder, "layers", None) or []:
            if isinstance(getattr(layer, "mlp", None), MoELayer):
                moe_layers.append(layer.layer_number)
    return {
        "num_experts": experts,
        "topk": getattr(args, "moe_router_topk", None),
        "dispatcher": getattr(args, "moe_token_dispatcher_type", None),
        "schedule": _moe_schedule(args),
        "ep": ep,
        "etp": etp,
        "experts_per_rank": per_rank,
        "local_experts": list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank)),
        "ep_groups": gen.get_ranks("ep"),
        "etp_groups": gen.get_ranks("tp"),
        "expert_dp_groups": gen.get_ranks("dp"),
        "moe_layers": moe_layers,
    }


def zigzag_chunks(seq_length: int, d: int, cp: int = 1) -> List[dict]:
    """Per rank of the sequence group (TSP, or TSP x CP: D*C ranks): its (TSP rank, CP rank),
    chunk ids and their natural token spans (from ``TSPLayout``)."""
    from megatron_tsp.core.layout import TSPLayout, check_sequence_length

    check_sequence_length(seq_length, d * cp)
    layout = TSPLayout(d * cp, seq_length, context_parallel_size=cp)
    return [
        {
            "rank": q,
            "tsp_cp": layout.split_rank(q),
            "chunks": layout.chunks_of(q),
            "tokens": layout.spans_of(q),
        }
        for q in range(d * cp)
    ]


def _count(models) -> Dict[str, int]:
    counts = {"total": 0, "embedding": 0, "decoder layers": 0, "final norm": 0, "output layer": 0}
    for model in models:
        for name, p in model.named_parameters():
            n = p.numel()
            counts["total"] += n
            if "embedding" in name:
                counts["embedding"] += n
            elif ".layers." in name or name.startswith("decoder.layers"):
                counts["decoder layers"] += n
            elif "final_layernorm" in name:
                counts["final norm"] += n
            elif "output_layer" in name:
                counts["output layer"] += n
    return counts


def _layer_classes(models) -> List[str]:
    names = []
    for model in models:
        decoder = getattr(model, "decoder", None)
        layers = getattr(decoder, "layers", None) if decoder is not None else None
        if layers is None or len(layers) == 0:
            continue
        layer = layers[0]
        for sub in ("self_attention", "mlp"):
            mod = getattr(layer, sub, None)
            if mod is not None:
                names.append(f"{sub}={type(mod).__module__}.{type(mod).__name__}")
            if getattr(mod, "attention_kernel_name", None):  # TSP attention: backend and mode
                names.append(
                    f"attention_kernel={mod.attention_kernel_name} "
                    f"(attention_backward={mod.head_layout.backward}, "
                    f"selected_by={mod.attention_kernel.selected_by})"
                )
        final = getattr(decoder, "final_layernorm", None)
        if final is not None:
            names.append(f"final_layernorm={type(final).__module__}.{type(final).__name__}")
        break
    return names


def run(args, build: Callable) -> dict:
    """Build ``args.tsp_dry_run_rank``'s model on the meta device; return the report dict."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    from megatron_tsp.megatron_lm.cpu_support import enable_cpu_support
    from megatron_tsp.megatron_lm.fake_world import destroy_fake_world, init_fake_world

    rank = getattr(args, "tsp_dry_run_rank", 0)
    enable_cpu_support(force=torch.cuda.is_available())  # the shims never call into CUDA
    init_fake_world(args.world_size, rank)
    try:
        _init_model_parallel(args)
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        pp_rank = mpu.get_pipeline_model_parallel_rank()
        pp = mpu.get_pipeline_model_parallel_world_size()
        vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
        models = []
        with _meta_device():
            for vp in range(vpp):
                pre = pp_rank == 0 and vp == 0
                post = pp_rank == pp - 1 and vp == vpp - 1
                models.append(build(pre, post, vp if vpp > 1 else None))
        report = {
            "world_size": args.world_size,
            "rank": rank,
            "tsp": tsp_args.tsp_size(args),
            "tp": args.tensor_model_parallel_size,
            "sequence_parallel": args.sequence_parallel,
            "pp": args.pipeline_model_parallel_size,
            "cp": args.context_parallel_size,
            "dp": args.data_parallel_size,
            "groups": group_layout(args),
            "this_rank": {
                "tp_rank": mpu.get_tensor_model_parallel_rank(),
                "pp_rank": pp_rank,
                "dp_rank": mpu.get_data_parallel_rank(),
                "tp_group": dist.get_process_group_ranks(mpu.get_tensor_model_parallel_group()),
            },
            "params": _count(models),
            "param_dtype": str(getattr(args, "params_dtype", torch.float32)).replace("torch.", ""),
            "layers": _layer_classes(models),
            "seq_length": args.seq_length,
            "micro_batch_size": args.micro_batch_size,
            "global_batch_size": args.global_batch_size,
            "padded_vocab_size": getattr(args, "padded_vocab_size", None),
            "output_head": _output_head(args),
        }
        report["moe"] = moe_layout(args, models)
        d = report["tsp"]
        if d:
            report["zigzag"] = zigzag_chunks(args.seq_length, d, args.context_parallel_size)
        report["cuda_initialized"] = torch.cuda.is_initialized()
        report["patches"] = patches.report_lines()
        tree = patch_checks.imported_megatron_lm_tree()
        checked, problems = patch_checks.check_everywhere([tree] if tree else [], launch_patches())
        report["patch_check"] = {
            "checked": checked,
            "problems": problems,
            "declared": len(launch_patches()),
        }
        return report
    finally:
        mpu.destroy_model_parallel()
        destroy_fake_world()


def _fmt_groups(groups: List[List[int]]) -> str:
    shown = "  ".join(str(g) for g in groups[:_MAX_GROUPS_SHOWN])
    if len(groups) > _MAX_GROUPS_SHOWN:
        shown += f"  ... ({len(groups)} groups)"
    return shown


def launch_patches() -> List[patches.Patch]:
    """The patches a launch applies (``LAUNCH_MODES``): the rows their appliers declared (the
    dry run is reached through ``hooks``, which imports the launch's appliers)."""
    from megatron_tsp.megatron_lm import cpu_support  # noqa: F401  (its rows)

    return [p for p in patches.declared() if p.mode in LAUNCH_MODES]


def _patch_check_lines(check: dict) -> List[str]:
    problems = check["problems"]
    verdict = (
        f"{len(problems)} PROBLEM(S): the run would patch what is not there"
        if problems
        else f"all {check['declared']} declared targets of a launch present, with the parameters "
        "they rely on"
    )
    lines = [f"  patch targets     : {verdict}"]
    lines += [f"    checked in {where}" for where in check["checked"]]
    lines += [f"    {problem}" for problem in problems]
    return lines


def print_report(report: dict) -> None:
    tsp = report["tsp"]
    axis = (
        f"TSP {tsp}"
        if tsp
        else f"TP {report['tp']}" + (" + SP" if report["sequence_parallel"] else "")
    )
    lines = [
        "=" * 78,
        "megatron_tsp dry run (no CUDA; model on the meta device)",
        f"  builder           : {report.get('builder', '?')}",
        f"  world size        : {report['world_size']} = {axis} x PP {report['pp']}"
        + (f" x CP {report['cp']}" if report["cp"] > 1 else "")
        + f" x DP {report['dp']}",
        f"  Megatron args     : tensor_model_parallel_size={report['tp']} "
        f"sequence_parallel={report['sequence_parallel']} "
        f"pipeline_model_parallel_size={report['pp']} context_parallel_size={report['cp']}",
        f"  {'TSP' if tsp else 'TP'} groups        : {_fmt_groups(report['groups']['tp'])}",
        f"  DP groups         : {_fmt_groups(report['groups']['dp'])}",
        f"  PP groups         : {_fmt_groups(report['groups']['pp'])}",
    ]
    if report["cp"] > 1:
        lines += [
            f"  CP groups         : {_fmt_groups(report['groups']['cp'])}",
            f"  {'sequence groups' if tsp else 'TP x CP groups '}   : "
            f"{_fmt_groups(report['groups']['tp-cp'])}"
            + (" (TSP x CP: K/V gathered over these)" if tsp else ""),
        ]
    lines += [
        f"  rank {report['rank']:<13d}: tp_rank={report['this_rank']['tp_rank']} "
        f"pp_rank={report['this_rank']['pp_rank']} dp_rank={report['this_rank']['dp_rank']} "
        f"group={report['this_rank']['tp_group']}",
        f"  layers            : {', '.join(report['layers']) or '(none on this stage)'}",
        f"  padded vocab      : {report['padded_vocab_size']}",
        f"  output layer      : {report['output_head']}",
    ]
    p = report["params"]
    lines.append(
        f"  params on rank {report['rank']:<3d}: {p['total']:,} "
        f"(embedding {p['embedding']:,}, decoder layers {p['decoder layers']:,}, "
        f"final norm {p['final norm']:,}, output layer {p['output layer']:,})"
    )
    if tsp:
        s = report["seq_length"]
        first, end = report["zigzag"][0]["tokens"][0]  # rank 0's first chunk: [0, C)
        c = end - first
        n = len(report["zigzag"])
        lines.append(
            f"  zigzag            : seq_length {s} = {2 * n} chunks of {c} tokens; "
            f"micro-batch {report['micro_batch_size']}, global batch {report['global_batch_size']}"
        )
        for row in report["zigzag"]:
            spans = ", ".join(f"[{a}, {b})" for a, b in row["tokens"])
            who = f"TSP rank {row['rank']}"
            if report["cp"] > 1:
                who = f"seq rank {row['rank']} (TSP {row['tsp_cp'][0]}, CP {row['tsp_cp'][1]})"
            lines.append(
                f"    {who}: chunks {row['chunks'][0]} and {row['chunks'][1]} -> tokens {spans}"
            )
    moe = report.get("moe")
    if moe:
        lines += [
            f"  MoE               : {moe['num_experts']} experts, top-{moe['topk']}, "
            + (
                f"{moe['dispatcher']} dispatcher; {moe['schedule']}"
                if not moe["schedule"].startswith("TSP expert ring")
                else moe["schedule"]
            ),
            (
                f"  experts           : {moe['experts_per_rank']} per rank (EP {moe['ep']}, "
                f"expert-TP {moe['etp']}); rank {report['rank']} holds "
                + ("1/" + str(moe["etp"]) + " of experts " if moe["etp"] > 1 else "experts ")
                + f"{moe['local_experts']}"
            ),
            f"  EP groups         : {_fmt_groups(moe['ep_groups'])}",
            f"  expert-TP groups  : {_fmt_groups(moe['etp_groups'])}",
            f"  expert-DP groups  : {_fmt_groups(moe['expert_dp_groups'])}",
            f"  MoE layers        : {moe['moe_layers'] or 'none'} on this stage",
        ]
    lines.append(f"  CUDA initialized  : {'yes' if report['cuda_initialized'] else 'no'}")
    lines.append(
        f"  patches           : {len(report.get('patches', []))} applied in this process "
        "(megatron_tsp/megatron_lm/patches.py)"
    )
    lines.extend(f"    {line}" for line in report.get("patches", []))
    lines.extend(_patch_check_lines(report["patch_check"]))
    lines.append("=" * 78)
    print("\n".join(lines), flush=True)
