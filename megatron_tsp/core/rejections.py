"""Every Megatron setting TSP refuses, in one declarative table.

A row names the flag as typed on Megatron-LM's command line, the argparse ``dest`` it sets, the
``TransformerConfig`` field that carries the same setting into megatron-core (when there is one),
the condition under which TSP refuses it, and why. The table is read by:

* the launcher, before Megatron's ``validate_args``
  (``megatron_lm.arguments.unsupported_combinations`` -> ``refusals_for_args``);
* ``validation.check_parallel_layout`` / ``check_transformer_config`` and the spec getters in
  ``specs.py`` (-> ``refusals_for_config`` / ``refusals_for_values``), for megatron-core users who
  build TSP models without Megatron-LM's argument code;
* the layers (``TSPSelfAttention`` / ``TSPMLP`` check the rows of their ``layer``), so a config that
  reaches them around the specs still fails by name;
* ``docs/megatron-lm.md`` (``markdown_table()``; a test keeps the page current).

Rows belong to modes: full TSP, the hybrid ``--tsp-mlp`` (TP+SP attention with the TSP MLP ring)
and, for the shape rows only (heads / query groups / FFN / vocabulary divisible by D), plain TP (the
estimator's baselines). Shape rows are ``VALIDATED``: they read values Megatron derives in
``validate_args`` and are checked by ``validation.check_model_shape``, the configs and the layers.

Messages name the flag, the value and the TSP size: ``--num-experts=8 cannot be combined with
--tensor-sequence-parallel-size=4: ...``. Tests check that every flag exists in the argument
parsers of the Megatron-LM trees listed in ``versions`` (and only there) and every config field
in megatron-core's ``TransformerConfig``.

Not in the table on purpose (they work under TSP): ``--recompute-activations`` and selective
recompute of ``core_attn`` (mapped to TSP attention's recompute mode), full recompute, the
distributed optimizer, ``--overlap-grad-reduce``, ``--gradient-accumulation-fusion``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

TSP_FLAG = "--tensor-sequence-parallel-size"

# Modes the rows apply to. "tsp": full TSP (``--tensor-sequence-parallel-size D``). Helpers that add
# another TSP mode (the hybrid TP+SP attention + TSP MLP, ``--tsp-mlp``) register its flag in
# ``MODE_FLAGS``; a flag both modes refuse has one row, the mode's own reason (and condition, when
# it differs) in the row's ``also``; a flag only the hybrid refuses is in ``TSP_MLP_ROWS``; rows
# with one reason for several modes list them in ``modes``.
TSP = "tsp"
TSP_MLP = "tsp-mlp"
# Plain Megatron tensor parallelism (the estimator's TP / TP+SP / TPxCP baselines): only the
# divisibility rows apply (TSP holds exactly TP=D's shards, so the arithmetic is the same).
TP = "tp"
TP_FLAG = "--tensor-model-parallel-size"
MODE_FLAGS: Dict[str, str] = {TSP: TSP_FLAG, TSP_MLP: "--tsp-mlp", TP: TP_FLAG}
# The flag that carries the group size D of each mode (divisibility messages name it).
SIZE_FLAGS: Dict[str, str] = {TSP: TSP_FLAG, TSP_MLP: TP_FLAG, TP: TP_FLAG}
# Who shards a dimension over the group, in divisibility messages.
SHARDED_BY: Dict[str, str] = {TSP: "TSP", TSP_MLP: "--tsp-mlp (TP=D)", TP: "tensor parallelism"}
ALL_MODES = (TSP, TSP_MLP, TP)

# When a row can be checked on Megatron-LM's arguments: "parsed" rows on the command line as
# typed (before ``validate_args``); "validated" rows need values Megatron derives in
# ``validate_args`` (``--ffn-hidden-size`` defaults to 4h, the padded vocabulary).
PARSED = "parsed"
VALIDATED = "validated"

# Megatron-LM trees whose argument parsers the tests read (tag -> label used in ``versions``).
MEGATRON_LM_VERSIONS = ("0.16", "0.19")


def value_name(value: Any) -> Any:
    """Enum members by name (``AttnBackend.flash`` -> ``"flash"``), everything else as is."""
    name = getattr(value, "name", None)
    return name if isinstance(name, str) and not isinstance(value, str) else value


def is_set(value: Any) -> bool:
    """What "the flag was given" means for a store_true flag, an optional value or a list."""
    value = value_name(value)
    return value not in (None, False, 0, "", (), [])


# ------------------------------------------------------------------------------------------------
# conditions: when a row refuses a value (``d`` is the TSP size, for rows that depend on it)


@dataclasses.dataclass(frozen=True)
class Condition:
    text: str  # for the docs: "set", "> 1", "`flash`, `local`", ...
    test: Callable[[Any, Optional[int]], bool]
    values: Tuple[str, ...] = ()  # the choices it names (tests check Megatron-LM offers them)
    # "combine": the setting cannot be combined with the mode; "divide": the value must be a
    # multiple of the group size D (the message says so with the numbers).
    kind: str = "combine"
    # "divide" rows only: a divisor of D is accepted too (K/V heads replicated over D / value
    # ranks, as megatron-core does for TP); the message says so
    divisor_ok: bool = False

    def refuses(self, value: Any, d: Optional[int] = None) -> bool:
        return self.test(value, d)


SET = Condition("set", lambda v, d: is_set(v))
GIVEN = Condition("given", lambda v, d: v is not None)


def above(limit: int) -> Condition:
    return Condition(f"> {limit}", lambda v, d: v is not None and v > limit)


def one_of(*values: str) -> Condition:
    shown = ", ".join(f"`{v}`" for v in values)
    return Condition(shown, lambda v, d: value_name(v) in values, values)


def other_than(*values: str) -> Condition:
    shown = " or ".join(f"`{v}`" for v in values)
    return Condition(
        f"other than {shown}", lambda v, d: v is not None and value_name(v) not in values, values
    )


# ``--tensor-model-parallel-size`` may stay at its default 1 or repeat D (it *is* the TSP axis).
ONE_OR_D = Condition("other than 1 or D", lambda v, d: v not in (None, 1, d))

# A dimension every rank holds 1/D of (heads, query groups, FFN, vocabulary).
NOT_DIVISIBLE_BY_D = Condition(
    "not divisible by D", lambda v, d: v is not None and d is not None and v % d != 0, kind="divide"
)

# Query groups: a multiple of D (ng/D groups per rank) or a divisor of D (megatron-core's TP
# layout for fewer K/V heads than ranks: each group's block of the fused QKV weight spans D/ng
# shards, and the D/ng ranks of a group share its one K/V head). Megatron's TransformerConfig
# accepts exactly these (``num_query_groups`` a multiple or divisor of the TP size).
NOT_MULTIPLE_OR_DIVISOR_OF_D = Condition(
    "neither a multiple nor a divisor of D",
    lambda v, d: v is not None and d is not None and v % d != 0 and d % v != 0,
    kind="divide",
    divisor_ok=True,
)


# ------------------------------------------------------------------------------------------------
# rows


@dataclasses.dataclass(frozen=True)
class ModeRule:
    """How another mode refuses a row's flag: its reason, and its condition where it differs from
    the row's. No TSP layer checks it in that mode (the row's ``layer`` check is TSP's: the hybrid
    keeps Megatron's attention)."""

    reason: str
    condition: Optional["Condition"] = None


