"""Option coverage: every megatron-core ``TransformerConfig`` field and Megatron-LM argument that
TSP code reads is either exercised off its default by a TSP-vs-reference test, refused by a
rejection row at non-default values, or (a short list) not an option, with its reason.

The scan (``scan``) is an ``ast`` walk over the package's TSP code (``SCANNED``: core/,
inference/, models/, megatron_lm/). A *config read* is a load of ``R.field`` or a
``getattr(R, "field", ...)`` / ``hasattr(R, "field")`` where the receiver ``R`` is a name or
attribute ending in ``config`` or named ``cfg`` (``config``, ``self.config``,
``module.config``, ``transformer_config``, ...), or a local name assigned from such an expression
(``c = desc.config``); an *argument read* is the same on a receiver named ``args``. Reads are
kept when the name is a field of ``TransformerConfig`` / ``MLATransformerConfig`` (as installed,
plus the fields those classes declare in the Megatron-LM trees beside the checkout, so a
``getattr`` of a field only the other supported version has is found too) or the ``dest`` of an
argument of Megatron-LM's own parser (``add_megatron_arguments`` of the ``MEGATRON_LM_PATH``
tree, built in a subprocess, as ``tests/megatron_lm/test_rejection_flags.py`` does; without a
tree the argument half is skipped). A config field and the Megatron-LM argument of the same name
are one option (Megatron-LM copies the argument into the field), so the table has one entry per
name.

Fields in ``KNOWN_GAPS`` (with what would cover each) would be read without either; the list
is empty and a test keeps it so.

``tools/`` is not scanned: it holds the estimators, benchmarks, demo and command-line front ends.
Their ``args`` are their own parsers' (``--swiglu``, ``--normalization``, ``--rotary-base`` of
``megatron-tsp memory/generate``, names that collide with Megatron-LM's dests without being
them) and their ``config`` / ``cfg`` objects are the estimator's own dataclasses; the models they
run are built by the scanned code, whose reads are covered here.

The table (``COVERAGE``, below) is checked by ``tests/test_option_coverage.py``:

* ``Tested(field, test, value, source)``: ``test`` is a pytest id ``tests/FILE.py::test_fn`` (with
  an optional ``[param id]``) of a TSP-vs-reference test; the function must exist in the file,
  the param id must appear in it, ``value`` must differ from megatron-core's default (or
  Megatron-LM's argparse default for an argument), and the field name and ``source`` (the value
  as the test writes it, ``repr(value)`` by default) must both appear in the test's source
  closure: the function, its decorators and every function / module-level constant of tests/ it
  names, transitively.
* ``Refused(field, value, extra)``: a row of ``megatron_tsp.core.rejections`` names the field
  (``config_field`` or ``dest``) and refuses ``value``; for a config field,
  ``validation.check_transformer_config`` on a ``TransformerConfig`` with ``field=value`` (and
  ``extra``, what megatron-core needs to build it) raises ``ValueError`` naming the field.
* ``NotAnOption(field, reason, check)``: read but not a behaviour switch; ``check`` names what
  the test verifies: ``"no default"`` (megatron-core / Megatron-LM has no usable default: a
  required shape or a value derived in ``__post_init__`` / ``validate_args``) or ``"derived"``
  (not an argparse flag: Megatron-LM sets it in ``validate_args``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
from typing import Any, Dict, Iterable, List, Mapping, Optional, Set, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "megatron_tsp")
TESTS = os.path.join(REPO, "tests")
SCANNED = ("core", "inference", "models", "megatron_lm")

CONFIG_NAMES = ("cfg",)  # receivers named exactly so; any name ending in "config" is one too
ARGS_NAMES = ("args",)
# String-keyed reads of Megatron-LM arguments: helpers called with the argument's name as a string
# (``_get(m, "use_rope_scaling")`` in megatron_lm/model_args.py), and ``vars(args)["x"]`` /
# ``vars(args).get("x")``.
ARG_KEY_HELPERS = ("_get",)


# ------------------------------------------------------------------------------------------------
# the scan


@dataclasses.dataclass(frozen=True)
class Read:
    field: str
    kind: str  # "config" | "args"
    where: str  # path:line


def _receiver_kind(node: ast.AST, aliases: Mapping[str, str]) -> Optional[str]:
    if isinstance(node, ast.Name):
        name = node.id
        if name in aliases:
            return aliases[name]
    elif isinstance(node, ast.Attribute):
        name = node.attr
    else:
        return None
    if name in ARGS_NAMES:
        return "args"
    if name in CONFIG_NAMES or name.endswith("config"):
        return "config"
    return None


def _aliases(tree: ast.AST) -> Dict[str, str]:
    """Names assigned from a config / args expression anywhere in the module (``c = desc.config``);
    module-wide, which over-approximates scopes (a false alias only adds candidate reads, and
    those are filtered by the field names)."""
    out: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                kind = _receiver_kind(node.value, {})
                if kind and isinstance(node.value, (ast.Name, ast.Attribute)):
                    out[target.id] = kind
    return out


def reads_in_source(source: str, where: str = "<source>") -> List[Read]:
    """Every candidate config / args read in ``source`` (unfiltered by field names)."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            kind = _receiver_kind(node.value, aliases)
            if kind:
                out.append(Read(node.attr, kind, f"{where}:{node.lineno}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            kind = _receiver_kind(node.args[0], aliases)
            if kind:
                out.append(Read(node.args[1].value, kind, f"{where}:{node.lineno}"))
        if isinstance(node, ast.Call) and (
            isinstance(node.func, ast.Name) and node.func.id in ARG_KEY_HELPERS
        ):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    out.append(Read(arg.value, "args", f"{where}:{node.lineno}"))
        key = _vars_args_key(node, aliases)
        if key is not None:
            out.append(Read(key, "args", f"{where}:{node.lineno}"))
    return out


def _is_vars_of_args(node: ast.AST, aliases: Mapping[str, str]) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "vars"
        and len(node.args) == 1
        and _receiver_kind(node.args[0], aliases) == "args"
    )


def _vars_args_key(node: ast.AST, aliases: Mapping[str, str]) -> Optional[str]:
    """``"x"`` of ``vars(args).get("x", ...)`` or ``vars(args)["x"]``, else None."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and _is_vars_of_args(node.func.value, aliases)
        and node.args
    ):
        key = node.args[0]
    elif isinstance(node, ast.Subscript) and _is_vars_of_args(node.value, aliases):
        key = node.slice
    else:
        return None
    return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None


def package_files(parts: Iterable[str] = SCANNED) -> List[str]:
    files = []
    for part in parts:
        for root, _, names in os.walk(os.path.join(PACKAGE, part)):
            files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".py")]
    return sorted(files)


def scan(
    sources: Mapping[str, str], config_fields: Set[str], arg_dests: Set[str]
) -> Dict[str, List[Read]]:
    """field -> its reads in ``sources`` (path -> text), kept when the name is a config field
    (read on a config or on args) or a Megatron-LM argument dest (read on args)."""
    found: Dict[str, List[Read]] = {}
    for path, text in sources.items():
        for read in reads_in_source(text, path):
            if read.field in config_fields or (read.kind == "args" and read.field in arg_dests):
                found.setdefault(read.field, []).append(read)
    return found


def package_sources() -> Dict[str, str]:
    out = {}
    for path in package_files():
        with open(path, encoding="utf-8") as f:
            out[os.path.relpath(path, REPO)] = f.read()
    return out


# ------------------------------------------------------------------------------------------------
# what counts as a field / an argument, and their defaults

_MISSING = object()


@functools.lru_cache(maxsize=None)
def config_defaults() -> Dict[str, Any]:
    """Installed ``TransformerConfig`` / ``MLATransformerConfig`` fields -> default (``_MISSING``
    for none)."""
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    out: Dict[str, Any] = {}
    for cls in (TransformerConfig, MLATransformerConfig):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = _MISSING
            out.setdefault(f.name, default)
    return out


def megatron_lm_trees() -> List[str]:
    """The Megatron-LM trees the session knows (``MEGATRON_LM_PATH`` / ``_0_19``; tests/conftest
    unpacks them from ../shared/third_party)."""
    trees = []
    for key in ("MEGATRON_LM_PATH", "MEGATRON_LM_PATH_0_19"):
        tree = os.environ.get(key)
        if tree and os.path.isdir(os.path.join(tree, "megatron")) and tree not in trees:
            trees.append(tree)
    return trees


@functools.lru_cache(maxsize=None)
def tree_config_fields(tree: str) -> Tuple[str, ...]:
    """Fields declared (annotated class attributes) by ``TransformerConfig`` and
    ``MLATransformerConfig`` in a Megatron-LM tree's source."""
    path = os.path.join(tree, "megatron", "core", "transformer", "transformer_config.py")
    with open(path, encoding="utf-8") as f:
        module = ast.parse(f.read())
    out = []
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name in (
            "TransformerConfig",
            "MLATransformerConfig",
        ):
            out += [
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            ]
    return tuple(out)


def config_fields() -> Set[str]:
    fields = set(config_defaults())
    for tree in megatron_lm_trees():
        fields.update(tree_config_fields(tree))
    return fields


_PARSER_PROBE = r"""
import argparse, importlib.util, json, sys, types
sys.path[:0] = [sys.argv[1], sys.argv[2]]
if importlib.util.find_spec("triton") is None:
    # megatron.training imports Megatron's batch-invariant Triton kernels; the parser does not
    # need them
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    stub = types.ModuleType(name)
    stub.is_batch_invariant_mode_enabled = lambda: False
    sys.modules[name] = stub
from megatron.training import arguments
parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
out = {}
for action in parser._actions:
    default = action.default
    try:
        json.dumps(default)
    except TypeError:
        default = {"repr": repr(default)}
    out.setdefault(action.dest, default)
out.pop("help", None)
print("DESTS " + json.dumps(out))
"""


@functools.lru_cache(maxsize=None)
def argument_defaults(tree: str) -> Dict[str, Any]:
    """dest -> default of every argument of Megatron-LM's own parser (``add_megatron_arguments``
    of the tree, built in a subprocess: many arguments are generated from megatron-core's
    dataclasses, so the source's ``add_argument`` calls do not list them). A default that is
    not JSON comes back as ``{"repr": ...}``."""
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-c", _PARSER_PROBE, REPO, tree],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("DESTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("DESTS ") :])


