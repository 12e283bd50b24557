"""Numbers in README.md and docs/ come from the tools (``scripts/docs_numbers.py``).

The small-scale blocks (analytic ``plan`` / ``moe``) are regenerated and compared with what is
checked in; a planted edit in a copy of a doc is reported; every block's command, full-scale
ones included, gets through the CLI's argument parsing and checks (without running), and a
command the CLI rejects fails that check.
"""

import importlib.util
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    spec = importlib.util.spec_from_file_location(
        "docs_numbers", os.path.join(ROOT, "scripts", "docs_numbers.py")
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


dn = _load()


@pytest.fixture(scope="module")
def small():
    blocks = dn.selected("small")
    return blocks, dn.generate(blocks)


def test_small_blocks_match_the_tools(small):
    blocks, texts = small
    problems = dn.compare(blocks, texts)
    assert not problems, (
        "generated blocks differ from the tools (python3 scripts/docs_numbers.py --write):\n"
        + "\n\n".join(problems)
    )


def test_planted_edit_is_reported(small, tmp_path):
    blocks, texts = small
    block = next(b for b in blocks if b.id == "tsp-cp-7b")
    os.makedirs(tmp_path / os.path.dirname(block.file), exist_ok=True)
    shutil.copy(os.path.join(ROOT, block.file), tmp_path / block.file)
    assert dn.compare([block], texts, root=str(tmp_path)) == []
    doc = (tmp_path / block.file).read_text()
    start, end = dn.find(doc, block)
    row = doc.index("\n| 64 | 8 | 1 |", start)
    assert row < end
    planted = doc[: row + 1] + doc[row + 1 :].replace("| 64 | 8 | 1 |", "| 64 | 8 | 9 |", 1)
    (tmp_path / block.file).write_text(planted)
    problems = dn.compare([block], texts, root=str(tmp_path))
    assert len(problems) == 1 and "| 64 | 8 | 9 |" in problems[0]
    # a block whose markers are gone is reported too
    (tmp_path / block.file).write_text(doc.replace(dn.closing(block), ""))
    assert "markers missing" in dn.compare([block], texts, root=str(tmp_path))[0]


def test_every_block_is_in_its_file_once():
    ids = [b.id for b in dn.BLOCKS]
    assert len(ids) == len(set(ids))
    for b in dn.BLOCKS:
        assert b.scale in ("small", "full")
        doc = open(os.path.join(ROOT, b.file)).read()
        assert doc.count(f"<!-- generated ({b.id}) ") == 1, b.id
        assert doc.count(dn.closing(b)) == 1, b.id
        dn.find(doc, b)


@pytest.mark.parametrize("command", sorted({c for b in dn.BLOCKS for c in b.commands}))
def test_every_command_parses(command):
    dn.parse_only(command)


@pytest.mark.parametrize(
    "command",
    [
        # README's line before issue 35: --seq-length and --gpus are required
        "megatron-tsp plan --strategies tsp_cp,tp_cp --cp 2,4,8,16",
        # docs/megatron-lm.md's before: cp is no --scheme
        "megatron-tsp memory --model 7b --scheme cp --tp 8 --cp 8 --world-size 64 --seq 1048576",
    ],
)
def test_a_rejected_command_fails_the_parse_check(command, capsys):
    with pytest.raises(SystemExit) as exc:
        dn.parse_only(command)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err
