"""Every TransformerConfig field / Megatron-LM argument TSP code reads is exercised off its default
by a TSP-vs-reference test, refused at non-default values, or declared not an option
(``tests/option_coverage.py``: the scan, the table ``COVERAGE`` and its checks)."""

from __future__ import annotations

import functools

import pytest

from tests import option_coverage as oc

# A module of "TSP code" with one read of each form the scan knows, and one it must ignore.
PLANTED = """
def forward(self, layer, args, x):
    a = self.config.hidden_size
    b = layer.config.some_untested_field
    c = getattr(transformer_config, "another_untested_field", None)
    alias = self.module.config
    d = alias.aliased_untested_field
    e = args.some_untested_argument
    f = self.weights.not_a_config_read
    return cfg.num_layers
"""


@functools.lru_cache(maxsize=None)
def _found():
    return oc.found_fields()


def test_scan_finds_every_form_of_read_in_planted_source():
    reads = {(r.field, r.kind) for r in oc.reads_in_source(PLANTED, "planted.py")}
    assert reads >= {
        ("hidden_size", "config"),
        ("some_untested_field", "config"),
        ("another_untested_field", "config"),
        ("aliased_untested_field", "config"),
        ("some_untested_argument", "args"),
        ("num_layers", "config"),
    }, reads
    assert "not_a_config_read" not in {field for field, _ in reads}


# String-keyed argument reads (megatron_lm/model_args.py's helper, arguments.py's vars(args)).
PLANTED_KEYED = """
def mapping(m, args):
    a = _get(m, "some_keyed_argument")
    b = vars(args).get("another_keyed_argument")
    c = vars(args)["third_keyed_argument"]
    d = vars(self.other).get("not_an_args_read")
    return m.get("not_through_the_helper")
"""


def test_scan_finds_string_keyed_argument_reads():
    reads = {(r.field, r.kind) for r in oc.reads_in_source(PLANTED_KEYED, "planted.py")}
    assert reads >= {
        ("some_keyed_argument", "args"),
        ("another_keyed_argument", "args"),
        ("third_keyed_argument", "args"),
    }, reads
    assert not {"not_an_args_read", "not_through_the_helper"} & {f for f, _ in reads}
    found = oc.scan(
        {"megatron_tsp/megatron_lm/planted.py": PLANTED_KEYED},
        set(),
        {"some_keyed_argument", "another_keyed_argument", "third_keyed_argument"},
    )
    assert len(oc.uncovered(found)) == 3, found


def test_a_new_field_read_fails_by_name():
    """Planted: TSP code reads a field the table does not know; the checker names it (and the
    place it is read), and nothing else of the planted module."""
    fields = {"hidden_size", "num_layers", "some_untested_field", "another_untested_field"}
    found = oc.scan({"megatron_tsp/core/planted.py": PLANTED}, fields, {"some_untested_argument"})
    assert set(found) == fields | {"some_untested_argument"}
    problems = oc.uncovered(found)
    named = sorted(p.split(":")[0] for p in problems)
    assert named == [
        "another_untested_field",
        "some_untested_argument",
        "some_untested_field",
    ], problems
    assert "megatron_tsp/core/planted.py:4" in problems[-1]


def test_a_stale_or_wrong_entry_fails():
    """The entry checks can fail: a missing test, a default value, a value the test does not
    write, a field no row refuses, a field that is not refused."""
    assert oc.check_entry(oc.Tested("hidden_size", "tests/test_gpt.py::no_such_test", 24))
    assert oc.check_entry(oc.Tested("sequence_parallel", oc.COVERAGE[0].test, False))
    assert oc.check_entry(oc.Tested("hidden_size", oc.COVERAGE[0].test, 12345))
    assert oc.check_entry(oc.Refused("normalization", "RMSNorm"))
    assert oc.check_entry(
        oc.RefusedBy(
            "normalization", "RMSNorm", "megatron_tsp.core.layers.attention:check_offloading"
        )
    )


def test_scan_of_the_package_finds_config_and_argument_reads():
    found = _found()
    assert {"hidden_size", "kv_channels", "normalization", "gated_linear_unit"} <= set(found)
    if oc.arg_defaults():  # Megatron-LM's parser (MEGATRON_LM_PATH)
        assert {"seq_length", "spec"} <= set(found)
        assert any(r.kind == "args" for r in found["tensor_model_parallel_size"])


def test_every_read_field_has_an_entry():
    problems = oc.uncovered(_found())
    assert not problems, "\n".join(problems)


def test_no_stale_entries():
    found = _found()
    entries = [e.field for e in oc.COVERAGE]
    assert len(entries) == len(set(entries)), "one entry per field"
    stale = sorted((set(entries) | set(oc.KNOWN_GAPS)) - set(found))
    assert not stale, f"entries for fields TSP code no longer reads: {stale}"
    both = sorted(set(entries) & set(oc.KNOWN_GAPS))
    assert not both, f"covered fields still listed in KNOWN_GAPS: {both}"


@pytest.mark.parametrize("entry", oc.COVERAGE, ids=[e.field for e in oc.COVERAGE])
def test_entry_holds(entry):
    problems = oc.check_entry(entry)
    assert not problems, "\n".join(problems)


def test_no_known_gaps():
    assert not oc.KNOWN_GAPS, "\n".join(f"{k}: {v}" for k, v in oc.KNOWN_GAPS.items())
