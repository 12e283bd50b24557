"""The one description of a GPT model's architecture: ``ModelShape`` and its JSON files.

Every consumer reads the same files (``megatron_tsp/models/<name>.json``, or a path to a file with
the same keys): the run configs in ``configs/`` (``megatron_lm.configs`` turns a shape into
Megatron-LM's model arguments), the analytic planner and formulas (``tools.estimator``), and the
fake-tensor memory tool. A file holds the fields of ``ModelShape`` plus the text fields
``description``, ``assumptions`` and ``published`` (the paper's numbers the planner compares with).

Standard library only, so every layer of the package may import it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Optional, Tuple, Union

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder-only transformer as Megatron builds it (no parallel or training settings)."""

    name: str = ""
    hidden: int
    num_layers: int
    heads: int
    query_groups: Optional[int] = None  # None: multi-head attention (one group per head)
    ffn: Optional[int] = None  # None: 4 * hidden
    vocab: int = 32000  # before Megatron pads it to a multiple of 128 x TP
    gated: bool = False  # SwiGLU: fc1 is [2 * ffn, hidden]
    bias: bool = False  # linear biases (Megatron's --disable-bias-linear when False)
    normalization: str = "LayerNorm"  # or "RMSNorm" (no bias parameter)
    tied_embeddings: bool = False  # output layer shares the embedding's weight
    rope: bool = True  # rotary positions; False: a learned absolute position table
    rotary_base: Optional[int] = None  # None: Megatron's default (10000)
    norm_epsilon: Optional[float] = None  # None: Megatron's default (1e-5)
    dtype_bytes: int = 2  # weights and activations (bf16) for the analytic planner
    # Mixture of Experts (None: a dense model). An MoE layer's MLP is ``num_experts`` experts of
    # FFN ``moe_ffn`` (gated like the dense MLP, no biases), the token's top ``moe_topk`` of them,
    # a router [E, h] and optionally one shared expert of FFN ``moe_shared_ffn``; the first
    # ``moe_dense_layers`` layers keep the dense MLP (Megatron: --moe-layer-freq as a 0/1 list)
    num_experts: Optional[int] = None
    moe_topk: int = 2
    moe_ffn: Optional[int] = None  # None: ffn_hidden
    moe_shared_ffn: Optional[int] = None
    moe_dense_layers: int = 0
    # text, not architecture: left out of comparisons and hashes
    description: str = dataclasses.field(default="", compare=False)
    assumptions: Tuple[str, ...] = dataclasses.field(default=(), compare=False)
    published: Optional[Mapping[str, Any]] = dataclasses.field(
        default=None, compare=False, hash=False
    )

    def __post_init__(self):
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} not divisible by heads {self.heads}")
        if self.heads % self.groups:
            raise ValueError(f"heads {self.heads} not divisible by query groups {self.groups}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"unknown normalization {self.normalization!r}; one of {NORMALIZATIONS}"
            )
        if self.num_experts is not None:
            if self.num_experts < 2 or not 1 <= self.moe_topk <= self.num_experts:
                raise ValueError(
                    f"num_experts {self.num_experts} / moe_topk {self.moe_topk}: need at least "
                    "2 experts and 1 <= top-k <= experts"
                )
            if not 0 <= self.moe_dense_layers < self.num_layers:
                raise ValueError(
                    f"moe_dense_layers {self.moe_dense_layers}: between 0 and num_layers - 1 "
                    f"= {self.num_layers - 1}"
                )
        elif self.moe_ffn or self.moe_shared_ffn or self.moe_dense_layers:
            raise ValueError("moe_ffn / moe_shared_ffn / moe_dense_layers need num_experts")
        object.__setattr__(self, "assumptions", tuple(self.assumptions))

    # dimensions -----------------------------------------------------------------------------
    @property
    def groups(self) -> int:
        return self.query_groups or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_hidden(self) -> int:
        return self.groups * self.head_dim

    @property
    def ffn_hidden(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def fc1_rows(self) -> int:
        return (2 if self.gated else 1) * self.ffn_hidden

    def padded_vocab(self, tp: int, divisible_by: int = 128) -> int:
        """Megatron pads the vocabulary to a multiple of make-vocab-size-divisible-by x TP."""
        m = divisible_by * tp
        return -(-self.vocab // m) * m

    # parameters (elements) of one layer ------------------------------------------------------
    @property
    def w_qkv(self) -> int:
        return (self.hidden + 2 * self.kv_hidden) * self.hidden

    @property
    def b_qkv(self) -> int:
        return (self.hidden + 2 * self.kv_hidden) if self.bias else 0

    @property
    def w_proj(self) -> int:
        return self.hidden * self.hidden

    @property
    def b_proj(self) -> int:
        return self.hidden if self.bias else 0

    @property
    def w_fc1(self) -> int:
        return self.fc1_rows * self.hidden

    @property
    def b_fc1(self) -> int:
        return self.fc1_rows if self.bias else 0

    @property
    def w_fc2(self) -> int:
        return self.hidden * self.ffn_hidden

    @property
    def b_fc2(self) -> int:
        return self.hidden if self.bias else 0

    @property
    def norm_params(self) -> int:
        """Both norms of the layer (LayerNorm: weight + bias; RMSNorm: weight)."""
        return 2 * self.hidden * (2 if self.normalization == "LayerNorm" else 1)

    @property
    def w_attn(self) -> int:
        """Attention parameters TSP moves: qkv weight + qkv bias + proj weight."""
        return self.w_qkv + self.b_qkv + self.w_proj

    @property
    def w_mlp(self) -> int:
        """MLP parameters TSP moves: fc1 weight + fc1 bias + fc2 weight."""
        return self.w_fc1 + self.b_fc1 + self.w_fc2

    @property
    def w_layer(self) -> int:
        return self.w_attn + self.w_mlp

    @property
    def replicated_params(self) -> int:
        """Parameters every TSP / TP rank holds in full: norms, proj bias, fc2 bias."""
        return self.norm_params + self.b_proj + self.b_fc2

    @property
    def layer_params(self) -> int:
        return self.w_layer + self.replicated_params

    # Mixture of Experts ----------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.moe_dense_layers if self.is_moe else 0

    @property
    def moe_layer_freq(self) -> list:
        """Megatron's ``--moe-layer-freq`` as one 0 (dense) / 1 (MoE) per layer."""
        return [0] * self.moe_dense_layers + [1] * self.moe_layers

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn or self.ffn_hidden

    @property
    def w_expert(self) -> int:
        """One expert's weights: fc1 [(2) F, h] + fc2 [h, F], no biases."""
        return ((2 if self.gated else 1) + 1) * self.expert_ffn * self.hidden

    @property
    def w_experts(self) -> int:
        """All routed experts of one MoE layer (what the TSP expert ring moves)."""
        return (self.num_experts or 0) * self.w_expert

    @property
    def w_shared_expert(self) -> int:
        if not self.moe_shared_ffn:
            return 0
        return ((2 if self.gated else 1) + 1) * self.moe_shared_ffn * self.hidden

    @property
    def moe_layer_params(self) -> int:
        """An MoE layer: attention, norms and replicated biases as a dense layer, its MLP replaced
        by the router [E, h], the routed experts and the shared expert."""
        if not self.is_moe:
            return 0
        mlp = self.w_mlp + self.b_fc2
        router = self.num_experts * self.hidden
        return self.layer_params - mlp + router + self.w_experts + self.w_shared_expert

    # the whole model --------------------------------------------------------------------------
    def final_norm_params(self) -> int:
        return self.hidden * (2 if self.normalization == "LayerNorm" else 1)

    def num_params(self, tp: int = 1) -> int:
        """Parameters of the model with the vocabulary padded for TP = ``tp`` (RoPE: no position
        table)."""
        emb = self.padded_vocab(tp) * self.hidden * (1 if self.tied_embeddings else 2)
        layers = (self.num_layers - self.moe_layers) * self.layer_params
        layers += self.moe_layers * self.moe_layer_params
        return layers + emb + self.final_norm_params()

    def architecture(self) -> dict:
        """The fields that define the model (what two equal shapes share)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelShape) if f.compare}

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["assumptions"] = list(self.assumptions)
        if not self.is_moe:  # a dense model's file has no MoE keys
            for name in _MOE_FIELDS:
                out.pop(name)
        return {k: v for k, v in out.items() if v is not None and v != ""}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "model") -> "ModelShape":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown model fields {unknown} (known: {sorted(known)})")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"{source}: {exc}") from exc


_MOE_FIELDS = ("num_experts", "moe_topk", "moe_ffn", "moe_shared_ffn", "moe_dense_layers")


def available_models() -> list:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def model_path(name_or_path: str) -> Path:
    """``megatron_tsp/models/<name>.json`` for a shipped name, else an existing ``.json`` path."""
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        return path
    shipped = MODELS_DIR / f"{name_or_path.lower()}.json"
    if shipped.is_file():
        return shipped
    raise ValueError(
        f"unknown model {name_or_path!r}: give one of {available_models()} or a .json path"
    )


def load_model(model: Union[str, ModelShape], **changes: Any) -> ModelShape:
    """A shipped model by name, a model file by path, or a ``ModelShape`` as is; ``changes``
    replace fields (``load_model("tiny", rope=False)``)."""
    if not isinstance(model, ModelShape):
        path = model_path(model)
        data = json.loads(path.read_text())
        data.setdefault("name", path.stem)
        model = ModelShape.from_json(data, source=str(path))
    return dataclasses.replace(model, **changes) if changes else model
