"""The "tensor-sequence parallel" argument group, and its translation into Megatron's arguments.

TSP under Megatron-LM is Megatron's own tensor-parallel rank group run with sequence-parallel
activations and the TSP layer spec. Translating ``--tensor-sequence-parallel-size D`` therefore
means, before Megatron's ``validate_args`` does its world-size arithmetic:

* ``tensor_model_parallel_size = D`` (so data-parallel size = world / (D * PP) as for TP=D);
* ``sequence_parallel = True`` (when D > 1; Megatron turns it off for a group of one);
* ``spec = (megatron_tsp.megatron_lm.spec, tsp_block_spec)``: the model gets the TSP block spec;
* ``create_attention_mask_in_dataloader = False`` (``--no-create-attention-mask-in-dataloader``):
  TSP attention never reads the S x S mask; packed documents (``--reset-attention-mask``) reach it
  as document starts the batch hook reads from the position ids or the EOD tokens
  (``megatron_lm/documents.py``). Only under TSP: Megatron's own attention (TP, ``--tsp-mlp``)
  needs the mask for documents, and without it attends across them.

Every combination TSP does not support (the rows of ``megatron_tsp.core.rejections``) is rejected
here with a ``TSPArgumentError`` (a ``ValueError``) that names the flags and the numbers.

``--tsp-mlp`` is the hybrid for an existing TP+SP run: ``--tensor-model-parallel-size D
--sequence-parallel --tsp-mlp`` keeps Megatron's attention and replaces only the MLP's activation
all-gather / reduce-scatter by the TSP weight ring. Its translation leaves the parallel layout
alone and only selects ``spec = (megatron_tsp.megatron_lm.spec, tsp_mlp_block_spec)``; no batch
permutation (the MLP input is Megatron's contiguous sequence shard), parameters and checkpoints
are TP=D's. What it refuses are the ``TSP_MLP`` rows of the same table.
"""

from __future__ import annotations

import argparse
from typing import Iterable, List, Optional, Sequence

from megatron_tsp.core import rejections
from megatron_tsp.core.layout import check_sequence_length
from megatron_tsp.core.validation import (
    MOE_RING_FLAG,
    TSP_FLAG,
    check_expert_layout,
    check_model_shape,
    check_parallel_layout,
)

GROUP_TITLE = "tensor-sequence parallel"

# Module and attribute handed to Megatron's ``--spec <module> <attribute>``.
SPEC_MODULE = "megatron_tsp.megatron_lm.spec"
SPEC_ATTR = "tsp_block_spec"
TSP_MLP_SPEC_ATTR = "tsp_mlp_block_spec"
TSP_MLP_FLAG = rejections.MODE_FLAGS[rejections.TSP_MLP]
KV_GRAD_FP32_FLAG = "--tsp-kv-grad-reduce-in-fp32"
KV_GRAD_A2A_FLAG = "--tsp-kv-grad-all-to-all"
ACTIVATION_SUMS_FP32_FLAG = "--tsp-activation-sums-in-fp32"
VOCAB_RING_FLAG = "--tsp-vocab-ring"


class TSPArgumentError(ValueError):
    """A command line that TSP cannot run. The message names the flags."""


