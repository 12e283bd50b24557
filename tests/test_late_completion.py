"""Late completion: the layer, hybrid and inference checks with every asynchronous
transfer completing as late as on a GPU (``tests/late_completion.py``: send buffers read at
``wait()``, receive buffers NaN until then, transfers run no earlier than their wait), so a buffer
read or reused while its transfer may still run fails here although gloo forgives it. Also: the
wrapper's own reports, and a source scan that ``comm.py`` is the only module of the core that
posts asynchronous transfers (so the wrapper sees them all)."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest
import torch.distributed as dist

from tests import (
    checks_gpt,
    checks_hybrid,
    checks_inference,
    checks_late_completion,
    checks_layers,
    checks_moe,
)
from tests.late_completion import WRAPPED

CORE = pathlib.Path(__file__).resolve().parent.parent / "megatron_tsp" / "core"

# --------------------------------------------------------------------------------------------
# the wrapper itself (the checks enter the mode themselves: late_completion=False)


def test_send_buffer_written_before_wait_is_reported(pool4):
    results = pool4.run(
        checks_late_completion.check_send_written_before_wait, late_completion=False
    )
    for rank, r in enumerate(results):
        message = r["message"]
        assert "1 violation(s)" in message, message
        assert "reduce_scatter_single #0" in message, message
        assert "send buffer 1 (8,) was written after the post" in message, message
        assert "tests/checks_late_completion.py" in message and "early_write" in message, message


def test_receive_buffers_hold_garbage_until_wait(pool4):
    for rank, seen in enumerate(
        pool4.run(checks_late_completion.check_recv_garbage_until_wait, late_completion=False)
    ):
        assert seen == {
            "all_gather": True,
            "all_gather_complete": False,
            "broadcast": True,
            "reduce": True,
            "ring": True,
            "int_sentinel": True,
            "all_gather_after_sync": True,
            "all_gather_complete_after_wait": True,
        }, (rank, seen)


def test_never_waited_transfer_is_named(pool4):
    for r in pool4.run(checks_late_completion.check_never_waited, late_completion=False):
        message = r["message"]
        assert "broadcast #0 [lc_label] posted at" in message, message
        assert "(forget): never waited" in message, message


def test_buffer_reused_while_in_flight_is_reported(pool4):
    for r in pool4.run(checks_late_completion.check_buffer_reused_in_flight, late_completion=False):
        message = r["message"]
        assert "reduce_scatter_single #1 posted at tests/checks_late_completion.py" in message, (
            message
        )
        assert "its recv buffer (2,) overlaps the recv buffer of reduce_scatter_single #0" in (
            message
        ), message


def test_receive_buffer_written_before_wait_is_reported(pool4):
    for r in pool4.run(
        checks_late_completion.check_recv_written_before_wait, late_completion=False
    ):
        message = r["message"]
        assert "batch_isend_irecv #0" in message, message
        assert "recv buffer 1 (4,) was written after the post" in message, message


# --------------------------------------------------------------------------------------------
# coverage: comm.py posts every asynchronous transfer of the core, and the wrapper wraps them

_ASYNC_ONLY = {"isend", "irecv", "batch_isend_irecv", "P2POp"}


def _async_position(name: str):
    fn = getattr(dist, name, None)
    if not callable(fn) or name in _ASYNC_ONLY:
        return None
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("async_op") if "async_op" in params else None


def async_posts(source: str, filename: str = "<source>") -> list:
    """Where ``source`` posts an asynchronous transfer through ``torch.distributed`` directly:
    P2P (``isend`` / ``irecv`` / ``batch_isend_irecv`` / ``P2POp``, named or imported) or a
    collective whose ``async_op`` (keyword or positional) is anything but the constant False."""
    tree = ast.parse(source)
    modules, direct, found = {"torch.distributed"}, {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed":
                    modules.add(alias.asname or "torch.distributed")
        elif isinstance(node, ast.ImportFrom) and node.module in (
            "torch",
            "torch.distributed",
            "torch.distributed.distributed_c10d",
        ):
            for alias in node.names:
                if node.module == "torch" and alias.name == "distributed":
                    modules.add(alias.asname or "distributed")
                elif node.module != "torch":
                    direct[alias.asname or alias.name] = alias.name
                    if alias.name in _ASYNC_ONLY:
                        found.append(f"{filename}:{node.lineno}: imports {alias.name}")

    def dist_name(node):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in modules:
            return node.attr
        if isinstance(node, ast.Name):
            return direct.get(node.id)
        return None

    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)) and dist_name(node) in _ASYNC_ONLY:
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
        if not isinstance(node, ast.Call):
            continue
        name = dist_name(node.func)
        position = _async_position(name) if name else None
        if position is None:
            continue
        flags = [kw.value for kw in node.keywords if kw.arg == "async_op"]
        if len(node.args) > position:
            flags.append(node.args[position])
        for flag in flags:
            if not (isinstance(flag, ast.Constant) and flag.value is False):
                found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_comm_posts_async_transfers():
    """Every module of megatron_tsp/core except comm.py: no asynchronous transfer of its own (it
    posts through comm's functions, which the late-completion wrapper covers)."""
    found = []
    for path in sorted(CORE.rglob("*.py")):
        if path.name == "comm.py" and path.parent == CORE:
            continue
        found += async_posts(path.read_text(), str(path.relative_to(CORE.parent.parent)))
    assert found == [], "asynchronous transfers outside core/comm.py:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source,flagged",
    [
        ("import torch.distributed as dist\ndist.broadcast(t, 0, group=g, async_op=True)", 1),
        ("import torch.distributed as d\nd.all_reduce(t, d.ReduceOp.SUM, g, True)", 1),
        ("import torch\ntorch.distributed.reduce_scatter_tensor(o, i, group=g, async_op=a)", 1),
        ("from torch import distributed as td\ntd.batch_isend_irecv(ops)", 1),
        ("from torch.distributed import isend\nisend(t, 1)", 2),  # the import and the call
        ("from torch.distributed import all_gather_into_tensor as ag\nag(o, i, None, True)", 1),
        ("import torch.distributed as dist\ndist.broadcast(t, 0, group=g, async_op=False)", 0),
        ("import torch.distributed as dist\ndist.all_gather(parts, t, group=g)", 0),
        ("from megatron_tsp.core.comm import broadcast_from\nbroadcast_from(b, 0, g)", 0),
    ],
)
def test_async_scan_catches_direct_posts(source, flagged):
    assert len(async_posts(source)) == flagged, async_posts(source)


