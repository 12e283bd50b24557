"""``GPTModel``'s output layer and loss under TSP: the vocabulary ring (``layers.vocab_ring``).

Megatron's ``GPTModel._postprocess`` runs the output layer (a ``ColumnParallelLinear`` that
all-gathers the sequence-parallel hidden states) and ``compute_language_model_loss`` (the
vocab-parallel cross-entropy). ``install(model)`` wraps that method on one model instance so that
a training or evaluation step with labels computes the per-token losses of each rank's own
tokens on the vocabulary ring instead, then all-gathers those losses ([s, b] fp32) so the model
returns [b, S] in the same order as under TP+SP: Megatron's loss function, loss mask and
per-token-loss accounting see exactly what they see under TP+SP. Parameters, their names, the
output weight's sharding and checkpoints are untouched (the ring reads ``output_layer.weight``,
or the embedding's under ``--share-embeddings-and-output-weights``).

The default policy, "auto", takes the ring for a micro-batch only where it receives no more bytes
than Megatron's output layer (``ring_receives_fewer_bytes``: its bytes are the vocabulary's
weights, Megatron's are the tokens' hidden states; in bf16 at h = 4096 a 32,768-row padded
vocabulary takes it from 43,656 tokens per micro-batch, Llama-3's 128,256 rows from 170,869);
"always" and "never" force it.

Every other call keeps Megatron's path: logits without labels (generation), inference mode,
multi-token prediction, packed sequences, 0.19's ``output_processor`` and MuP logit scaling. The
loss gather's backward takes this rank's slice of the (replicated) loss gradient, Megatron's
``gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)``.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from megatron_tsp.core.layers.module_hooks import run_forward_pre_hooks
from megatron_tsp.core.layers.precision import ring_grad_dtype
from megatron_tsp.core.layers.vocab_ring import vocab_ring_cross_entropy
from megatron_tsp.core.parallel_state import resolve_group

INSTALLED = "_tsp_vocab_ring"  # the model attribute holding an installed ring's policy
# "auto": the ring for a micro-batch whose tokens make it receive no more bytes than Megatron's
# output layer (``ring_receives_fewer_bytes``), Megatron's otherwise; "always"; "never"
POLICIES = ("auto", "always", "never")


def ring_receives_fewer_bytes(
    tokens: int, padded_vocab: int, hidden: int, dtype_bytes: int, grad_bytes: int
) -> bool:
    """Whether the vocabulary ring receives no more bytes than Megatron's output layer for a
    micro-batch of ``tokens`` tokens (both per rank, both scaled by (D-1)/D, which cancels).
    Ring: the V·h weight shards forward and again backward, the V·h gradient accumulator
    (``grad_bytes``) and the tokens' fp32 losses. Megatron: the hidden states all-gathered
    forward and again backward, their gradient reduce-scattered (3·T·h) and the cross-entropy's
    three all-reduces of [T] fp32. ``formulas.head_comm`` counts the same terms."""
    ring = padded_vocab * hidden * (2 * dtype_bytes + grad_bytes) + 4 * tokens
    gather = 3 * tokens * hidden * dtype_bytes + 3 * 2 * 4 * tokens
    return ring <= gather


def ring_taken(
    policy: str, tokens: int, padded_vocab: int, hidden: int, dtype_bytes: int, grad_bytes: int
) -> bool:
    """Whether a micro-batch of ``tokens`` tokens computes its loss on the ring under ``policy``
    (``POLICIES``): the one decision, asked by the layer at run time, by the estimator's
    formulas and planner, and by the launch log and the dry run."""
    if _checked(policy) != "auto":
        return policy == "always"
    return ring_receives_fewer_bytes(tokens, padded_vocab, hidden, dtype_bytes, grad_bytes)


def _checked(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"vocabulary ring policy {policy!r}: choose one of {POLICIES}")
    return policy


def describe(
    policy: str, padded_vocab: int, hidden: int, dtype_bytes: int, tokens: Optional[int] = None
) -> str:
    """The output layer a TSP run uses under ``policy``, in words (the launch log and the dry
    run); with ``tokens`` (a micro-batch's), the one "auto" picks for it. The gradient
    accumulator is taken as fp32 (bf16 / fp32 runs)."""
    ring = (
        "TSP vocabulary ring (the output weight's vocabulary shards circulate on the P2P ring; "
        "each rank's own tokens' cross-entropy over the whole vocabulary, in place of "
        "Megatron's output-layer gather and its vocab-parallel cross-entropy, fused or not)"
    )
    megatron = "Megatron's output layer and vocab-parallel cross-entropy"
    if policy != "auto":
        return f"{ring if policy == 'always' else megatron} (--tsp-vocab-ring {policy})"
    crossover = crossover_tokens(padded_vocab, hidden, dtype_bytes, 4)
    if tokens is None:
        return (
            f"{ring} for micro-batches of >= {crossover} tokens, where it receives fewer bytes; "
            "Megatron's below (--tsp-vocab-ring auto)"
        )
    chosen = ring_taken(policy, tokens, padded_vocab, hidden, dtype_bytes, 4)
    return (
        f"{ring if chosen else megatron}: micro-batch of {tokens} tokens, the ring receives "
        f"fewer bytes from {crossover} (--tsp-vocab-ring auto)"
    )


def crossover_tokens(padded_vocab: int, hidden: int, dtype_bytes: int, grad_bytes: int) -> int:
    """The fewest tokens per micro-batch for which ``ring_receives_fewer_bytes`` holds."""
    ring_weights = padded_vocab * hidden * (2 * dtype_bytes + grad_bytes)
    # per token the gather costs 3·h·dtype_bytes + 24 (its fp32 all-reduces), the ring 4 (its
    # fp32 loss gather): ring_weights + 4 T <= (3 h b + 24) T
    return -(-ring_weights // (3 * hidden * dtype_bytes + 20))


def install(model, group=None, policy: str = "auto") -> None:
    """Compute ``model``'s training / evaluation loss on the vocabulary ring (module docstring)
    under ``policy`` (``POLICIES``; "never" leaves the model as it is). ``group``: the TSP group
    (default: the model's tensor-parallel group). Idempotent; a model without an output layer on
    this pipeline stage is left as it is."""
    if _checked(policy) == "never" or is_installed(model):
        return
    if not getattr(model, "post_process", False):
        return
    group = group if group is not None else resolve_group(getattr(model, "pg_collection", None))
    original = model._postprocess
    signature = inspect.signature(original)

    def _postprocess(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        if not _ring_applies(model, arguments, policy, group.size()):
            return original(*args, **kwargs)
        return ring_loss(model, arguments["hidden_states"], arguments["labels"], group)

    model._postprocess = _postprocess
    setattr(model, INSTALLED, policy)


def is_installed(model) -> bool:
    return bool(getattr(model, INSTALLED, False))


def policy_of(model) -> str:
    """The installed policy, "never" when none is."""
    return getattr(model, INSTALLED, None) or "never"


def _ring_applies(model, arguments, policy: str, group_size: int) -> bool:
    labels = arguments.get("labels")
    if labels is None or arguments.get("mtp_in_postprocess"):
        return False
    for name in ("inference_context", "inference_params", "packed_seq_params", "output_processor"):
        if arguments.get(name) is not None:
            return False
    config = model.config
    if getattr(config, "mtp_num_layers", None) or getattr(config, "use_mup", False):
        return False
    if _inference_mode_active():
        return False
    hidden, weight = arguments["hidden_states"], output_weight(model)
    return ring_taken(
        policy,
        labels.numel(),
        weight.shape[0] * group_size,
        hidden.shape[-1],
        hidden.element_size(),
        ring_grad_dtype([weight], _accumulates_into_main_grad(model)).itemsize,
    )


def _accumulates_into_main_grad(model) -> bool:
    """Megatron's ``gradient_accumulation_fusion`` for the output layer."""
    return bool(
        getattr(
            model.output_layer,
            "gradient_accumulation_fusion",
            model.config.gradient_accumulation_fusion,
        )
    )


def _inference_mode_active() -> bool:
    """megatron-core 0.19's process-wide inference switch (absent in 0.16)."""
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        return False
    is_active = getattr(InferenceMode, "is_active", None)
    return bool(is_active()) if is_active is not None else False


def output_weight(model) -> torch.Tensor:
    """The [V/D, h] weight the output layer applies (the embedding's when they are tied)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def ring_loss(model, hidden: torch.Tensor, labels: torch.Tensor, group) -> torch.Tensor:
    """[b, S] per-token losses from this rank's hidden states [s, b, h] and the batch's labels
    [b, S] (the order Megatron's sequence-parallel all-gather gives: rank r's tokens are columns
    [r s, (r+1) s))."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    size, rank = group.size(), group.rank()
    s = hidden.shape[0]
    if labels.shape[1] != size * s:
        raise ValueError(
            f"vocab ring: labels cover {labels.shape[1]} tokens, the group's hidden states "
            f"{size} x {s}"
        )
    if model.output_layer is not None:  # e.g. DDP's --overlap-param-gather wait
        run_forward_pre_hooks(model.output_layer)
    local_labels = labels[:, rank * s : (rank + 1) * s].transpose(0, 1)
    losses = vocab_ring_cross_entropy(
        hidden,
        output_weight(model),
        local_labels,
        group,
        accumulate_into_main_grad=_accumulates_into_main_grad(model),
        sums_in_fp32=getattr(model.config, "tsp_activation_sums_in_fp32", False),
    )
    gathered = gather_from_sequence_parallel_region(
        losses, tensor_parallel_output_grad=False, group=group
    )
    return gathered.transpose(0, 1).contiguous()