def add_tsp_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the TSP flags to ``parser`` (idempotent). Returns the parser, like Megatron's helpers."""
    if any(getattr(a, "dest", None) == "tensor_sequence_parallel_size" for a in parser._actions):
        return parser
    group = parser.add_argument_group(
        title=GROUP_TITLE,
        description=(
            "TSP folds tensor and sequence parallelism onto one axis of size D: every rank holds "
            "1/D of each layer's weights and 1/D of the tokens (zigzag chunks r and 2D-1-r). "
            "Replace '--tensor-model-parallel-size D --sequence-parallel' by "
            "'--tensor-sequence-parallel-size D'."
        ),
    )
    group.add_argument(
        TSP_FLAG,
        dest="tensor_sequence_parallel_size",
        type=int,
        default=None,
        metavar="D",
        help="Run the transformer layers with TSP over groups of D ranks (Megatron's "
        "tensor-parallel ranks). Implies --tensor-model-parallel-size D and --sequence-parallel, "
        "selects the TSP block spec and zigzag-permutes every batch.",
    )
    group.add_argument(
        TSP_MLP_FLAG,
        dest="tsp_mlp",
        action="store_true",
        default=False,
        help="Hybrid for a TP+SP run: with '--tensor-model-parallel-size D --sequence-parallel', "
        "keep Megatron's attention and run only the MLP on the TSP weight ring (no activation "
        "all-gather before fc1 / reduce-scatter after fc2; the weight shards circulate "
        "instead). No zigzag, no batch permutation; parameters and checkpoints are TP=D's.",
    )
    group.add_argument(
        KV_GRAD_FP32_FLAG,
        dest="tsp_kv_grad_reduce_in_fp32",
        action="store_true",
        default=False,
        help="Reduce-scatter TSP attention's dK/dV in fp32 (the accumulation dtype) instead of "
        "the compute dtype, like --accumulate-allreduce-grads-in-fp32 does for the data-parallel "
        "gradient reduction. Each rank always sums its dK/dV over its chunks in fp32; this "
        "also keeps the sum over the D ranks in fp32, at twice the bytes of the largest "
        "backward transfer (bf16 runs). Default: the compute dtype, as TP+SP's activation-"
        "gradient reduce-scatters.",
    )
    group.add_argument(
        KV_GRAD_A2A_FLAG,
        dest="tsp_kv_grad_all_to_all",
        action="store_true",
        default=False,
        help="Sum TSP attention's dK/dV over the sequence group with an all-to-all of the "
        "partials, added in fp32 at each token's owner, instead of a reduce-scatter: the same "
        "bytes on the wire, one rounding however many ranks the group has (a ring "
        "reduce-scatter in bf16 rounds at every hop: 6x the error of one rounding over the 64 "
        "ranks of TSP8 x CP8). Costs a receive buffer the size of one head group's "
        "full-sequence dK/dV.",
    )
    group.add_argument(
        ACTIVATION_SUMS_FP32_FLAG,
        dest="tsp_activation_sums_in_fp32",
        action="store_true",
        default=False,
        help="Write the TSP MLP's and attention's input gradients (one GEMM each over every "
        "weight shard / head group, like the MLP output) in fp32 before the cast to the model "
        "dtype, and sum the vocabulary ring's and the expert ring's input gradients over their "
        "shards in an fp32 accumulator instead of in place in the compute dtype (the GEMMs' fp32 "
        "arithmetic, one rounding of the running sum per shard: fewer roundings than TP+SP's "
        "bf16 reduce-scatter of the same sums); fp32 reads and writes those sums at twice the "
        "bytes (bf16 runs).",
    )
    group.add_argument(
        VOCAB_RING_FLAG,
        dest="tsp_vocab_ring",
        choices=("auto", "always", "never"),
        default="auto",
        help="TSP's loss on the vocabulary ring: the output weight's vocabulary shards circulate "
        "on the P2P ring and each rank computes its own tokens' cross-entropy over the whole "
        "vocabulary, instead of Megatron's output layer (the final hidden states all-gathered "
        "over the TSP group, re-gathered and reduce-scattered in backward). Its bytes are the "
        "vocabulary's weights, Megatron's the tokens' hidden states: 'auto' (default) takes the "
        "ring for micro-batches where it receives fewer bytes (7B: from 43,656 tokens; at "
        "128k 0.94 vs 2.82 GB per micro-batch), 'always' / 'never' force it. Same loss, "
        "gradients and checkpoints.",
    )
    group.add_argument(
        MOE_RING_FLAG,
        dest="tsp_moe_ring",
        action="store_true",
        default=False,
        help="MoE layers: the TSP expert ring instead of experts folded onto the TSP axis. Every "
        "rank holds 1/D of every expert (megatron-core's layout for --expert-tensor-parallel-size "
        "D --expert-model-parallel-size 1, which the launcher sets; checkpoints are TP=D+SP's "
        "with ETP=D), tokens never leave their rank (no dispatcher all-gather / all-to-all) and "
        "each expert's weight shards circulate on the TSP MLP's P2P ring. Pays off when a layer "
        "has many tokens and few experts (docs/moe.md).",
    )
    group.add_argument(
        "--tsp-dry-run",
        action="store_true",
        default=False,
        help="Parse and validate the command line through Megatron's argument code, build the "
        "model of one rank on the meta device, print the parallel layout, the per-rank "
        "parameter count and the zigzag chunks per rank, and exit without touching CUDA.",
    )
    group.add_argument(
        "--tsp-dry-run-world-size",
        type=int,
        default=None,
        metavar="N",
        help="World size the dry run assumes (default: $WORLD_SIZE if > 1, else D x "
        "pipeline-model-parallel size).",
    )
    group.add_argument(
        "--tsp-dry-run-rank",
        type=int,
        default=0,
        metavar="R",
        help="Global rank whose model the dry run builds (default 0).",
    )
    return parser