def arg_defaults() -> Dict[str, Any]:
    """Megatron-LM's argument dests and defaults, from the tree of ``MEGATRON_LM_PATH`` (its
    parser runs on this interpreter; {} without a tree)."""
    tree = os.environ.get("MEGATRON_LM_PATH")
    if not tree or not os.path.isdir(os.path.join(tree, "megatron")):
        return {}
    return argument_defaults(tree)


def default_of(field: str) -> Any:
    """megatron-core's default for a config field, else Megatron-LM's argparse default."""
    defaults = config_defaults()
    if field in defaults:
        return defaults[field]
    return arg_defaults().get(field, _MISSING)


# ------------------------------------------------------------------------------------------------
# the table's entry kinds


@dataclasses.dataclass(frozen=True)
class Tested:
    field: str
    test: str  # tests/FILE.py::test_fn[param id]
    value: Any  # the non-default value the test uses
    source: Optional[str] = None  # the value as the test's source writes it (repr(value))

    @property
    def text(self) -> str:
        return self.source if self.source is not None else repr(self.value)


@dataclasses.dataclass(frozen=True)
class Refused:
    field: str
    value: Any
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False, compare=False)


@dataclasses.dataclass(frozen=True)
class NotAnOption:
    field: str
    reason: str
    check: str  # "no default" | "derived"