@dataclasses.dataclass(frozen=True)
class Rejection:
    flag: str  # on Megatron-LM's command line
    dest: str  # argparse dest (attribute of Megatron's args)
    condition: Condition
    reason: str
    config_field: Optional[str] = None  # megatron-core TransformerConfig field, same setting
    layer: Optional[str] = None  # "attention" | "mlp": that TSP layer checks it too
    modes: Tuple[str, ...] = (TSP,)
    versions: Tuple[str, ...] = MEGATRON_LM_VERSIONS  # Megatron-LM trees defining the flag
    # A refused command-line value after the flag (tests parse ``flag *example`` with Megatron-LM's
    # own parser and expect this row to refuse it); empty for switches.
    example: Tuple[str, ...] = ()
    stage: str = PARSED
    label: Optional[str] = None  # how messages name the flag, when not ``flag`` itself
    # dest of a switch that lifts the row (that mode checks the setting itself): the expert
    # ring's own layout rule replaces the folded schedule's expert-tensor-parallel row
    unless: Optional[str] = None
    # other modes that refuse this flag for their own reason: mode -> ModeRule
    also: Mapping[str, ModeRule] = dataclasses.field(
        default_factory=dict, hash=False, compare=False
    )

    def per_mode(self) -> Tuple["Rejection", ...]:
        """This row as the rows of each mode it applies to (``modes``, then ``also``)."""
        out = [dataclasses.replace(self, also={})]
        for mode, rule in self.also.items():
            out.append(
                dataclasses.replace(
                    self,
                    modes=(mode,),
                    reason=rule.reason,
                    condition=rule.condition or self.condition,
                    layer=None,
                    also={},
                )
            )
        return tuple(out)

    def refuses(self, value: Any, d: Optional[int] = None) -> bool:
        return self.condition.refuses(value, d)

    def argv(self) -> List[str]:
        """A command-line fragment this row refuses (see ``example``)."""
        return [self.flag, *self.example]

    @property
    def name(self) -> str:
        return self.label or self.flag

    def shown(self, value: Any) -> str:
        """``--flag`` for a switch, ``--flag=value`` otherwise."""
        value = value_name(value)
        if value is True:
            return self.name
        if isinstance(value, (list, tuple)):
            value = " ".join(str(value_name(v)) for v in value)
        return f"{self.name}={value}"

    def message(
        self, value: Any, d: Optional[int], mode: str = TSP, config_value: bool = False
    ) -> str:
        if self.condition.kind == "divide" and self.condition.divisor_ok:
            return (
                f"{self.shown(value)} is not divisible by {SIZE_FLAGS[mode]}={d} and does not "
                f"divide it: {SHARDED_BY[mode]} shards {self.reason} over the group, or gives "
                f"each of them to {SIZE_FLAGS[mode]} / {self.name} ranks when there are fewer "
                f"(megatron-core's TP layout), so {self.name} % {d} or {d} % {self.name} must be 0"
            )
        if self.condition.kind == "divide":
            return (
                f"{self.shown(value)} is not divisible by {SIZE_FLAGS[mode]}={d}: "
                f"{SHARDED_BY[mode]} shards {self.reason} over the group, so {self.name} % "
                f"{d} must be 0"
            )
        # the hybrid's flag is a switch: its size is --tensor-model-parallel-size, not its own
        against = MODE_FLAGS[mode] if d is None or mode != TSP else f"{MODE_FLAGS[mode]}={d}"
        where = self.shown(value)
        if config_value and self.config_field:
            where += f" (TransformerConfig.{self.config_field}={value_name(value)!r})"
        return f"{where} cannot be combined with {against}: {self.reason}"


