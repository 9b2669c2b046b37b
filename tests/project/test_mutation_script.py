"""``scripts/mutation_test.py`` and its list (``scripts/mutations.py``): every entry still applies (its snippet occurs
exactly once, so the list cannot rot unnoticed), names tests that exist, and a mutation is always undone."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_mutation_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return module


runner = _load("mutation_test")
MUTATIONS = runner.MUTATIONS


def test_names_are_unique_and_entries_complete():
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names))
    assert len(MUTATIONS) >= 20
    for m in MUTATIONS:
        assert m.original != m.mutated, m.name
        assert m.description and m.tests, m.name
        if m.native:
            assert m.file.startswith("csrc/") and m.file.endswith((".cpp", ".h")), m.name
        else:
            assert m.file.endswith(".py"), m.name


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.name)
def test_original_snippet_occurs_exactly_once(m):
    line = runner.locate(m, ROOT)
    assert line >= 1


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.name)
def test_selected_test_files_exist(m):
    for arg in m.tests:
        if arg.startswith("tests/"):
            assert (ROOT / arg.split("::")[0]).is_file(), (m.name, arg)


def _entry(**kw):
    fields = dict(name="t", file="x.py", original="a <= b", mutated="a < b", description="d", tests=("tests/x",))
    return runner.Mutation(**{**fields, **kw})


def test_apply_and_restore_round_trip(tmp_path):
    path = tmp_path / "x.py"
    text = "def f(a, b):\n    return a <= b\n"
    path.write_text(text)
    journal = runner.Journal(tmp_path)
    m = _entry()
    assert runner.locate(m, tmp_path) == 2
    with runner.Applied(m, tmp_path, journal):
        assert path.read_text() == "def f(a, b):\n    return a < b\n"
        assert journal.record.exists()
    assert path.read_text() == text
    assert not journal.record.exists()


def test_restored_after_an_exception(tmp_path):
    path = tmp_path / "x.py"
    path.write_bytes(b"x = a <= b\n")
    with pytest.raises(KeyboardInterrupt), runner.Applied(_entry(), tmp_path, runner.Journal(tmp_path)):
        raise KeyboardInterrupt
    assert path.read_bytes() == b"x = a <= b\n"


def test_a_killed_run_is_recovered_from_the_journal(tmp_path):
    path = tmp_path / "x.py"
    path.write_bytes(b"x = a <= b\n")
    journal = runner.Journal(tmp_path)
    applied = runner.Applied(_entry(), tmp_path, journal).__enter__()  # as if the process died inside the block
    assert path.read_bytes() == b"x = a < b\n" and applied.original == b"x = a <= b\n"
    message = runner.Journal(tmp_path).recover(tmp_path)
    assert "restored x.py" in message
    assert path.read_bytes() == b"x = a <= b\n"
    assert runner.Journal(tmp_path).recover(tmp_path) is None


@pytest.mark.parametrize("text", ["y = 1\n", "x = a <= b\nz = a <= b\n"], ids=["missing", "twice"])
def test_stale_entry_is_reported(tmp_path, text):
    (tmp_path / "x.py").write_text(text)
    with pytest.raises(runner.StaleMutation, match="exactly once"):
        runner.locate(_entry(), tmp_path)
    with pytest.raises(runner.StaleMutation):
        with runner.Applied(_entry(), tmp_path, runner.Journal(tmp_path)):
            pass
    assert (tmp_path / "x.py").read_text() == text