# ------------------------------------------------------------------------------------------------
# test-source closure (what a Tested entry's test reads)


@functools.lru_cache(maxsize=None)
def _tests_index() -> Tuple[Dict[str, List[ast.AST]], Dict[str, str]]:
    """name -> top-level function defs / module-level assignments of that name in tests/ (all
    modules: helpers are found by name), and the file each node's source comes from."""
    index: Dict[str, List[ast.AST]] = {}
    sources: Dict[str, str] = {}
    for root, dirs, names in os.walk(TESTS):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for n in sorted(names):
            if not n.endswith(".py"):
                continue
            path = os.path.join(root, n)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            module = ast.parse(text)
            sources[path] = text
            for node in module.body:
                node._coverage_path = path  # type: ignore[attr-defined]
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    index.setdefault(node.name, []).append(node)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        for name in ast.walk(t):
                            if isinstance(name, ast.Name):
                                index.setdefault(name.id, []).append(node)
    return index, sources


def test_function(test: str) -> Tuple[str, ast.FunctionDef, Optional[str]]:
    """(file path, function node, param id) of ``tests/FILE.py::test_fn[param]``; raises
    LookupError when the file or function is missing or the param id is not in the file."""
    path, _, rest = test.partition("::")
    name, _, param = rest.partition("[")
    param = param[:-1] if param.endswith("]") else None
    full = os.path.join(REPO, path)
    if not os.path.isfile(full):
        raise LookupError(f"{test}: no file {path}")
    index, sources = _tests_index()
    for node in index.get(name, []):
        if isinstance(node, ast.FunctionDef) and node._coverage_path == full:  # type: ignore
            if param and param not in sources[full]:
                raise LookupError(f"{test}: param id {param!r} does not appear in {path}")
            return full, node, param
    raise LookupError(f"{test}: no function {name} in {path}")