_NO_CONTEXT_PARALLEL = (
    "the hybrid builds Megatron's local attention, which has no context parallelism"
)
_HYBRID_CUDA_GRAPHS = (
    "CUDA graphs capture module calls with static buffers; the MLP's weight "
    "ring is not graph-captured"
)
_HYBRID_FSDP = (
    "{name} gathers each module's weights in hooks around its call; the TSP MLP reads "
    "linear_fc1/linear_fc2's weights without calling them (use "
    "--use-distributed-optimizer)"
)

_HYBRID_DENSE_ONLY = (
    "the hybrid replaces a dense MLP by the TSP ring; MoE layers have no hybrid spec (use "
    "--tensor-sequence-parallel-size, whose MoE layers are megatron-core's)"
)
_EP_FOLDED = "under TSP the experts are spread over the expert-model-parallel ranks"
_TE_ONLY = "needs Transformer Engine layers; TSP layers are not TE modules"
_CUDA_GRAPHS = (
    "TSP layers have not been validated under CUDA graph capture: the captured layer would hold "
    "TSP's ring send/recv and per-head-group all-gathers, which Megatron's capture does not "
    "prepare; run without CUDA graphs"
)
_FSDP = (
    "{name} gathers a module's sharded parameters in that module's forward pre-hook; TSP reads the "
    "weights of linear_qkv / linear_proj / linear_fc1 / linear_fc2 without calling those modules, "
    "so it would compute with parameter shards. Use --use-distributed-optimizer (sharded "
    "optimizer state and gradients) instead"
)