def tsp_size(args) -> Optional[int]:
    """The TSP group size requested on the command line, or None when TSP is off."""
    return getattr(args, "tensor_sequence_parallel_size", None)


def unsupported_combinations(args) -> List[str]:
    """Every reason the command line cannot run with TSP (empty: none). Pure; reads ``args``.

    The reasons are the rows of ``megatron_tsp.core.rejections`` (one table shared with the specs
    and the layers) refused by the parsed arguments.
    """
    return rejections.refusals_for_args(args, tsp_size(args), rejections.TSP) + (
        _document_problems(args)
    )


def _document_problems(args) -> List[str]:
    """Packed documents (``--reset-attention-mask``) need the tokens or the position ids on
    every stage that runs attention: the batch hook reads the documents from them."""
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if not getattr(args, "reset_attention_mask", False) or pp == 1:
        return []
    return [
        f"--reset-attention-mask with --pipeline-model-parallel-size={pp} cannot be combined "
        f"with {TSP_FLAG}={tsp_size(args)}: Megatron gives the later pipeline stages only "
        "labels and loss_mask (no tokens, no position ids), and TSP reads the documents from "
        "those instead of an S x S mask; run the packed documents with "
        "--pipeline-model-parallel-size 1"
    ]


def check_supported(args) -> None:
    rejections.raise_if_any(unsupported_combinations(args), TSPArgumentError, "the command line")


# Dests Megatron's ``parse_args`` acts on before ``validate_args`` runs: their rows are checked
# right after parsing (the launcher's parser hook), while the command line is still in hand.
ACTED_ON_BY_PARSE_ARGS = ("yaml_cfg",)


def check_before_megatron_parse_hooks(args) -> None:
    """Raise ``TSPArgumentError`` for the rows of ``ACTED_ON_BY_PARSE_ARGS`` that the requested
    mode refuses (no-op when neither TSP nor ``--tsp-mlp`` is requested)."""
    d = tsp_size(args)
    if d is not None and d < 1:  # before anything derives a world size from it
        raise TSPArgumentError(f"{TSP_FLAG} must be a positive integer, got {d}")
    if tsp_mlp_requested(args):
        mode, d = rejections.TSP_MLP, None
    elif tsp_size(args) is not None:
        mode, d = rejections.TSP, tsp_size(args)
    else:
        return
    problems = []
    for dest in ACTED_ON_BY_PARSE_ARGS:
        row = rejections.row_for(dest, mode)
        value = getattr(args, dest, None)
        if row.refuses(value, d):
            problems.append(row.message(value, d, mode))
    rejections.raise_if_any(problems, TSPArgumentError, "the command line", mode)