def closure_source(node: ast.AST) -> str:
    """The source of ``node`` (decorators included) and of every tests/ function, class or
    module-level constant it names, transitively."""
    index, sources = _tests_index()
    seen: Set[int] = set()
    texts: List[str] = []
    todo = [node]
    while todo:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        lines = sources[n._coverage_path].splitlines()  # type: ignore[attr-defined]
        first = min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])])
        texts.append("\n".join(lines[first - 1 : n.end_lineno]))
        for sub in ast.walk(n):
            name = (
                sub.id
                if isinstance(sub, ast.Name)
                else sub.attr
                if isinstance(sub, ast.Attribute)
                else None
            )
            if name:
                todo += index.get(name, [])
    return "\n".join(texts)


def names_field(text: str, field: str) -> bool:
    """The field as a keyword / dict key / attribute (its name) or as a command-line flag."""
    flag = "--" + field.replace("_", "-")
    return re.search(rf"\b{field}\b", text) is not None or re.search(rf"{flag}\b", text) is not None


# ------------------------------------------------------------------------------------------------
# read sites (for NotAnOption's checkable claims)


def read_sites(field: str, sources: Optional[Mapping[str, str]] = None) -> List[Read]:
    sources = package_sources() if sources is None else sources
    return [
        r for path, text in sources.items() for r in reads_in_source(text, path) if r.field == field
    ]


def assigned_on_args(field: str, sources: Optional[Mapping[str, str]] = None) -> bool:
    """Some scanned module assigns ``args.field = ...`` (TSP sets the argument itself)."""
    sources = package_sources() if sources is None else sources
    for text in sources.values():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if (
                        isinstance(t, ast.Attribute)
                        and t.attr == field
                        and _receiver_kind(t.value, {}) == "args"
                    ):
                        return True
    return False


def reads_only_in_raise(field: str, sources: Optional[Mapping[str, str]] = None) -> bool:
    """Every read of ``field`` sits inside a ``raise`` statement (named in a refusal only)."""
    sources = package_sources() if sources is None else sources
    total = inside = 0
    for path, text in sources.items():
        tree = ast.parse(text)
        raised = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise):
                raised.update(id(n) for n in ast.walk(node))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id == "getattr" and len(node.args) >= 2:
                    arg = node.args[1]
                    if isinstance(arg, ast.Constant) and arg.value == field:
                        total += 1
                        inside += id(node) in raised
            elif isinstance(node, ast.Attribute) and node.attr == field:
                if _receiver_kind(node.value, _aliases(tree)):
                    total += 1
                    inside += id(node) in raised
    return total > 0 and total == inside


@dataclasses.dataclass(frozen=True)
class RefusedBy:
    """Refused by the TSP code that reads it, not by a table row (an inference-only setting, or a
    layer option with no Megatron-LM launcher flag of its own): ``check`` (``module:function``)
    called on a ``TransformerConfig`` with ``field=value`` (as ``module.config`` when ``arg`` is
    ``"module"``) raises ``ValueError`` naming the field or its flag."""

    field: str
    value: Any
    check: str
    arg: str = "config"  # "config" | "module" (a stand-in with .config)


# ------------------------------------------------------------------------------------------------
# the table: one entry per field TSP code reads (test ids: tests/FILE.py::function)