ROWS: Tuple[Rejection, ...] = (
    # --- parallel layout -------------------------------------------------------------------------
    Rejection(
        "--tensor-model-parallel-size",
        "tensor_model_parallel_size",
        ONE_OR_D,
        "TSP already uses the tensor-parallel ranks as its folded axis; leave "
        "--tensor-model-parallel-size at 1 (or equal to D)",
        example=("3",),
    ),
    # --context-parallel-size C is TSP x CP (the sequence axis spans the D*C tensor-and-context
    # group, core/layout.py); only Megatron's CP attention communication does not apply.
    Rejection(
        "--cp-comm-type",
        "cp_comm_type",
        Condition(
            "other than `p2p` (the default) or `allgather`",
            lambda v, d: (
                v is not None
                and any(t not in ("p2p", "allgather") for t in ([v] if isinstance(v, str) else v))
            ),
        ),
        "TSP x CP moves K/V itself (one all-gather of each head group's K/V over the D*C "
        "tensor-and-context-parallel group, dK/dV by its reduce-scatter); Megatron's "
        "context-parallel attention exchanges are not used",
        example=("a2a",),
    ),
    Rejection(
        "--hierarchical-context-parallel-sizes",
        "hierarchical_context_parallel_sizes",
        SET,
        "TSP already shards the sequence over its group",
        config_field="hierarchical_context_parallel_sizes",
        example=("2", "2"),
        also={TSP_MLP: ModeRule(_NO_CONTEXT_PARALLEL)},
    ),
    Rejection(
        "--hybrid-context-parallel",
        "hybrid_context_parallel",
        SET,
        "TSP already shards the sequence over its group",
        config_field="hybrid_context_parallel",
        also={TSP_MLP: ModeRule(_NO_CONTEXT_PARALLEL)},
    ),
    Rejection(
        "--tensor-parallel-num-weight-shards",
        "tensor_parallel_num_weight_shards",
        above(1),
        "TSP already shards the weights over its group",
        versions=("0.19",),
        example=("2",),
        also={
            TSP_MLP: ModeRule(
                "the TSP MLP ring circulates exactly the D tensor-parallel shards",
                condition=Condition("other than 1", lambda v, d: v not in (None, 1)),
            )
        },
    ),
    Rejection(
        "--tp-comm-overlap",
        "tp_comm_overlap",
        SET,
        "it overlaps Transformer Engine's TP all-gather/reduce-scatter GEMMs, which TSP "
        "layers do not issue",
        config_field="tp_comm_overlap",
        also={
            TSP_MLP: ModeRule(
                "it overlaps Transformer Engine's TP all-gather/reduce-scatter GEMMs; the hybrid's "
                "layers are Megatron's local modules and its MLP issues no such collectives"
            )
        },
    ),
    Rejection(
        "--delay-wgrad-compute",
        "delay_wgrad_compute",
        SET,
        "it defers Transformer Engine layers' weight-gradient GEMMs; TSP layers compute "
        "their weight gradients inside the ring",
        config_field="delay_wgrad_compute",
    ),
    Rejection(
        "--use-megatron-fsdp",
        "use_megatron_fsdp",
        SET,
        _FSDP.format(name="Megatron-FSDP"),
        also={TSP_MLP: ModeRule(_HYBRID_FSDP.format(name="Megatron-FSDP"))},
    ),
    Rejection(
        "--use-torch-fsdp2",
        "use_torch_fsdp2",
        SET,
        _FSDP.format(name="torch FSDP2"),
        also={TSP_MLP: ModeRule(_HYBRID_FSDP.format(name="torch FSDP2"))},
    ),
    Rejection(
        "--cuda-graph-impl",
        "cuda_graph_impl",
        other_than("none"),
        _CUDA_GRAPHS,
        config_field="cuda_graph_impl",
        example=("local",),
        also={TSP_MLP: ModeRule(_HYBRID_CUDA_GRAPHS)},
    ),
    Rejection(
        "--enable-cuda-graph",
        "enable_cuda_graph",
        SET,
        _CUDA_GRAPHS,
        config_field="enable_cuda_graph",
        also={TSP_MLP: ModeRule(_HYBRID_CUDA_GRAPHS)},
    ),
    Rejection(
        "--external-cuda-graph",
        "external_cuda_graph",
        SET,
        _CUDA_GRAPHS,
        config_field="external_cuda_graph",
        also={TSP_MLP: ModeRule(_HYBRID_CUDA_GRAPHS)},
    ),
    # --- MoE ("EP folded onto the TSP axis": megatron-core's MoELayer behind TSP attention) ------
    # --num-experts, --expert-model-parallel-size, --moe-layer-freq, the router's top-k / score
    # function / aux, seq and global aux losses / z-loss / expert bias, shared experts and the
    # allgather / alltoall dispatchers work: the MoE layer is token-wise and reduces its load
    # balancing statistics over pg_collection.tp_cp, the TSP group (docs/moe.md). What is refused
    # depends on which tokens a rank holds (zigzag chunks under TSP, one block under TP+SP) or is
    # not wired into the TSP spec.
    Rejection(
        "--expert-tensor-parallel-size",
        "expert_tensor_parallel_size",
        Condition("other than 1 (without `--tsp-moe-ring`)", lambda v, d: v not in (None, 1)),
        _EP_FOLDED + ", so each expert is whole on its rank (expert-tensor-parallel size 1; "
        "the launcher sets it); for experts sharded over the D TSP ranks add --tsp-moe-ring "
        "(the TSP expert ring: expert-tensor-parallel size D, expert-model-parallel size 1)",
        example=("2",),
        unless="tsp_moe_ring",
    ),
    Rejection(
        "--moe-grouped-gemm",
        "moe_grouped_gemm",
        SET,
        "the TSP spec builds megatron-core's local MoE experts (SequentialMLP); grouped-GEMM "
        "experts are not wired into it yet",
        config_field="moe_grouped_gemm",
    ),
    Rejection(
        "--moe-expert-capacity-factor",
        "moe_expert_capacity_factor",
        GIVEN,
        "token dropping picks, per rank, which of its local tokens exceed an expert's capacity; "
        "a TSP rank holds two zigzag chunks where a TP+SP rank holds one contiguous block, so "
        "other tokens would be dropped than under TP+SP",
        config_field="moe_expert_capacity_factor",
        example=("1.0",),
    ),
    Rejection(
        "--moe-router-load-balancing-type",
        "moe_router_load_balancing_type",
        Condition(
            "`sinkhorn`",
            lambda v, d: "sinkhorn" in ([v] if isinstance(v, str) else list(v or ())),
            ("sinkhorn",),
        ),
        "Sinkhorn normalises the routing over this rank's tokens; a TSP rank holds other "
        "tokens than a TP+SP rank, so experts would be chosen differently",
        config_field="moe_router_load_balancing_type",
        example=("sinkhorn",),
    ),
    Rejection(
        "--moe-input-jitter-eps",
        "moe_input_jitter_eps",
        GIVEN,
        "the jitter noise is drawn for this rank's tokens in local order; a TSP rank holds "
        "other tokens than a TP+SP rank, so each token would get other noise",
        config_field="moe_input_jitter_eps",
        example=("0.01",),
    ),
    Rejection(
        "--moe-token-dispatcher-type",
        "moe_token_dispatcher_type",
        one_of("flex"),
        "the flex dispatcher (DeepEP / HybridEP kernels) has not been validated under TSP; use "
        "alltoall or allgather",
        config_field="moe_token_dispatcher_type",
        example=("flex",),
    ),
    Rejection(
        "--moe-enable-deepep",
        "moe_enable_deepep",
        SET,
        "DeepEP (the flex dispatcher) has not been validated under TSP; use alltoall or allgather",
        config_field="moe_enable_deepep",
    ),
    Rejection(
        "--moe-shared-expert-overlap",
        "moe_shared_expert_overlap",
        SET,
        "the shared-expert overlap runs the shared expert on CUDA side streams inside the "
        "dispatcher and has not been validated under TSP",
        config_field="moe_shared_expert_overlap",
    ),
    Rejection(
        "--moe-use-upcycling",
        "moe_use_upcycling",
        SET,
        "upcycling builds the dense model with Megatron's own spec to convert its checkpoint; "
        "it is not wired for the TSP spec",
    ),
    Rejection(
        "--num-experts",
        "num_experts",
        SET,
        _HYBRID_DENSE_ONLY,
        config_field="num_moe_experts",
        layer="mlp",
        modes=(TSP_MLP,),
        example=("8",),
    ),
    Rejection(
        "--expert-model-parallel-size",
        "expert_model_parallel_size",
        above(1),
        _HYBRID_DENSE_ONLY,
        config_field="expert_model_parallel_size",
        modes=(TSP_MLP,),
        example=("2",),
    ),
    # --- attention -------------------------------------------------------------------------------
    Rejection(
        "--multi-latent-attention",
        "multi_latent_attention",
        SET,
        "TSP supports standard self-attention only",
        config_field="multi_latent_attention",
        layer="attention",
        also={TSP_MLP: ModeRule("the hybrid spec builds standard self-attention")},
    ),
    Rejection(
        "--qk-layernorm",
        "qk_layernorm",
        SET,
        "TSP attention does not apply query/key norms (not implemented yet)",
        config_field="qk_layernorm",
        layer="attention",
        also={
            TSP_MLP: ModeRule("the hybrid spec's norms are sequence-parallel-tagged torch norms")
        },
    ),
    Rejection(
        "--qk-l2-norm",
        "qk_l2_norm",
        SET,
        "TSP attention does not apply query/key norms (not implemented yet)",
        config_field="qk_l2_norm",
        layer="attention",
    ),
    Rejection(
        "--attention-output-gate",
        "attention_output_gate",
        SET,
        "TSP attention has no output gate (not implemented yet)",
        config_field="attention_output_gate",
        layer="attention",
    ),
    Rejection(
        "--softmax-type",
        "softmax_type",
        other_than("vanilla"),
        "TSP attention's online softmax is the standard one (no off-by-one or learnable sink term)",
        config_field="softmax_type",
        layer="attention",
        example=("learnable",),
    ),
    Rejection(
        "--window-size",
        "window_size",
        SET,
        "TSP attention is causal over the whole sequence (no sliding window)",
        config_field="window_size",
        layer="attention",
        example=("128,0",),
    ),
    Rejection(
        "--qk-clip",
        "qk_clip",
        SET,
        "QK-clip reads the maximum attention logit that Transformer Engine's core attention "
        "tracks; TSP attention replaces core attention and does not track it",
        config_field="qk_clip",
        layer="attention",
    ),
    Rejection(
        "--log-max-attention-logit",
        "log_max_attention_logit",
        SET,
        "the maximum attention logit is tracked by Transformer Engine's core attention, "
        "which TSP attention replaces",
        config_field="log_max_attention_logit",
        layer="attention",
    ),
    Rejection(
        "--experimental-attention-variant",
        "experimental_attention_variant",
        SET,
        "TSP attention would be replaced",
        config_field="experimental_attention_variant",
        layer="attention",
        example=("dsa",),
        also={TSP_MLP: ModeRule("the hybrid spec would replace it")},
    ),
    Rejection(
        "--position-embedding-type",
        "position_embedding_type",
        one_of("mrope"),
        "TSP attention indexes the rotary table by the zigzag positions of its tokens; "
        "multimodal RoPE tables are built per token from position ids",
        example=("mrope",),
    ),
    Rejection(
        "--attention-backend",
        "attention_backend",
        other_than("auto"),
        "TSP attention is its own module, so a backend choice would replace parts of it "
        "(local) or select Transformer Engine kernels it does not use (flash, fused, "
        "unfused); drop the flag (auto)",
        example=("flash",),
        also={
            TSP_MLP: ModeRule(
                "the hybrid builds Megatron's local attention, so another backend would be "
                "silently ignored; drop the flag (auto) or use local",
                condition=other_than("auto", "local"),
            )
        },
    ),
    Rejection(
        "--transformer-impl",
        "transformer_impl",
        one_of("inference_optimized"),
        "the inference-optimized layers have no TSP spec",
        example=("inference_optimized",),
        also={TSP_MLP: ModeRule("the hybrid spec is the training layer spec")},
    ),
    # --- model structure -------------------------------------------------------------------------
    Rejection(
        "--mtp-num-layers",
        "mtp_num_layers",
        SET,
        "multi-token prediction layers have no TSP spec",
        config_field="mtp_num_layers",
        example=("1",),
        also={TSP_MLP: ModeRule("multi-token prediction layers have no hybrid spec")},
    ),
    Rejection(
        "--heterogeneous-layers-config-path",
        "heterogeneous_layers_config_path",
        SET,
        "heterogeneous layers have no TSP spec",
        example=("layers.json",),
        also={TSP_MLP: ModeRule("heterogeneous layers have no hybrid spec")},
    ),
    Rejection(
        "--heterogeneous-layers-config-encoded-json",
        "heterogeneous_layers_config_encoded_json",
        SET,
        "heterogeneous layers have no TSP spec",
        example=("{}",),
    ),
    Rejection(
        "--use-legacy-models",
        "use_legacy_models",
        SET,
        "TSP needs megatron-core models",
        versions=("0.16",),
        also={TSP_MLP: ModeRule("the hybrid needs megatron-core models")},
    ),
    Rejection(
        "--yaml-cfg",
        "yaml_cfg",
        SET,
        "the YAML path bypasses Megatron's validate_args, where TSP is translated",
        example=("run.yaml",),
        also={
            TSP_MLP: ModeRule(
                "the YAML path bypasses Megatron's validate_args, where --tsp-mlp is translated"
            )
        },
    ),
    Rejection(
        "--apply-layernorm-1p",
        "layernorm_zero_centered_gamma",
        SET,
        "TSP's sequence-parallel norms are torch LayerNorm / RMSNorm without the zero-centred "
        "(1 + gamma) weight",
        config_field="layernorm_zero_centered_gamma",
    ),
    Rejection(
        "--use-mup",
        "use_mup",
        SET,
        "not validated under TSP: TSP prefill's own embedding does not apply megatron-core's "
        "MuP embedding multiplier (mup_embedding_mult)",
        config_field="use_mup",
        versions=("0.19",),
    ),
    # --- precision -------------------------------------------------------------------------------
    Rejection(
        "--fp8-format",
        "fp8",
        SET,
        "FP8 " + _TE_ONLY,
        config_field="fp8",
        example=("hybrid",),
        also={
            TSP_MLP: ModeRule("FP8 needs Transformer Engine layers; the TSP MLP is not a TE module")
        },
    ),
    Rejection(
        "--fp4-format",
        "fp4",
        SET,
        "FP4 " + _TE_ONLY,
        config_field="fp4",
        example=("e2m1",),
        also={
            TSP_MLP: ModeRule("FP4 needs Transformer Engine layers; the TSP MLP is not a TE module")
        },
    ),
    Rejection(
        "--fp32-residual-connection",
        "fp32_residual_connection",
        SET,
        "the fp32 residual stream would reach TSP's torch norms and layers as fp32 input with "
        "bf16 / fp16 weights (torch's LayerNorm refuses that mix; Megatron relies on Transformer "
        "Engine's norms for it); not validated under TSP",
        config_field="fp32_residual_connection",
    ),
    # --- data ------------------------------------------------------------------------------------
    # --reset-attention-mask / --reset-position-ids work under TSP: the batch hook reads the
    # documents from the position ids or the EOD tokens (megatron_lm/documents.py)
    Rejection(
        "--sft",
        "sft",
        SET,
        "SFT batches are packed THD sequences (cu_seqlens, megatron-core's packed_seq_params), "
        "which are not wired through the Megatron-LM loop under TSP yet (the batch hook takes "
        "fixed-length [b, s] batches); for packed documents in [b, s] batches use "
        "--reset-attention-mask --reset-position-ids",
    ),
    Rejection(
        "--dataloader-inter-document-masking",
        "dataloader_inter_document_masking",
        SET,
        "it packs documents as THD batches (cu_seqlens, megatron-core's packed_seq_params), "
        "which are not wired through the Megatron-LM loop under TSP yet (the batch hook takes "
        "fixed-length [b, s] batches); --reset-attention-mask --reset-position-ids give TSP "
        "the documents in [b, s] batches",
        versions=("0.19",),
    ),
)