def translate_args(args) -> None:
    """Rewrite ``args`` in place for TSP, before Megatron's ``validate_args``.

    No-op when neither ``--tensor-sequence-parallel-size`` nor ``--tsp-mlp`` is given. Raises
    ``TSPArgumentError``.
    """
    for flag, dest in (
        (KV_GRAD_FP32_FLAG, "tsp_kv_grad_reduce_in_fp32"),
        (KV_GRAD_A2A_FLAG, "tsp_kv_grad_all_to_all"),
    ):
        _check_needs_tsp(args, flag, dest)
    if (
        getattr(args, "tsp_activation_sums_in_fp32", False)
        and tsp_size(args) is None
        and not tsp_mlp_requested(args)
    ):
        raise TSPArgumentError(
            f"{ACTIVATION_SUMS_FP32_FLAG} needs {TSP_FLAG} or {TSP_MLP_FLAG}: it sets how the "
            "TSP layers sum over their weight shards"
        )
    if getattr(args, "tsp_vocab_ring", "auto") != "auto" and tsp_size(args) is None:
        raise TSPArgumentError(
            f"{VOCAB_RING_FLAG}={args.tsp_vocab_ring} needs {TSP_FLAG}: it selects the TSP "
            "model's output layer and loss (other runs, --tsp-mlp included, use Megatron's)"
        )
    if getattr(args, "tsp_moe_ring", False) and tsp_size(args) is None:
        raise TSPArgumentError(
            f"{MOE_RING_FLAG} needs {TSP_FLAG}: it shards the experts over the TSP group and "
            "runs them on the TSP weight ring"
        )
    if tsp_mlp_requested(args):
        _translate_tsp_mlp_args(args)
        return
    d = tsp_size(args)
    if d is None:
        return
    if not isinstance(d, int) or d < 1:
        raise TSPArgumentError(f"{TSP_FLAG} must be a positive integer, got {d!r}")
    check_supported(args)
    if getattr(args, "tsp_moe_ring", False):
        try:  # the sizes as typed (None: not given)
            check_expert_layout(
                vars(args).get("num_experts"),
                getattr(args, "expert_tensor_parallel_size", None),
                d,
                getattr(args, "expert_model_parallel_size", None),
                moe_ring=True,
            )
        except ValueError as exc:
            raise TSPArgumentError(str(exc)) from exc
    user_spec = getattr(args, "spec", None)
    if user_spec and list(user_spec) != [SPEC_MODULE, SPEC_ATTR]:
        args.tsp_replaced_spec = list(user_spec)
    args.tensor_model_parallel_size = d
    args.sequence_parallel = d > 1
    # MoE under TSP folds the experts onto the expert-model-parallel ranks whole (expert-tensor-
    # parallel size 1); Megatron would default --expert-tensor-parallel-size to
    # --tensor-model-parallel-size (= D), which is the expert ring's layout (--tsp-moe-ring),
    # where it is left at D.
    if vars(args).get("num_experts") and getattr(args, "expert_tensor_parallel_size", 1) is None:
        args.expert_tensor_parallel_size = d if getattr(args, "tsp_moe_ring", False) else 1
    # TSP attention is causal by construction and never reads an attention mask: do not let
    # Megatron build an S x S mask per sample (69 GB at 128k), broadcast it and hand it around.
    if getattr(args, "create_attention_mask_in_dataloader", False):
        args.create_attention_mask_in_dataloader = False
        args.tsp_disabled_dataloader_mask = True
    args.spec = [SPEC_MODULE, SPEC_ATTR]


def _check_needs_tsp(args, flag: str, dest: str) -> None:
    if getattr(args, dest, False) and tsp_size(args) is None:
        # only TSP's attention has a dK/dV reduce-scatter (--tsp-mlp keeps Megatron's attention)
        hybrid = (
            f" ({TSP_MLP_FLAG} keeps Megatron's attention, which has none)"
            if tsp_mlp_requested(args)
            else ""
        )
        raise TSPArgumentError(
            f"{flag} needs {TSP_FLAG}: it sets how TSP attention's dK/dV are summed over the "
            f"sequence group{hybrid}"
        )


# ---------------------------------------------------------------------------------------------
# --tsp-mlp (TP+SP attention + TSP MLP)
# ---------------------------------------------------------------------------------------------
def tsp_mlp_requested(args) -> bool:
    return bool(getattr(args, "tsp_mlp", False))


def tsp_mlp_unsupported_combinations(args) -> List[str]:
    """Every reason the command line cannot run with ``--tsp-mlp`` (empty: none): the hybrid's
    rows of ``megatron_tsp.core.rejections``, and TP > 1 needs --sequence-parallel."""
    problems = rejections.refusals_for_args(args, None, rejections.TSP_MLP)
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if tp > 1 and not getattr(args, "sequence_parallel", False):
        problems.append(
            f"{TSP_MLP_FLAG} with --tensor-model-parallel-size={tp} needs --sequence-parallel: "
            "the TSP MLP ring works on the sequence-sharded activations TP+SP has"
        )
    return problems