_GPT = "tests/test_gpt.py::test_gpt_matches_single_process_fp64"
_LOOP = "tests/megatron_lm/test_training_loop.py::"
_MOE = "tests/test_moe.py::"
_MOE_LOOP = "tests/megatron_lm/test_moe_loop.py::"
_PACKED_LOOP = "tests/megatron_lm/test_packed_loop.py::"
_ARGS_MAP = "tests/test_model_args.py::test_megatron_args_mapping_reads_every_math_setting"

COVERAGE: Tuple[Any, ...] = (
    # --- shapes: every parity test sets them (megatron-core's defaults are placeholders)
    Tested("hidden_size", "tests/test_layers.py::test_mlp_matches_reference", 24, "24"),
    Tested("num_layers", _GPT, 2, "layers"),
    Tested("num_attention_heads", "tests/test_layers.py::test_attention_rope_variants", 8, "8"),
    Tested("ffn_hidden_size", "tests/test_layers.py::test_mlp_matches_reference", 40, "40"),
    Tested("num_query_groups", "tests/test_gpt.py::test_fewer_kv_heads_than_d", 1, "1"),
    Tested("kv_channels", "tests/test_gpt.py::test_kv_channels_not_hidden_over_heads", 16, "16"),
    Tested("params_dtype", _GPT, "float64", '"float64"'),
    Tested("tensor_model_parallel_size", _GPT, 4, "4"),
    Tested("sequence_parallel", _GPT, True, "sequence_parallel=d > 1"),
    Tested(
        "context_parallel_size",
        "tests/test_tsp_cp.py::test_gpt_matches_single_process_fp64",
        2,
        "2",
    ),
    # --- model options
    Tested("normalization", _GPT, "RMSNorm", '"RMSNorm"'),
    Tested("gated_linear_unit", _GPT, True, "gated_linear_unit=True"),
    Tested("activation_func", _GPT, "silu", "F.silu"),
    Tested(
        "bias_activation_fusion",
        "tests/test_layers.py::test_mlp_matches_reference",
        True,
        "bias_activation_fusion=True",
    ),
    Tested(
        "apply_rope_fusion",
        "tests/test_layers.py::test_attention_rope_variants",
        True,
        "config.apply_rope_fusion = True",
    ),
    Tested(
        "rotary_interleaved",
        "tests/test_layers.py::test_attention_rope_variants",
        True,
        "rotary_interleaved=interleaved",
    ),
    Tested(
        "attention_dropout",
        "tests/test_layers.py::test_attention_dropout_gradients_match_finite_differences",
        0.3,
        "dropout=0.3",
    ),
    Tested(
        "gradient_accumulation_fusion",
        "tests/test_layers.py::test_main_grad_contract",
        True,
        "fused.gradient_accumulation_fusion = True",
    ),
    Tested(
        "recompute_granularity",
        "tests/test_recompute.py::test_gpt_with_megatron_recompute_fp64",
        "selective",
        'recompute_granularity="selective"',
    ),
    Tested(
        "recompute_modules",
        "tests/test_recompute.py::test_gpt_with_megatron_recompute_fp64",
        ["core_attn", "mlp"],
        'recompute_modules=["core_attn", "mlp"]',
    ),
    # --- MoE
    Tested("num_moe_experts", _MOE + "test_moe_matches_single_process_fp64", 4, "num_moe_experts"),
    Tested(
        "expert_model_parallel_size", _MOE + "test_moe_matches_single_process_fp64", 2, "(2, 2)"
    ),
    Tested(
        "expert_tensor_parallel_size",
        _MOE + "test_moe_ring_matches_single_and_tp_sp_fp64",
        2,
        "expert_tensor_parallel_size=etp",
    ),
    Tested(
        "moe_layer_freq",
        _MOE + "test_moe_matches_single_process_fp64",
        [0, 1],
        "moe_layer_freq=[0, 1]",
    ),
    Tested(
        "moe_router_topk",
        _MOE + "test_moe_apply_probs_on_input_matches_single_and_tp_sp_fp64",
        1,
        "moe_router_topk=1",
    ),
    Tested(
        "moe_apply_probs_on_input",
        _MOE + "test_moe_apply_probs_on_input_matches_single_and_tp_sp_fp64",
        True,
        "moe_apply_probs_on_input=True",
    ),
    Tested(
        "moe_token_dispatcher_type",
        _MOE + "test_moe_alltoall_dispatcher_matches_single_and_tp_sp",
        "alltoall",
        '"alltoall"',
    ),
    # --- Megatron-LM arguments (the real pretrain_gpt.py loop, TSP vs stock TP)
    Tested("bf16", _LOOP + "test_bf16_distributed_optimizer_overlap_recompute", True, '"--bf16"'),
    Tested(
        "group_query_attention", _LOOP + "test_tsp2_matches_tp2", True, '"--group-query-attention"'
    ),
    Tested("pipeline_model_parallel_size", _LOOP + "test_pp2_tsp2", 2, '"2"'),
    Tested(
        "pipeline_model_parallel_layout",
        _LOOP + "test_interleaved_pp2_tsp2_matches_tp2_sp",
        "Ett|t|t|L",
        '"Ett|t|t|L"',
    ),
    Tested("seq_length", _LOOP + "test_tsp2_matches_tp2", 64, '"--seq-length"'),
    # --- SwiGLU options, attention scale, NoPE layers (fp64 layer parity, D 2 and 4)
    Tested(
        "activation_func_clamp_value",
        "tests/test_layers.py::test_mlp_glu_options[clamp_0.5]",
        0.5,
        "activation_func_clamp_value=0.5",
    ),
    Tested(
        "glu_linear_offset",
        "tests/test_layers.py::test_mlp_glu_options[offset_1.0]",
        1.0,
        "glu_linear_offset=1.0",
    ),
    Tested(
        "activation_func_fp8_input_store",
        "tests/test_layers.py::test_mlp_glu_options[fp8_input_store]",
        True,
        "activation_func_fp8_input_store=True",
    ),
    Tested(
        "add_bias_linear",
        "tests/test_layers.py::test_mlp_glu_options[fp8_input_store]",
        False,
        "False",
    ),
    Tested(
        "softmax_scale",
        "tests/test_layers.py::test_attention_scale_and_nope[softmax_scale_0.3]",
        0.3,
        "(0.3, None)",
    ),
    Tested(
        "no_rope_freq",
        "tests/test_layers.py::test_attention_scale_and_nope[no_rope_freq_layer1]",
        [1],
        "(None, [1])",
    ),
    # --- Megatron-LM arguments read by name (megatron_lm/model_args.py, arguments.py): the
    # mapping test gives each a non-default value and checks its config field / GPTModel
    # argument; those fields' parity is test_model_args.py::test_each_option_generates_like_...
    Tested("use_rope_scaling", _ARGS_MAP, True, "use_rope_scaling=True"),
    Tested("rope_scaling_factor", _ARGS_MAP, 16.0, "rope_scaling_factor=16.0"),
    Tested(
        "rotary_seq_len_interpolation_factor",
        _ARGS_MAP,
        4.0,
        "rotary_seq_len_interpolation_factor=4.0",
    ),
    Tested("rotary_percent", _ARGS_MAP, 0.5, "rotary_percent=0.5"),
    Tested("rotary_base", _ARGS_MAP, 500000, "rotary_base=500000"),
    Tested("swiglu", _ARGS_MAP, True, "swiglu=True"),
    Tested(
        "squared_relu",
        "tests/test_model_args.py::test_megatron_args_mapping_squared_relu",
        True,
        "squared_relu=True",
    ),
    Tested("add_qkv_bias", _ARGS_MAP, True, "add_qkv_bias=True"),
    Tested(
        "untie_embeddings_and_output_weights",
        _ARGS_MAP,
        True,
        "untie_embeddings_and_output_weights=True",
    ),
    Tested("position_embedding_type", _ARGS_MAP, "rope", 'position_embedding_type="rope"'),
    Tested("num_experts", _MOE_LOOP + "test_tsp2_ep2_matches_tp2_sp_ep2", 4, '"--num-experts"'),
    # packed documents: the batch hook reads them (megatron_lm/documents.py); TSP vs TP with
    # Megatron's dense document mask in the real loop
    Tested(
        "reset_attention_mask",
        _PACKED_LOOP + "test_packed_tsp2_matches_tp2",
        True,
        '"--reset-attention-mask"',
    ),
    Tested(
        "reset_position_ids",
        _PACKED_LOOP + "test_reset_position_ids_alone_is_one_document",
        True,
        '"--reset-position-ids"',
    ),
    # --- refused at non-default values
    Refused("layernorm_zero_centered_gamma", True),
    Refused("fp32_residual_connection", True),
    Refused("use_mup", True),
    Refused("moe_grouped_gemm", True, {"num_moe_experts": 4, "add_bias_linear": False}),
    Refused("multi_latent_attention", True),
    Refused("qk_layernorm", True),
    Refused("mtp_num_layers", 1),
    RefusedBy("use_te_activation_func", True, "megatron_tsp.core.layers.mlp:make_activation"),
    RefusedBy(
        "fine_grained_activation_offloading",
        True,
        "megatron_tsp.core.layers.attention:check_offloading",
    ),
    RefusedBy(
        "flash_decode", True, "megatron_tsp.core.layers.prefill_attention:check_context", "module"
    ),
    # --- not options
    NotAnOption(
        "offload_modules",
        "named only in fine_grained_activation_offloading's refusal",
        "refusal message only",
    ),
    NotAnOption(
        "padded_vocab_size",
        "Megatron-LM derives it in validate_args from --vocab-size / the tokenizer",
        "no default",
    ),
    NotAnOption("spec", "the launcher sets it to the TSP block spec", "set by TSP"),
    NotAnOption(
        "create_attention_mask_in_dataloader",
        "the launcher turns it off (TSP builds no mask)",
        "set by TSP",
    ),
    NotAnOption("fp16", "the dry run's dtype size for its meta-device report", "dry-run only"),
    NotAnOption("seed", "the dry run seeds its meta-device build", "dry-run only"),
    NotAnOption("micro_batch_size", "printed by the dry run", "dry-run only"),
    NotAnOption("global_batch_size", "printed by the dry run", "dry-run only"),
    NotAnOption("use_tp_pp_dp_mapping", "the dry run's rank-order report", "dry-run only"),
    NotAnOption(
        "virtual_pipeline_model_parallel_size",
        "the dry run's stage count (the loop's interleaved test sets it through the layout)",
        "dry-run only",
    ),
)