# --- shapes: dimensions each rank holds 1/D of (TSP, the hybrid and plain TP alike) ----------
# Checked once Megatron has derived them (``VALIDATED``), on a ``TransformerConfig`` and by the
# layers; ``reason`` names what is sharded.
SHAPE_ROWS: Tuple[Rejection, ...] = (
    Rejection(
        "--num-attention-heads",
        "num_attention_heads",
        NOT_DIVISIBLE_BY_D,
        "attention heads",
        config_field="num_attention_heads",
        layer="attention",
        modes=ALL_MODES,
        stage=VALIDATED,
        example=("6",),
    ),
    Rejection(
        "--num-query-groups",
        "num_query_groups",
        NOT_MULTIPLE_OR_DIVISOR_OF_D,
        "key/value head groups",
        config_field="num_query_groups",
        layer="attention",
        modes=ALL_MODES,
        stage=VALIDATED,
        example=("3",),
    ),
    Rejection(
        "--ffn-hidden-size",
        "ffn_hidden_size",
        NOT_DIVISIBLE_BY_D,
        "the MLP's intermediate dimension",
        config_field="ffn_hidden_size",
        layer="mlp",
        modes=ALL_MODES,
        stage=VALIDATED,
        example=("66",),
    ),
    # Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP; only a
    # padded size given by hand (megatron-core users) can miss it.
    Rejection(
        "--vocab-size",
        "padded_vocab_size",
        NOT_DIVISIBLE_BY_D,
        "the vocabulary (embedding and output layer)",
        label="--vocab-size (padded)",
        stage=VALIDATED,
        example=("50257",),
    ),
)

