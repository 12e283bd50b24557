"""Run configs (``configs/*.json``): a model, a sequence length, parallel and training settings,
and the Megatron-LM arguments they mean.

A run config names its model instead of describing it: the architecture lives in the one model
description format shared with the planner, the formulas and the memory tool
(``megatron_tsp/models/<name>.json``, ``megatron_tsp.core.model_shape.ModelShape``)::

    {"name": "paper-7b-128k", "description": "...", "assumptions": [...],
     "model": "7b",                       # a shipped model, a model .json path (relative to this
                                          # file), or {"name": "tiny", "rope": false} to change
                                          # fields of one
     "seq_length": 131072,
     "parallel": {"tensor_sequence_parallel_size": 8, "pipeline_model_parallel_size": 1,
                  "nodes": 1, "gpus_per_node": 8},
     "training": {"micro_batch_size": 1, "bf16": true, ...}}

``load_config`` resolves the model into a ``model`` section of Megatron argument names (dest form:
``num_layers``, ``hidden_size``, ``num_attention_heads``, ``num_query_groups``,
``ffn_hidden_size``, ``vocab_size``, ``seq_length``, ``max_position_embeddings``, ``swiglu``,
``normalization``, ``position_embedding_type`` + ``rotary_base``, ``norm_epsilon``,
``disable_bias_linear``, ``untie_embeddings_and_output_weights``), which ``--set`` overrides and
``model_args`` print. ``training``: any Megatron training flag in dest form; ``true`` emits a bare
flag, ``false``/``null`` nothing.

The same file feeds the launcher / scripts (``to_megatron_args``, or ``python -m
megatron_tsp.megatron_lm.configs NAME --variant tsp``). The A/B variants differ only in the
parallel arguments:

* ``tsp``: ``--tensor-sequence-parallel-size D``
* ``tp``:  ``--tensor-model-parallel-size D --sequence-parallel``
* ``cp``:  ``--context-parallel-size D --use-distributed-optimizer``
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from megatron_tsp.core.model_shape import ModelShape, available_models, load_model

REQUIRED_MODEL_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "vocab_size",
    "seq_length",
    "swiglu",
    "normalization",
    "position_embedding_type",
)
SECTIONS = ("model", "parallel", "training")
VARIANTS = ("tsp", "tp", "tsp_mlp", "cp", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_TYPES = ("learned_absolute", "rope", "none")
# Model fields that are not Megatron flags of the same name.
_MODEL_SPECIAL = {
    "num_query_groups",
    "swiglu",
    "disable_bias_linear",
    "untie_embeddings_and_output_weights",
}
_PARALLEL_NOT_FLAGS = {"nodes", "gpus_per_node", "tensor_sequence_parallel_size"}


def configs_dir() -> Path:
    """``$MEGATRON_TSP_CONFIGS`` or the repository's ``configs/``."""
    env = os.environ.get("MEGATRON_TSP_CONFIGS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "configs"


def available() -> List[str]:
    return sorted(p.stem for p in configs_dir().glob("*.json"))


def _resolve(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        return path
    candidate = configs_dir() / f"{name_or_path}.json"
    if candidate.is_file():
        return candidate
    raise ValueError(
        f"unknown config {name_or_path!r}: not a JSON file and not one of {available()} "
        f"in {configs_dir()}"
    )


def megatron_model_fields(shape: ModelShape, seq_length: int) -> Dict[str, Any]:
    """``shape`` at ``seq_length`` as Megatron-LM model arguments (dest form)."""
    out: Dict[str, Any] = {
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden,
        "num_attention_heads": shape.heads,
        "num_query_groups": shape.groups,
        "ffn_hidden_size": shape.ffn_hidden,
        "vocab_size": shape.vocab,
        "seq_length": seq_length,
        "max_position_embeddings": seq_length,
        "swiglu": shape.gated,
        "normalization": shape.normalization,
    }
    if shape.norm_epsilon is not None:
        out["norm_epsilon"] = shape.norm_epsilon
    out["position_embedding_type"] = "rope" if shape.rope else "learned_absolute"
    if shape.rope and shape.rotary_base is not None:
        out["rotary_base"] = shape.rotary_base
    out["disable_bias_linear"] = not shape.bias
    out["untie_embeddings_and_output_weights"] = not shape.tied_embeddings
    if shape.is_moe:
        out["num_experts"] = shape.num_experts
        out["moe_router_topk"] = shape.moe_topk
        out["moe_ffn_hidden_size"] = shape.expert_ffn
        if shape.moe_shared_ffn:
            out["moe_shared_expert_intermediate_size"] = shape.moe_shared_ffn
        if shape.moe_dense_layers:  # Megatron's pattern expression, one 0/1 per layer
            out["moe_layer_freq"] = f"([0]*{shape.moe_dense_layers}+[1]*{shape.moe_layers})"
    return out


def _model_shape(model, config_path: Path) -> ModelShape:
    """A run config's ``model``: a name or path, or an object {"name": ..., field: value}."""
    changes = {}
    if isinstance(model, dict):
        changes = {k: v for k, v in model.items() if k != "name"}
        model = model.get("name")
    if not isinstance(model, str):
        raise ValueError(
            f"{config_path}: 'model' must name a model (one of {available_models()}) "
            f"or a model .json path, got {model!r}"
        )
    relative = config_path.parent / model
    if model.endswith(".json") and relative.is_file():
        model = str(relative)
    return ModelShape.from_json(
        {**load_model(model).to_json(), **changes}, source=f"{config_path}: model"
    )


def validate_config(cfg: dict, source: str = "config") -> None:
    for section in SECTIONS:
        if not isinstance(cfg.get(section), dict):
            raise ValueError(f"{source}: missing section {section!r} (need {SECTIONS})")
    model = cfg["model"]
    missing = [f for f in REQUIRED_MODEL_FIELDS if f not in model]
    if missing:
        raise ValueError(f"{source}: model section lacks {missing}")
    for field in REQUIRED_MODEL_FIELDS:
        value = model[field]
        if field in ("swiglu",):
            if not isinstance(value, bool):
                raise ValueError(f"{source}: model.{field} must be true/false, got {value!r}")
        elif field == "normalization":
            if value not in NORMALIZATIONS:
                raise ValueError(f"{source}: model.normalization must be one of {NORMALIZATIONS}")
        elif field == "position_embedding_type":
            if value not in POSITION_TYPES:
                raise ValueError(
                    f"{source}: model.position_embedding_type must be one of {POSITION_TYPES}"
                )
        elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{source}: model.{field} must be a positive integer, got {value!r}")
    d = cfg["parallel"].get("tensor_sequence_parallel_size")
    if not isinstance(d, int) or d < 1:
        raise ValueError(f"{source}: parallel.tensor_sequence_parallel_size must be a positive int")
    from megatron_tsp.core.validation import check_model_shape

    try:
        check_model_shape(
            d,
            num_attention_heads=model["num_attention_heads"],
            num_query_groups=model["num_query_groups"],
            ffn_hidden_size=model["ffn_hidden_size"],
            seq_length=model["seq_length"],
            hidden_size=model["hidden_size"],
            kv_channels=model.get("kv_channels"),  # --kv-channels: a head dimension of its own
        )
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from exc


def load_config(name_or_path: str, overrides: Optional[Dict[str, object]] = None) -> dict:
    """Load ``configs/<name>.json`` (or a path), apply ``overrides`` (``field`` or
    ``section.field`` -> value) and validate it. Returns a plain dict."""
    path = _resolve(name_or_path)
    with open(path) as f:
        cfg = json.load(f)
    cfg.setdefault("name", path.stem)
    cfg["source"] = str(path)
    if "seq_length" not in cfg:
        raise ValueError(f"{path}: missing 'seq_length'")
    shape = _model_shape(cfg.get("model"), path)
    cfg["model_name"] = shape.name
    cfg["model"] = megatron_model_fields(shape, cfg.pop("seq_length"))
    for key, value in (overrides or {}).items():
        set_field(cfg, key, value)
    validate_config(cfg, source=str(path))
    return cfg


def set_field(cfg: dict, key: str, value) -> None:
    """Set ``section.field`` or a bare ``field`` (found in exactly one section, else training)."""
    if "." in key:
        section, field = key.split(".", 1)
        if section not in SECTIONS:
            raise ValueError(f"unknown config section {section!r} in {key!r}")
    else:
        field = key
        owners = [s for s in SECTIONS if field in cfg.get(s, {})]
        if len(owners) > 1:
            raise ValueError(f"{key!r} is in sections {owners}; write section.{key}")
        section = owners[0] if owners else "training"
    cfg.setdefault(section, {})[field] = value
    if section == "model" and field == "seq_length":
        pos = cfg["model"].get("max_position_embeddings")
        if pos is not None and pos < value:
            cfg["model"]["max_position_embeddings"] = value


def parse_value(text: str):
    """``--set`` values: JSON when it parses (numbers, true/false/null), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _emit(field: str, value) -> List[str]:
    if value is None or value is False:
        return []
    if value is True:
        return [_flag(field)]
    if isinstance(value, (list, tuple)):
        return [_flag(field)] + [str(v) for v in value]
    return [_flag(field), str(value)]


def model_args(cfg: dict) -> List[str]:
    model = cfg["model"]
    out: List[str] = []
    for field, value in model.items():
        if field in _MODEL_SPECIAL:
            continue
        out += _emit(field, value)
    groups = model["num_query_groups"]
    if groups != model["num_attention_heads"]:
        out += ["--group-query-attention", "--num-query-groups", str(groups)]
    out += _emit("swiglu", model["swiglu"])
    out += _emit("disable_bias_linear", model.get("disable_bias_linear", False))
    out += _emit(
        "untie_embeddings_and_output_weights",
        model.get("untie_embeddings_and_output_weights", False),
    )
    return out


def training_args(cfg: dict) -> List[str]:
    out: List[str] = []
    for field, value in cfg["training"].items():
        out += _emit(field, value)
    return out


def parallel_args(cfg: dict, variant: str = "tsp", size: Optional[int] = None) -> List[str]:
    """The only arguments an A/B changes. ``size`` overrides the config's D."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    par = cfg["parallel"]
    d = size if size is not None else par["tensor_sequence_parallel_size"]
    out: List[str] = []
    if variant == "tsp":
        out += ["--tensor-sequence-parallel-size", str(d)]
    elif variant == "tp":
        out += ["--tensor-model-parallel-size", str(d), "--sequence-parallel"]
    elif variant == "tsp_mlp":  # TP+SP with the TSP MLP ring (through the launcher)
        out += ["--tensor-model-parallel-size", str(d), "--sequence-parallel", "--tsp-mlp"]
    elif variant == "cp":
        out += ["--context-parallel-size", str(d), "--use-distributed-optimizer"]
    for field, value in par.items():
        if field in _PARALLEL_NOT_FLAGS:
            continue
        if field == "pipeline_model_parallel_size" and value == 1:
            continue
        out += _emit(field, value)
    return out


def to_megatron_args(cfg: dict, variant: str = "tsp", size: Optional[int] = None) -> List[str]:
    """Megatron-LM command-line arguments for ``cfg`` (model + training + parallel)."""
    return model_args(cfg) + training_args(cfg) + parallel_args(cfg, variant, size)


def world_size(cfg: dict) -> int:
    par = cfg["parallel"]
    return int(par.get("nodes", 1)) * int(par.get("gpus_per_node", 1))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_tsp.megatron_lm.configs",
        description="Print the Megatron-LM arguments of a config (one per line with --lines).",
    )
    parser.add_argument("config", nargs="?", help="config name in configs/ or a JSON path")
    parser.add_argument("--variant", choices=VARIANTS, default="tsp")
    parser.add_argument("--size", type=int, default=None, help="override D")
    parser.add_argument("--part", choices=("all", "model", "training", "parallel"), default="all")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a field (section.field or field); repeatable",
    )
    parser.add_argument("--lines", action="store_true", help="one argument per line")
    parser.add_argument("--get", metavar="FIELD", help="print one field (section.field)")
    parser.add_argument("--list", action="store_true", help="list the available configs")
    ns = parser.parse_args(argv)
    if ns.list or not ns.config:
        print("\n".join(available()))
        return 0 if ns.list else 2
    overrides = {}
    for item in ns.set:
        if "=" not in item:
            parser.error(f"--set expects FIELD=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        overrides[key] = parse_value(value)
    try:
        cfg = load_config(ns.config, overrides)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if ns.get:
        section, _, field = ns.get.rpartition(".")
        value = cfg[section][field] if section else cfg[field]
        print(json.dumps(value) if not isinstance(value, str) else value)
        return 0
    parts = {
        "model": model_args,
        "training": training_args,
        "parallel": lambda c: parallel_args(c, ns.variant, ns.size),
        "all": lambda c: to_megatron_args(c, ns.variant, ns.size),
    }
    args = parts[ns.part](cfg)
    print("\n".join(args) if ns.lines else " ".join(shlex.quote(a) for a in args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