# Read, but with neither a test off the default nor a refusal yet: field -> what would cover it.
# Empty, and ``test_no_known_gaps`` keeps it so: a new read needs an entry in COVERAGE (a field
# read and in neither table fails ``test_every_read_field_has_an_entry`` by name).
KNOWN_GAPS: Dict[str, str] = {}


# ------------------------------------------------------------------------------------------------
# the checker

NOT_AN_OPTION_CHECKS = ("no default", "set by TSP", "dry-run only", "refusal message only")


def found_fields(sources: Optional[Mapping[str, str]] = None) -> Dict[str, List[Read]]:
    sources = package_sources() if sources is None else sources
    return scan(sources, config_fields(), set(arg_defaults()))


def uncovered(
    found: Mapping[str, List[Read]],
    table: Iterable[Any] = COVERAGE,
    gaps: Mapping[str, str] = KNOWN_GAPS,
) -> List[str]:
    """One line per field read without an entry (or a known gap), naming the field and where it
    is read."""
    covered = {entry.field for entry in table} | set(gaps)
    return [
        f"{field}: read at {', '.join(r.where for r in reads[:3])} but has no entry in "
        "tests/option_coverage.py COVERAGE (a TSP-vs-reference test off its default, a "
        "rejection, or why it is not an option)"
        for field, reads in sorted(found.items())
        if field not in covered
    ]