# Flags only the hybrid (``--tsp-mlp``: TP+SP attention with the TSP MLP ring) refuses. What it
# refuses of the flags TSP refuses too is in those flags' rows above (``also``): it changes only
# the MLP (and selects Megatron's local layer spec), so only settings that touch the MLP, replace
# the spec or need Transformer Engine modules; the MoE rows list every mode.
TSP_MLP_ROWS: Tuple[Rejection, ...] = (
    Rejection(
        TSP_FLAG,
        "tensor_sequence_parallel_size",
        GIVEN,
        f"{TSP_FLAG} already runs the MLP (and attention) under TSP; use one or the other",
        modes=(TSP_MLP,),
        example=("4",),
    ),
    Rejection(
        "--context-parallel-size",
        "context_parallel_size",
        above(1),
        _NO_CONTEXT_PARALLEL,
        config_field="context_parallel_size",
        modes=(TSP_MLP,),
        example=("2",),
    ),
)

# One row per flag as written above; every consumer reads the rows per mode: a row with ``also``
# stands for one row of each of its modes.
TABLE: Tuple[Rejection, ...] = tuple(
    one for row in ROWS + SHAPE_ROWS + TSP_MLP_ROWS for one in row.per_mode()
)


class TSPRejection(ValueError):
    """A setting TSP refuses; the message names the flag, the value and the TSP size."""


