"""TSP prefill -> Megatron TP=D decode, on one set of parameters.

``TSPInferenceEngine`` holds two views of the same weights:

- the TSP ``GPTModel`` (TSP layers, ``sequence_parallel=True``): prefill. Each rank embeds and
  processes only its zigzag chunks of the prompt; the TSP attention's inference hook writes the
  head-group owner's gathered K/V into megatron-core's ``StaticInferenceContext``.
- a stock megatron-core ``GPTModel`` with the local TP spec and ``sequence_parallel=False``,
  built on the meta device and then *tied* to the TSP model's parameter tensors (same names and
  shards by construction, no copy): decode, one token per step, Megatron's own TP=D forward
  reading the cache the prefill left — no resharding of weights or cache. It is built from the
  TSP model's own description (its config and the GPTModel arguments ``build_tsp_gpt_model``
  recorded) and checked against it field by field, rotary tables numerically
  (``check_decode_model``): RoPE scaling, interpolation and the rest cannot differ silently
  between prefill and decode.

TSP x CP (a model built with ``context_parallel_size`` C > 1): the prefill runs over the whole
sequence group (D*C ranks, every rank 1/(D*C) of the prompt, each head group's K/V gathered over
all of them), and the cache ends on the TSP group of CP rank 0, exactly where a TP=D decode of
that group reads it; decode runs there. Decode is not spread over CP: one token per step needs
every cached position of every layer, so a CP-split cache would add a cross-node log-sum-exp
merge per layer to every token, to a step bound by latency; the cache a TP=D group holds is what
TP=D decode of the same prompt needs anyway. The other CP ranks keep no cache and receive the
result (tokens, prefill logits) from CP rank 0.

Prompt handling: the prefilled slice is padded at the end to a multiple of 2D (causal attention
keeps padding invisible to real tokens; padded cache rows are overwritten by the first decode
steps before anything reads them). A batch whose prompts differ in length is prefilled up to the
shortest prompt; the remaining prompt tokens are fed through decode steps (teacher-forced), as
megatron-core's static text generation does. A prefilled slice shorter than 2D tokens runs
Megatron's own TP prefill instead. ``prefill_chunk_tokens`` splits a long prefill into chunks:
each chunk's queries attend to the cache plus the chunk itself.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_tsp.core import zigzag
from megatron_tsp.core.layout import TSPLayout, padded_length
from megatron_tsp.core.parallel_state import get_tensor_sequence_parallel_group
from megatron_tsp.inference.sampling import SamplingParams, select_next

PREFILL_MODES = ("auto", "tsp", "tp")
SUPPORTED_POSITIONS = ("rope", "learned_absolute", "none")


@dataclass
class GenerationResult:
    tokens: List[List[int]]  # generated tokens per prompt (stop token included when hit)
    prefill_logits: torch.Tensor  # [b, V] logits after the batched prefill's last token
    prefill_mode: str  # "tsp" or "tp"
    prefill_tokens: int  # prompt tokens prefilled (all rows, padding excluded)
    prefill_seconds: float
    decode_tokens: int  # tokens produced by decode steps (all rows, forced prompt tokens included)
    decode_seconds: float
    context: object = field(repr=False, default=None)  # the StaticInferenceContext (KV cache)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


# GPTModel arguments that change what the model computes (parallel_output, pre/post_process and
# the loss options do not: the decode model sets its own).
MATH_GPT_ARGS = (
    "position_embedding_type",
    "share_embeddings_and_output_weights",
    "rotary_percent",
    "rotary_base",
    "rope_scaling",
    "rope_scaling_factor",
    "seq_len_interpolation_factor",
)
# TransformerConfig fields the decode model sets differently on purpose: decode runs Megatron's
# plain TP=D path (one token per step cannot be split along the sequence; under TSP x CP one TSP
# group decodes).
DECODE_CONFIG_CHANGES = {"sequence_parallel": False, "context_parallel_size": 1}


def gpt_model_args(model) -> dict:
    """The ``MATH_GPT_ARGS`` ``model`` was built with.

    ``build_tsp_gpt_model`` records its GPTModel arguments on the model (``tsp_gpt_kwargs``); for
    a GPTModel built otherwise they are read back from what GPTModel keeps (its attributes and its
    rotary embedding). ``rope_scaling_factor`` is not kept by megatron-core: such a model's value
    is Megatron's default, and ``check_decode_model`` compares the rotary tables, so a different
    factor is an error naming it rather than a silent difference."""
    recorded = getattr(model, "tsp_gpt_kwargs", None)
    if recorded is not None:
        return {k: recorded[k] for k in MATH_GPT_ARGS if k in recorded}
    out = {
        "position_embedding_type": getattr(model, "position_embedding_type", "learned_absolute"),
        "share_embeddings_and_output_weights": model.share_embeddings_and_output_weights,
    }
    if out["position_embedding_type"] == "rope":
        out.update(
            rotary_percent=model.rotary_percent,
            rotary_base=model.rotary_base,
            rope_scaling=bool(getattr(model, "rotary_scaling", False)),
            seq_len_interpolation_factor=getattr(
                model.rotary_pos_emb, "seq_len_interpolation_factor", None
            ),
        )
    return out


def _differs(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return not (torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b))
    if a is b:
        return False
    try:
        return bool(a != b)
    except Exception:  # noqa: BLE001 - objects without a usable comparison: identity decides
        return True


def check_decode_model(tsp_model, decode_model, gpt_kwargs=None) -> None:
    """Raise ``ValueError`` naming the first field in which ``decode_model`` computes something
    else than ``tsp_model``: every ``TransformerConfig`` field (but ``DECODE_CONFIG_CHANGES``),
    the GPTModel-level settings, and the rotary tables compared numerically over the whole
    ``max_sequence_length`` (base, percent, Llama-3 scaling and factor, interpolation)."""
    a, b = tsp_model.config, decode_model.config
    for f in dataclasses.fields(a):
        if f.name in DECODE_CONFIG_CHANGES:
            continue
        if _differs(getattr(a, f.name), getattr(b, f.name)):
            raise ValueError(
                f"decode model differs from the TSP prefill model in config.{f.name}: "
                f"{getattr(b, f.name)!r} vs {getattr(a, f.name)!r}"
            )
    for name in (
        "vocab_size",
        "max_sequence_length",
        "position_embedding_type",
        "share_embeddings_and_output_weights",
        "rotary_percent",
        "rotary_base",
        "rotary_scaling",
    ):
        mine, theirs = getattr(tsp_model, name, None), getattr(decode_model, name, None)
        if _differs(mine, theirs):
            arg = "rope_scaling" if name == "rotary_scaling" else name
            raise ValueError(
                f"decode model differs from the TSP prefill model in {arg}: {theirs!r} vs {mine!r}"
            )
    rope_a = getattr(tsp_model, "rotary_pos_emb", None)
    rope_b = getattr(decode_model, "rotary_pos_emb", None)
    if (rope_a is None) != (rope_b is None):
        raise ValueError("decode model differs from the TSP prefill model in rotary_pos_emb")
    if rope_a is None:
        return
    factor = ("seq_len_interpolation_factor", "rotary_interleaved")
    for name in factor:
        if _differs(getattr(rope_a, name, None), getattr(rope_b, name, None)):
            raise ValueError(
                f"decode model differs from the TSP prefill model in {name}: "
                f"{getattr(rope_b, name, None)!r} vs {getattr(rope_a, name, None)!r}"
            )
    length = tsp_model.max_sequence_length
    table_a, table_b = whole_rope_table(rope_a, length), whole_rope_table(rope_b, length)
    if table_a.shape != table_b.shape or not torch.equal(table_a, table_b):
        given = gpt_kwargs or {}
        raise ValueError(
            "decode model differs from the TSP prefill model in its rotary table "
            f"(rotary_pos_emb({length})): rope_scaling_factor / rotary_base / rotary_percent; "
            f"decode model built with {given!r}, prefill model "
            f"{gpt_model_args(tsp_model)!r}. Build the model with build_tsp_gpt_model (it "
            "records its arguments) or pass the same arguments to TSPInferenceEngine"
        )


def whole_rope_table(rope, length: int) -> torch.Tensor:
    """Megatron's RoPE table of ``length`` positions, all of them: ``RotaryEmbedding.forward``
    returns only this CP rank's slice when its CP group has more than one rank."""
    get_emb = getattr(rope, "get_emb", None)
    return (get_emb(length) if get_emb is not None else rope(length)).cpu()