def _differs(value: Any, default: Any) -> bool:
    if default is _MISSING:
        return True
    if isinstance(default, dict) and set(default) == {"repr"}:
        return repr(value) != default["repr"]
    if callable(default) and isinstance(value, str):
        return getattr(default, "__name__", None) != value
    if hasattr(default, "is_floating_point") or type(default).__name__ == "dtype":
        return str(default).split(".")[-1] != str(value)
    return value != default


def check_tested(entry: Tested) -> List[str]:
    out = []
    try:
        _, node, _ = test_function(entry.test)
    except LookupError as exc:
        return [f"{entry.field}: {exc}"]
    default = default_of(entry.field)
    if not _differs(entry.value, default):
        out.append(f"{entry.field}: {entry.value!r} is the default ({default!r})")
    text = closure_source(node)
    if not names_field(text, entry.field) and not (
        entry.field in arg_defaults() and entry.text.strip("\"'").startswith("--")
    ):
        out.append(f"{entry.field}: not named in {entry.test} or the helpers it uses")
    if entry.text not in text:
        out.append(f"{entry.field}: {entry.text!r} does not appear in {entry.test}'s source")
    return out


def _config_with(field: str, value: Any, extra: Mapping[str, Any]):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        use_cpu_initialization=True,
    )
    fields.update(extra)
    config = TransformerConfig(**fields)
    # set after construction: megatron-core's __post_init__ checks what each setting needs on a
    # GPU (Transformer Engine, kernels); the TSP checks read the field as given
    setattr(config, field, value)
    return config