def rows(
    mode: str = TSP, layer: Optional[str] = None, stage: Optional[str] = None
) -> List[Rejection]:
    return [
        r
        for r in TABLE
        if mode in r.modes
        and (layer is None or r.layer == layer)
        and (stage is None or r.stage == stage)
    ]


def row_for(dest: str, mode: str = TSP) -> Rejection:
    """The row of ``mode`` for an argparse dest or a ``TransformerConfig`` field."""
    for r in rows(mode):
        if r.dest == dest or r.config_field == dest:
            return r
    raise KeyError(dest)


def refusals_for_args(args, d: Optional[int], mode: str = TSP, stage: str = PARSED) -> List[str]:
    """Messages for every row of ``mode`` and ``stage`` refused by Megatron-LM's parsed ``args``
    (absent dests are skipped: a flag the running Megatron-LM version does not have cannot be
    set)."""
    out = []
    for r in rows(mode, stage=stage):
        value = getattr(args, r.dest, None)
        if r.unless and getattr(args, r.unless, False):
            continue
        if r.refuses(value, d):
            out.append(r.message(value, d, mode))
    return out


def refusals_for_values(
    values: Mapping[str, Any], d: Optional[int], mode: str = TSP, config_value: bool = True
) -> List[str]:
    """Messages for the rows whose config field (or dest) is a key of ``values`` and refused."""
    out = []
    for r in rows(mode):
        key = r.config_field if r.config_field in values else r.dest
        if key in values and r.refuses(values[key], d):
            out.append(
                r.message(values[key], d, mode, config_value=config_value and key == r.config_field)
            )
    return out