def sequence_group_of(model, tsp_group):
    """The sequence group the model's TSP attention layers gather K/V over (TSP x CP: D*C ranks;
    the TSP group without CP)."""
    groups = {
        id(m.seq_group): m.seq_group
        for m in model.modules()
        if getattr(m, "tsp_group", None) is not None and hasattr(m, "seq_group")
    }
    if len(groups) > 1:
        raise ValueError("the model's TSP attention layers use different sequence groups")
    return next(iter(groups.values())) if groups else tsp_group


def build_decode_model(tsp_model, **gpt_kwargs):
    """Stock megatron-core TP=D ``GPTModel`` sharing ``tsp_model``'s parameter tensors.

    Built from ``tsp_model``'s own description: its config (with ``DECODE_CONFIG_CHANGES``) and
    its GPTModel arguments (``gpt_model_args``); ``gpt_kwargs`` override them, and the result is
    checked against ``tsp_model`` (``check_decode_model``), so an override that changes the math
    is an error naming the field. Built on the meta device (no parameter memory), then every
    parameter is replaced by the TSP model's tensor of the same name; any name or shape mismatch
    raises.
    """
    from megatron.core.models.gpt import GPTModel

    from megatron_tsp.core.specs import get_gpt_block_local_sp_spec

    config = dataclasses.replace(tsp_model.config, **DECODE_CONFIG_CHANGES)
    kwargs = gpt_model_args(tsp_model)
    kwargs.update(gpt_kwargs)
    kwargs["parallel_output"] = False  # decode needs the full vocabulary on every rank
    with torch.device("meta"):
        decode = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_block_local_sp_spec(config),
            vocab_size=tsp_model.vocab_size,
            max_sequence_length=tsp_model.max_sequence_length,
            **kwargs,
        )
    source = dict(tsp_model.named_parameters())
    for name, param in list(decode.named_parameters()):
        if name not in source or source[name].shape != param.shape:
            raise ValueError(
                f"decode model parameter {name} {tuple(param.shape)} has no "
                f"counterpart in the TSP model (pass the same GPTModel arguments)"
            )
        owner = decode.get_submodule(name.rsplit(".", 1)[0]) if "." in name else decode
        owner._parameters[name.rsplit(".", 1)[-1]] = source[name]
    if set(source) != {n for n, _ in decode.named_parameters()}:
        raise ValueError(
            "TSP and decode models have different parameter sets: "
            f"{sorted(set(source) ^ {n for n, _ in decode.named_parameters()})}"
        )
    rope = getattr(decode, "rotary_pos_emb", None)
    if rope is not None:
        # Under TSP x CP the rotary embedding took the CP group from the global state and would
        # return this CP rank's slice of the table; decode runs unsplit on one TSP group.
        rope.cp_group = None
    _check_materialised(decode)
    check_decode_model(tsp_model, decode, kwargs)
    return decode