def _raises_naming(call, field: str) -> Optional[str]:
    flag = "--" + field.replace("_", "-")
    try:
        call()
    except ValueError as exc:
        if field in str(exc) or flag in str(exc):
            return None
        return f"refused without naming {field}: {exc}"
    return "not refused"


def check_refused(entry: Refused) -> List[str]:
    from megatron_tsp.core import rejections, validation

    rows = [
        r
        for r in rejections.rows(rejections.TSP)
        if entry.field in (r.config_field, r.dest) and r.refuses(entry.value, 2)
    ]
    if not rows:
        return [f"{entry.field}: no TSP rejection row refuses {entry.value!r}"]
    if not _differs(entry.value, default_of(entry.field)):
        return [f"{entry.field}: {entry.value!r} is the default"]
    if entry.field not in config_defaults():  # a Megatron-LM argument (or another version's)
        problem = _raises_naming(
            lambda: rejections.raise_if_any(
                rejections.refusals_for_args(
                    type("Args", (), {entry.field: entry.value})(), 2, stage=rows[0].stage
                )
            ),
            entry.field,
        )
    else:
        config = _config_with(entry.field, entry.value, entry.extra)
        problem = _raises_naming(lambda: validation.check_transformer_config(config), entry.field)
    return [f"{entry.field}={entry.value!r}: {problem}"] if problem else []


def check_refused_by(entry: RefusedBy) -> List[str]:
    import importlib
    import types

    if not _differs(entry.value, default_of(entry.field)):
        return [f"{entry.field}: {entry.value!r} is the default"]
    module, _, name = entry.check.partition(":")
    fn = getattr(importlib.import_module(module), name)
    config = _config_with(entry.field, entry.value, {})
    if entry.arg == "module":
        stand_in = types.SimpleNamespace(config=config, layer_number=1)
        context = types.SimpleNamespace(
            is_static_batching=lambda: True, is_decode_only=lambda: False
        )
        call = lambda: fn(stand_in, context)  # noqa: E731
    else:
        call = lambda: fn(config)  # noqa: E731
    problem = _raises_naming(call, entry.field)
    return [f"{entry.field}={entry.value!r} ({entry.check}): {problem}"] if problem else []


def check_not_an_option(entry: NotAnOption, sources: Mapping[str, str]) -> List[str]:
    bad = f"{entry.field} ({entry.check}): "
    if entry.check == "no default":
        if default_of(entry.field) not in (None, 0, _MISSING):
            return [bad + f"has the default {default_of(entry.field)!r}"]
    elif entry.check == "set by TSP":
        if not assigned_on_args(entry.field, sources):
            return [bad + "no scanned module assigns args." + entry.field]
    elif entry.check == "dry-run only":
        where = {r.where.rsplit(":", 1)[0] for r in read_sites(entry.field, sources)}
        others = sorted(w for w in where if not w.endswith("dry_run.py"))
        if others:
            return [bad + f"also read in {others}"]
    elif entry.check == "refusal message only":
        if not reads_only_in_raise(entry.field, sources):
            return [bad + "read outside a raise statement"]
    else:
        return [bad + f"unknown check (one of {NOT_AN_OPTION_CHECKS})"]
    return []


def check_entry(entry: Any, sources: Optional[Mapping[str, str]] = None) -> List[str]:
    sources = package_sources() if sources is None else sources
    if isinstance(entry, Tested):
        return check_tested(entry)
    if isinstance(entry, Refused):
        return check_refused(entry)
    if isinstance(entry, RefusedBy):
        return check_refused_by(entry)
    return check_not_an_option(entry, sources)