def test_every_comm_collective_is_wrapped():
    """The torch.distributed functions comm.py reaches (``dist.<name>`` or ``getattr(dist,
    "<name>")``) that can post asynchronously are all in WRAPPED; isend / irecv only travel in
    P2POps (never called directly)."""
    tree = ast.parse((CORE / "comm.py").read_text())
    used, called = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "dist":
            used.add(node.attr)
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "getattr"
            and ast.unparse(node.args[0]) == "dist"
        ):
            used.add(node.args[1].value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if ast.unparse(node.func.value) == "dist":
                called.add(node.func.attr)
    can_post = {n for n in used if n == "batch_isend_irecv" or _async_position(n) is not None}
    assert can_post, used
    assert can_post <= set(WRAPPED), can_post - set(WRAPPED)
    assert not {"isend", "irecv"} & called, called


# --------------------------------------------------------------------------------------------
# the layer, hybrid and inference checks under late completion (fp64)


def _posted(pool) -> int:
    """Transfers emulated in the last late-completion check (the same on every rank): shows the
    mode was on and saw the schedule's transfers."""
    counts = pool.run(checks_late_completion.last_posted, late_completion=False)
    assert len(set(counts)) == 1, counts
    return counts[0]


@pytest.mark.parametrize("d", [2, 4])
def test_attention_late_completion(pool4, seed, d):
    """GQA + RoPE, saved backward (dK/dV reduce-scatters waited one group later) and MHA with
    biases in recompute mode (three weight shards read at once)."""
    common = dict(seq=16, batch=2, late_completion=True)
    pool4.run(
        checks_layers.check_attention, d, seed, "float64", heads=8, groups=4, bias=False,
        rope=True, hidden=64, attention_backward="saved", **common,
    )  # fmt: skip
    # D broadcasts + 2D gathers (two halves per head group); backward 3D more, 2D RS, D reduces
    assert _posted(pool4) == 9 * d
    pool4.run(
        checks_layers.check_attention, d, seed, "float64", heads=4, groups=4, bias=True,
        rope=False, hidden=32, attention_backward="recompute", **common,
    )  # fmt: skip
    assert _posted(pool4) == 9 * d


@pytest.mark.parametrize("d", [2, 4])
def test_mlp_late_completion(pool4, seed, d):
    """The weight ring and, one hop behind it in backward, the gradient-accumulator ring."""
    pool4.run(
        checks_layers.check_mlp, d, seed, "float64", gated=True, bias=True, seq=16, batch=2,
        hidden=16, ffn=32, activation="silu", recompute_activation=False, late_completion=True,
    )  # fmt: skip
    assert _posted(pool4) == 3 * (d - 1)  # ring steps: D-1 forward, 2(D-1) backward


def test_main_grad_late_completion(pool4, seed):
    """The owner reduce into Megatron's main_grad path (attention) under late completion."""
    pool4.run(checks_layers.check_main_grad_contract, 2, seed, "attention", late_completion=True)
    assert _posted(pool4) == 4 * 9 * 2  # plain and fused layer, two steps each, 9D transfers


@pytest.mark.parametrize("d,style", [(2, "llama"), (4, "gpt2")])
def test_hybrid_late_completion(pool4, seed, d, style):
    """TP+SP attention + TSP MLP (``--tsp-mlp``), a whole GPT model against one process."""
    results = pool4.run(checks_hybrid.check_hybrid_vs_single, d, seed, style, late_completion=True)
    worst = max(v for r in results for v in r.values())
    assert worst <= 1e-10, results[0]  # NaN (read before a wait) fails the comparison
    assert _posted(pool4) == 2 * 3 * (d - 1)  # two layers' MLP rings (the attention is TP+SP)


@pytest.mark.parametrize("d", [2, 4])
def test_inference_late_completion(pool4, seed, d):
    """TSP prefill (async weight broadcasts) then TP decode."""
    results = pool4.run(checks_inference.check_generation, d, seed, "llama", late_completion=True)
    worst = max(max(r.values()) for r in results)
    assert worst <= 1e-12, results[0]  # NaN fails the comparison
    assert _posted(pool4) > 0  # the prefill's weight broadcasts (their number: prompt lengths)


@pytest.mark.parametrize("d,style", [(2, "llama"), (4, "gpt2")])
def test_gpt_vocab_ring_late_completion(pool4, seed, d, style):
    """A whole GPT (two layers) with its loss on the vocabulary ring (``output_head``): the
    output weight's shards and, in backward, their fp32 gradient accumulator on the ring."""
    pool4.run(
        checks_gpt.check_gpt_vs_single, d, seed, style, rtol=1e-10, vocab_ring=True,
        late_completion=True,
    )  # fmt: skip
    # two layers' attention (9D each) and MLP rings (3(D-1) each), then the vocabulary ring
    assert _posted(pool4) == 2 * 9 * d + 2 * 3 * (d - 1) + 3 * (d - 1)


@pytest.mark.parametrize("d", [2, 4])
def test_moe_expert_ring_late_completion(pool4, seed, d):
    """The TSP expert ring (``tsp_moe_ring``: every expert sharded 1/D on the weight ring) in a
    GPT with a MoE layer, against the single-process model and Megatron TP=D+SP (fp64)."""
    pool4.run(checks_moe.check_moe_ring, d, seed, "moe", late_completion=True)
    # two layers, each TSP attention (9D) and a MoE layer whose experts ride one ring (3(D-1))
    assert _posted(pool4) == 2 * 9 * d + 2 * 3 * (d - 1)