def _check_materialised(model) -> None:
    for name, buf in model.named_buffers():
        if buf.is_meta:
            raise ValueError(f"decode model buffer {name} was not materialised")
    for mod_name, mod in model.named_modules():
        for attr, value in vars(mod).items():
            if torch.is_tensor(value) and value.is_meta:
                raise ValueError(f"decode model tensor {mod_name}.{attr} is on the meta device")


def local_embedding(model, ids, positions) -> torch.Tensor:
    """This rank's zigzag tokens' embeddings ``[S/D, b, h]`` (``ids``/``positions`` [b, S] in
    permuted order), as Megatron's sequence-parallel embedding computes them, but without its
    full-sequence ``[S, b, h]`` partial sums: for each owner r, every rank looks up rank r's
    tokens in its vocabulary shard (zero rows elsewhere) and the partials are SUM-reduced onto r.
    Communication: D reduces of ``[S/D, b, h]`` (the bytes of one reduce-scatter). Every token's
    word embedding comes from exactly one shard, so the sums are exact. Eval mode (no dropout)."""
    emb = model.embedding
    word = emb.word_embeddings
    if getattr(emb, "tokentype_embeddings", None) is not None:
        raise ValueError("TSP prefill does not support token-type embeddings")
    group = (
        word.tp_group
        if getattr(word, "tp_group", None) is not None
        else (get_tensor_sequence_parallel_group())
    )
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    local_len = ids.shape[1] // size
    mine = None
    for r in range(size):
        owner_ids = ids[:, r * local_len : (r + 1) * local_len]
        outside = (owner_ids < word.vocab_start_index) | (owner_ids >= word.vocab_end_index)
        rows = (owner_ids - word.vocab_start_index).masked_fill(outside, 0)
        part = torch.nn.functional.embedding(rows, word.weight)
        part = part.masked_fill(outside.unsqueeze(-1), 0).transpose(0, 1).contiguous()
        if size > 1:
            dist.reduce(part, dst=dist.get_global_rank(group, r), group=group)
        if r == rank:
            mine = part
        del part
    if emb.add_position_embedding:
        local_pos = positions[:, rank * local_len : (rank + 1) * local_len]
        mine = mine + emb.position_embeddings(local_pos).transpose(0, 1)
    if emb.config.fp32_residual_connection:
        mine = mine.float()
    return mine