def _translate_tsp_mlp_args(args) -> None:
    rejections.raise_if_any(
        tsp_mlp_unsupported_combinations(args),
        TSPArgumentError,
        "the command line",
        rejections.TSP_MLP,
    )
    user_spec = getattr(args, "spec", None)
    if user_spec and list(user_spec) != [SPEC_MODULE, TSP_MLP_SPEC_ATTR]:
        args.tsp_replaced_spec = list(user_spec)
    args.spec = [SPEC_MODULE, TSP_MLP_SPEC_ATTR]


def _check_validated_tsp_mlp_args(args) -> None:
    tp = args.tensor_model_parallel_size
    if tp > 1 and not args.sequence_parallel:
        raise TSPArgumentError(
            f"Megatron turned --sequence-parallel off during validation; {TSP_MLP_FLAG} with "
            f"--tensor-model-parallel-size={tp} needs sequence-parallel activations"
        )
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else None
    try:
        rejections.check_divisible(
            tp,
            rejections.TSP_MLP,
            num_attention_heads=getattr(args, "num_attention_heads", None),
            num_query_groups=groups,
            ffn_hidden_size=getattr(args, "ffn_hidden_size", None),
        )
    except rejections.TSPRejection as exc:
        raise TSPArgumentError(str(exc)) from exc


def check_validated_args(args) -> None:
    """Checks that need Megatron's derived values (after ``validate_args``)."""
    if tsp_mlp_requested(args):
        _check_validated_tsp_mlp_args(args)
        return
    d = tsp_size(args)
    if d is None:
        return
    try:
        _check_validated_args(args, d)
    except TSPArgumentError:
        raise
    except ValueError as exc:
        raise TSPArgumentError(str(exc)) from exc


def _check_validated_args(args, d: int) -> None:
    world = getattr(args, "world_size", None)
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    cp = getattr(args, "context_parallel_size", 1) or 1
    if world is not None:
        check_parallel_layout(world, d, pp, context_parallel_size=cp)
    if args.tensor_model_parallel_size != d:
        raise TSPArgumentError(
            f"Megatron changed --tensor-model-parallel-size to {args.tensor_model_parallel_size} "
            f"during validation; TSP needs it equal to {TSP_FLAG}={d}"
        )
    if d > 1 and not args.sequence_parallel:
        raise TSPArgumentError(
            f"Megatron turned --sequence-parallel off during validation; TSP with {TSP_FLAG}={d} "
            "needs sequence-parallel activations"
        )
    check_expert_layout(
        vars(args).get("num_experts"),
        getattr(args, "expert_tensor_parallel_size", None),
        d,
        getattr(args, "expert_model_parallel_size", None),
        moe_ring=bool(getattr(args, "tsp_moe_ring", False)),
    )
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else None
    check_model_shape(
        d,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=groups,
        ffn_hidden_size=getattr(args, "ffn_hidden_size", None),
        vocab_size=getattr(args, "padded_vocab_size", None),
        seq_length=getattr(args, "seq_length", None),
        hidden_size=getattr(args, "hidden_size", None),
        kv_channels=getattr(args, "kv_channels", None),
    )
    seq = getattr(args, "seq_length", None)
    if cp > 1 and seq is not None:
        # TSP x CP: the zigzag runs over the D*C ranks of the tensor-and-context group
        check_sequence_length(seq, d * cp, flag="--seq-length")


def strip_tsp_flags(argv: Sequence[str]) -> List[str]:
    """``argv`` without the TSP group's flags (for tools that run stock Megatron)."""
    flags_with_value = {
        TSP_FLAG,
        VOCAB_RING_FLAG,
        "--tsp-dry-run-world-size",
        "--tsp-dry-run-rank",
    }
    flags_alone = {
        "--tsp-dry-run",
        TSP_MLP_FLAG,
        KV_GRAD_FP32_FLAG,
        KV_GRAD_A2A_FLAG,
        ACTIVATION_SUMS_FP32_FLAG,
        MOE_RING_FLAG,
    }
    out: List[str] = []
    skip = False
    for item in argv:
        if skip:
            skip = False
            continue
        name = item.split("=", 1)[0]
        if name in flags_with_value:
            skip = "=" not in item
            continue
        if name in flags_alone:
            continue
        out.append(item)
    return out


def flags_in(argv: Iterable[str]) -> set:
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}