def refusals_for_config(
    config,
    d: Optional[int] = None,
    mode: str = TSP,
    layer: Optional[str] = None,
    overrides: Optional[Mapping[str, Any]] = None,
) -> List[str]:
    """Messages for the rows refused by a megatron-core ``TransformerConfig`` (``d`` defaults to
    its ``tensor_model_parallel_size``, the TSP size). ``layer`` restricts to that layer's rows;
    ``overrides`` replaces config fields by the values a module was actually given (e.g. the
    ``ffn_hidden_size`` argument of an MLP)."""
    if d is None:
        d = getattr(config, "tensor_model_parallel_size", None)
    overrides = overrides or {}
    out = []
    for r in rows(mode, layer):
        if r.config_field is None:
            continue
        if r.config_field in overrides:
            value = overrides[r.config_field]
        elif hasattr(config, r.config_field):
            value = getattr(config, r.config_field)
        else:
            continue
        if r.refuses(value, d):
            out.append(r.message(value, d, mode, config_value=True))
    return out


def raise_if_any(
    problems: Sequence[str], error=TSPRejection, what: str = "the configuration", mode: str = TSP
) -> None:
    """Raise ``error`` with the one problem, or all of them listed under one line."""
    if not problems:
        return
    if len(problems) == 1:
        raise error(problems[0])
    name = "TSP" if mode == TSP else MODE_FLAGS[mode]
    raise error(f"{what} cannot run with {name}:\n  - " + "\n  - ".join(problems))


def check_config(
    config,
    d: Optional[int] = None,
    mode: str = TSP,
    layer: Optional[str] = None,
    overrides: Optional[Mapping[str, Any]] = None,
) -> None:
    raise_if_any(refusals_for_config(config, d, mode, layer, overrides), mode=mode)


def check_values(
    values: Mapping[str, Any], d: Optional[int], mode: str = TSP, config_value: bool = True
) -> None:
    raise_if_any(refusals_for_values(values, d, mode, config_value), mode=mode)


def check_divisible(d: int, mode: str = TSP, **values: Optional[int]) -> None:
    """Raise for the first of ``values`` (dest -> size, in the order given) that is not a multiple
    of the group size ``d``; ``None`` values are skipped."""
    for dest, value in values.items():
        row = row_for(dest, mode)
        if row.refuses(value, d):
            raise TSPRejection(row.message(value, d, mode))


# ------------------------------------------------------------------------------------------------
# docs

DOC_BEGIN = "<!-- rejections table: generated by megatron_tsp.core.rejections.markdown_table() -->"
DOC_END = "<!-- end of rejections table -->"


def _doc_markers(mode: str) -> Tuple[str, str]:
    if mode == TSP:
        return DOC_BEGIN, DOC_END
    return (
        DOC_BEGIN.replace("markdown_table()", f"markdown_table({mode!r})"),
        DOC_END.replace("table", f"table ({mode})"),
    )


def _versions_text(r: Rejection) -> str:
    if tuple(r.versions) == MEGATRON_LM_VERSIONS:
        return ""
    return " (Megatron-LM " + ", ".join(f"core_v{v}" for v in r.versions) + " only)"


def _why(r: Rejection, mode: str) -> str:
    if r.condition.kind == "divide" and r.condition.divisor_ok:
        return (
            f"{SHARDED_BY[mode]} shards {r.reason} over the group, or, when there are fewer "
            "than D, spreads each over D / value ranks that share its K/V head (megatron-core's "
            "TP layout)"
        )
    if r.condition.kind == "divide":
        return f"{SHARDED_BY[mode]} shards {r.reason} over the group"
    return r.reason


def markdown_table(mode: str = TSP) -> str:
    """The rows of ``mode`` as a Markdown table (what ``docs/megatron-lm.md`` shows)."""
    lines = [
        "| flag | refused when | config field | checked by layer | why |",
        "|---|---|---|---|---|",
    ]
    for r in rows(mode):
        reason = _why(r, mode).replace("|", "\\|")
        field = f"`{r.config_field}`" if r.config_field else "-"
        stage = " (after Megatron's validation)" if r.stage == VALIDATED else ""
        lines.append(
            f"| `{r.name}`{_versions_text(r)} | {r.condition.text}{stage} | {field} | "
            f"{r.layer or '-'} | {reason} |"
        )
    return "\n".join(lines)


def doc_block(mode: str = TSP) -> str:
    begin, end = _doc_markers(mode)
    return f"{begin}\n{markdown_table(mode)}\n{end}"


def flags(mode: Optional[str] = None) -> List[str]:
    return [r.flag for r in TABLE if mode is None or mode in r.modes]
