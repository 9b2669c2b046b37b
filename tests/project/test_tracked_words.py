"""Tracked files speak of the code and its measurements, not of how the work was organised: no issue numbers, work
periods or the machines the work ran on (the words the project's pre-stop hook greps for, and more)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Spelled in pieces, so that this file does not match itself.
WORDS = re.compile(
    r"\b" + "ses" + r"sions?\b|\b" + "le" + r"nt\b|" + "device " + r"calls?|" + "iss" + r"ues? #?[0-9]+|"
    + "borr" + r"owed (H100|H200|GPU|machine)",
    re.IGNORECASE,
)  # fmt: skip


def _tracked_text_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in names.decode().split("\0") if name and not name.endswith((".json", ".png"))]


def test_no_tracked_file_speaks_of_work_organisation():
    hits = []
    for path in _tracked_text_files():
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
        hits += [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
                 for n, line in enumerate(text.splitlines(), 1) if WORDS.search(line)]  # fmt: skip
    assert not hits, "reword these lines (describe the code and its measurements):\n" + "\n".join(hits)


@pytest.mark.parametrize(
    "line, found",
    [
        ("measured in the last work sess" + "ion on the GPU", True),
        ("the le" + "nt H200", True),
        ("see iss" + "ue 37", True),
        ("one devi" + "ce call ran it", True),
        ("on the borr" + "owed H200", True),
        ("subprocess.Popen(cmd, start_new_session=True)", False),
        ("a sessionless client", False),
        ("silent corruption", False),
    ],
)
def test_the_word_check_catches_what_it_should(line, found):
    assert bool(WORDS.search(line)) == found