def prefill_slice(
    model, ids, positions, context, rotary_table, size: int, cp_rank: int = 0, cp_size: int = 1
) -> torch.Tensor:
    """One TSP prefill pass of the TSP ``GPTModel`` over ``ids`` [b, S] (natural order, S a
    multiple of 2 x ``size``) at cache offset ``context.sequence_len_offset``; returns this rank's
    final-norm hidden states of its zigzag chunks, ``[S/size, b, h]``. The layers' KV caches are
    filled. ``size``: the sequence group's ranks (D, or D*C under TSP x CP of ``cp_size`` C,
    where CP rank ``cp_rank``'s TSP group embeds slice ``cp_rank`` of the gathered order)."""
    ids, positions = zigzag.permute(ids, size, dim=1), zigzag.permute(positions, size, dim=1)
    if cp_size > 1:
        width = ids.shape[1] // cp_size
        ids = ids.narrow(1, cp_rank * width, width)
        positions = positions.narrow(1, cp_rank * width, width)
    local = local_embedding(model, ids, positions)
    return model.decoder(
        hidden_states=local,
        attention_mask=None,
        inference_context=context,
        rotary_pos_emb=rotary_table,
    )


class TSPInferenceEngine:
    """Generate from a TSP-built ``GPTModel`` (see module docstring).

    The decode model is built from ``tsp_model``'s description (``build_decode_model``);
    ``gpt_kwargs`` are only needed for a GPTModel not built by ``build_tsp_gpt_model`` whose
    ``rope_scaling_factor`` is not Megatron's default, and are checked like the rest.

    Every rank of the TSP group calls ``generate`` with the same arguments. Arguments are checked
    before any collective, so a bad request raises the same ``ValueError`` on every rank and the
    engine stays usable.
    """

    def __init__(self, tsp_model, group=None, **gpt_kwargs):
        config = tsp_model.config
        position = getattr(tsp_model, "position_embedding_type", "learned_absolute")
        if position not in SUPPORTED_POSITIONS:
            raise ValueError(
                f"position_embedding_type={position!r}: TSP inference supports "
                f"{', '.join(SUPPORTED_POSITIONS)}"
            )
        if config.flash_decode:
            raise ValueError(
                "--flash-decode is not supported by TSP prefill (its cache holds keys after RoPE)"
            )
        if not (tsp_model.pre_process and tsp_model.post_process):
            raise ValueError(
                "TSP inference needs the whole model on each rank "
                "(--pipeline-model-parallel-size 1)"
            )
        self.tsp_model = tsp_model.eval()
        self.decode_model = build_decode_model(tsp_model, **gpt_kwargs).eval()
        self.group = group if group is not None else get_tensor_sequence_parallel_group()
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        # TSP x CP: the prefill runs over the sequence group (D*C ranks), decode on CP rank 0.
        self.seq_group = sequence_group_of(tsp_model, self.group)
        self.seq_size = dist.get_world_size(self.seq_group)
        self.cp_size = self.seq_size // self.size
        self.cp_rank = dist.get_rank(self.seq_group) // self.size
        self.serving = self.cp_rank == 0
        self.vocab_size = tsp_model.vocab_size
        self.max_positions = tsp_model.max_sequence_length
        self.device = next(tsp_model.parameters()).device
        self.position = position

    # ------------------------------------------------------------------ checks
    def check_request(
        self, prompts, max_new_tokens, sampling, stop_tokens, prefill, prefill_chunk_tokens
    ) -> None:
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts: need a non-empty list of token-id lists")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
            bad = [t for t in p if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompts[{i}] has token ids {bad[:4]} outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 0")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt length {longest} + max_new_tokens={max_new_tokens} = "
                f"{longest + max_new_tokens} exceeds the model's max_sequence_length="
                f"{self.max_positions} (--max-position-embeddings)"
            )
        sampling.validate(self.vocab_size)
        for t in stop_tokens:
            if not 0 <= int(t) < self.vocab_size:
                raise ValueError(
                    f"stop_tokens: {t} is outside the vocabulary [0, {self.vocab_size})"
                )
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill={prefill!r}: must be one of {PREFILL_MODES}")
        if prefill_chunk_tokens is not None:
            step = 2 * self.seq_size
            if (
                not isinstance(prefill_chunk_tokens, int)
                or prefill_chunk_tokens < step
                or prefill_chunk_tokens % step
            ):
                cp = f" x context-parallel size {self.cp_size}" if self.cp_size > 1 else ""
                raise ValueError(
                    f"prefill_chunk_tokens={prefill_chunk_tokens!r}: must be a positive multiple "
                    f"of 2 x tensor-sequence-parallel size{cp} = {step}"
                )
            if prefill == "tp":
                raise ValueError(
                    "prefill_chunk_tokens needs prefill='tsp' or 'auto' (Megatron's "
                    "static TP path prefills in one pass)"
                )

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: Optional[SamplingParams] = None,
        stop_tokens: Sequence[int] = (),
        prefill: str = "auto",
        prefill_chunk_tokens: Optional[int] = None,
    ) -> GenerationResult:
        """Prefill the prompts (TSP, or TP when shorter than 2D tokens -- 2DC under TSP x CP -- or
        ``prefill='tp'``), then decode up to ``max_new_tokens`` per prompt under Megatron TP=D
        (on CP rank 0's TSP group under TSP x CP; every rank returns the same result)."""
        sampling = sampling or SamplingParams()
        self.check_request(
            prompts, max_new_tokens, sampling, stop_tokens, prefill, prefill_chunk_tokens
        )
        from megatron.core.inference.contexts import StaticInferenceContext

        batch = len(prompts)
        lengths = [len(p) for p in prompts]
        shortest, longest = min(lengths), max(lengths)
        mode = prefill
        if mode == "auto":
            mode = "tsp" if shortest >= 2 * self.seq_size else "tp"
        chunk = prefill_chunk_tokens or shortest
        padded_end = self._padded_end(shortest, chunk) if mode == "tsp" else shortest
        context = StaticInferenceContext(batch, max(padded_end, longest + max_new_tokens))
        tokens = torch.zeros(batch, max(longest, padded_end), dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.as_tensor([int(t) for t in p], dtype=torch.long)
        tokens = tokens.to(self.device)

        self._sync()
        start = time.perf_counter()
        logits = None  # under TSP x CP a TP prefill runs on CP rank 0 only
        if mode == "tsp":
            logits = self._prefill_tsp(tokens, shortest, chunk, context)
        elif self.serving:
            logits = self._prefill_tp(tokens[:, :shortest], context)
        self._sync()
        prefill_s = time.perf_counter() - start
        context.sequence_len_offset = shortest
        result = GenerationResult(
            tokens=[[] for _ in prompts],
            prefill_logits=logits,
            prefill_mode=mode,
            prefill_tokens=shortest * batch,
            prefill_seconds=prefill_s,
            decode_tokens=0,
            decode_seconds=0.0,
            context=context,
        )
        if max_new_tokens > 0 and self.serving:
            self._decode(
                prompts,
                tokens,
                lengths,
                logits,
                max_new_tokens,
                sampling,
                set(int(t) for t in stop_tokens),
                context,
                result,
            )
        self._share_result(result)
        return result

    def _share_result(self, result: GenerationResult) -> None:
        """TSP x CP: CP rank 0 decoded; every other rank receives its tokens, logits and counts
        (one object broadcast over the sequence group, from its rank 0)."""
        if self.cp_size == 1:
            return
        logits = result.prefill_logits.cpu() if self.serving else None
        shared = [result.tokens, logits, result.decode_tokens, result.decode_seconds]
        dist.broadcast_object_list(
            shared,
            src=dist.get_global_rank(self.seq_group, 0),
            group=self.seq_group,
            device=self.device if self.device.type == "cuda" else None,
        )
        if not self.serving:
            result.tokens, logits, result.decode_tokens, result.decode_seconds = shared
            result.prefill_logits = logits.to(self.device)

    # ------------------------------------------------------------------ prefill
    def _padded_end(self, length: int, chunk: int) -> int:
        step = 2 * self.seq_size
        last_start = ((length - 1) // chunk) * chunk
        return last_start + -(-(length - last_start) // step) * step

    def _prefill_tp(self, tokens, context):
        """Megatron's own TP=D prefill (static context at offset 0, causal mask)."""
        positions = self._positions(0, tokens.shape[1], tokens.shape[0])
        context.enable_prefill_mode()
        logits = self.decode_model(
            tokens, positions, None, inference_context=context, runtime_gather_output=True
        )
        return logits[:, -1]

    def _prefill_tsp(self, tokens, length, chunk, context):
        """Chunks [o, o + chunk) of the first ``length`` tokens, each padded to a multiple of 2D
        (2DC under TSP x CP), through the TSP model; returns the full-vocabulary logits of token
        ``length - 1``."""
        model, size = self.tsp_model, self.seq_size
        batch = tokens.shape[0]
        table = None
        if self.position == "rope":
            table = whole_rope_table(model.rotary_pos_emb, context.max_sequence_length)
            table = table.to(self.device)
        context.enable_prefill_mode()
        hidden = None
        for start in range(0, length, chunk):
            real = min(chunk, length - start)
            padded = padded_length(real, size)
            ids = tokens[:, start : start + padded]
            positions = self._positions(start, padded, batch)
            context.sequence_len_offset = start
            local = prefill_slice(
                model, ids, positions, context, table, size, self.cp_rank, self.cp_size
            )
            if start + chunk >= length:
                hidden = self._token_hidden(local, real - 1, padded)
        return self._full_logits(hidden)

    def _positions(self, start: int, count: int, batch: int) -> torch.Tensor:
        """Natural positions; padding beyond the model's table is clamped (its outputs and cache
        rows are never read)."""
        pos = torch.arange(start, start + count, device=self.device).clamp_(
            max=self.max_positions - 1
        )
        return pos.unsqueeze(0).expand(batch, count)

    def _token_hidden(self, local, index: int, seq: int) -> torch.Tensor:
        """Hidden state [b, h] of natural position ``index`` of a zigzag-split slice of ``seq``
        tokens, broadcast over the sequence group from the rank that holds it."""
        size = self.seq_size
        owner, row = TSPLayout(size, seq).owner(index)
        if dist.get_rank(self.seq_group) == owner:
            hidden = local[row].contiguous()
        else:
            hidden = torch.empty(local.shape[1:], dtype=local.dtype, device=local.device)
        if size > 1:
            dist.broadcast(
                hidden, src=dist.get_global_rank(self.seq_group, owner), group=self.seq_group
            )
        return hidden

    def _full_logits(self, hidden) -> torch.Tensor:
        """[b, V] from final-norm hidden states [b, h], through the decode model's output layer
        (the same parameters; vocabulary shards gathered)."""
        model = self.decode_model
        weight = (
            model.shared_embedding_or_output_weight()
            if model.share_embeddings_and_output_weights
            else None
        )
        logits, _ = model.output_layer(
            hidden.unsqueeze(0), weight=weight, runtime_gather_output=True
        )
        return logits[0]

    # ------------------------------------------------------------------ decode
    def _decode(
        self, prompts, tokens, lengths, logits, max_new_tokens, sampling, stops, context, result
    ) -> None:
        batch = len(prompts)
        shortest = min(lengths)
        generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        produced = [0] * batch
        done = [False] * batch
        context.enable_decode_mode()
        start = time.perf_counter()
        position = shortest  # natural position of the token chosen from ``logits``
        steps = 0
        while True:
            chosen = self._select(logits, sampling, generator)
            next_ids = []
            for i in range(batch):
                if position < lengths[i]:  # still inside this prompt: teacher-forced
                    next_ids.append(int(tokens[i, position]))
                    continue
                tok = int(chosen[i])
                next_ids.append(tok)
                if not done[i]:
                    result.tokens[i].append(tok)
                    produced[i] += 1
                    if tok in stops or produced[i] >= max_new_tokens:
                        done[i] = True
            if all(done):
                break
            ids = torch.tensor(next_ids, dtype=torch.long, device=self.device).unsqueeze(1)
            pos = torch.full((batch, 1), position, dtype=torch.long, device=self.device)
            logits = self.decode_model(
                ids, pos, None, inference_context=context, runtime_gather_output=True
            )[:, -1]
            context.sequence_len_offset += 1
            position += 1
            steps += 1
        self._sync()
        result.decode_seconds = time.perf_counter() - start
        result.decode_tokens = steps * batch

    def _select(self, logits, sampling, generator) -> torch.Tensor:
        """Rank 0 of the group chooses, everyone receives the same tokens."""
        chosen = select_next(logits, sampling, generator).to(torch.long).contiguous()
        if self.size > 1:
            dist.broadcast(chosen, src=dist.get_global_rank(self.group, 0), group=self.group)
        return chosen

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
