"""Every ```python block of README.md and docs/*.md runs as written.

A block is executed (in a fresh namespace, from a temporary working directory) unless the line before it marks it:

- ``<!-- fragment -->`` (any text may follow the word, e.g. ``<!-- fragment: needs a process group -->``): a piece
  of a program that names things it does not define; it is only compiled;
- ``<!-- gpu -->``: runs only where torch sees a CUDA device (skipped, with the reason, elsewhere).

A block that imports an optional framework that is not installed (transformers, accelerate, lightning, torchvision,
timm) is skipped with that reason. Also here: the claims of the quick start and of docs/backends.md about the CPU.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!--\s*(fragment|gpu)\b.*-->\s*$")
OPTIONAL = ("transformers", "accelerate", "lightning", "pytorch_lightning", "torchvision", "timm")


def _blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """(line of the opening fence, code, mark) of each ```python block of ``path``."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            assert j < len(lines), f"{path.name}:{start + 1}: unclosed ```python block"
            before = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            mark = MARK.match(before)
            blocks.append((start + 1, "\n".join(lines[start + 1 : j]), mark.group(1) if mark else None))
            i = j
        i += 1
    return blocks


def _params():
    params = []
    for path in DOCS:
        for line, code, mark in _blocks(path):
            marks = [pytest.mark.gpu] if mark == "gpu" else []
            params.append(pytest.param(path, line, code, mark, id=f"{path.name}:{line}", marks=marks))
    return params


def _fresh_accelerate_state() -> None:
    try:
        from accelerate.state import AcceleratorState, GradientState
    except ImportError:
        return
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.parametrize(("path", "line", "code", "mark"), _params())
def test_block_runs(path, line, code, mark, tmp_path, monkeypatch, matmul_tuning):
    # matmul_tuning: a block that sets a switch of ampkernels.matmul.tuning (docs/backends.md) leaves it to this block
    where = f"{path.relative_to(ROOT)}:{line}"
    compiled = compile(code, where, "exec")  # a fragment must at least be Python
    if mark == "fragment":
        return
    monkeypatch.chdir(tmp_path)  # a block may write checkpoints or logs
    _fresh_accelerate_state()  # as in a new process: an Accelerator made by an earlier test fixed the state
    namespace = {"__name__": "__main__", "__file__": str(tmp_path / "snippet.py")}
    try:
        exec(compiled, namespace)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in OPTIONAL:
            pytest.skip(f"{where} needs {exc.name}, which is not installed")
        raise


def test_blocks_are_found_and_marks_are_known():
    """The parser finds the blocks (the README's quick start runs unmarked), and every comment on the line just
    before a block's fence is one of the two known marks: a misspelt one would silently run a fragment."""
    readme = _blocks(ROOT / "README.md")
    assert any(mark is None and "FusedGradScaler(device)" in code for _, code, mark in readme)
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, text in enumerate(lines[1:], start=1):
            before = lines[i - 1].strip()
            if text.strip() == "```python" and before.startswith("<!--"):
                assert MARK.match(before), f"{path.name}:{i}: unknown block marker {before!r} (fragment, gpu)"
        assert not any(line.strip() in ("```py", "```python3") for line in lines), f"{path.name}: use ```python"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is about a machine without CUDA")
def test_scaler_on_default_device_without_cuda_names_our_class():
    """The obvious CPU port of the quick start keeps FusedGradScaler()'s "cuda" default: it is disabled, as stock
    is, and the warning names FusedGradScaler and the fix, not torch.cuda.amp.GradScaler."""
    from ampkernels import FusedGradScaler

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = FusedGradScaler()
    messages = [str(w.message) for w in caught]
    assert not scaler.is_enabled()
    assert any("FusedGradScaler" in m and "FusedGradScaler('cpu')" in m for m in messages), messages
    assert not any("torch.cuda.amp.GradScaler" in m for m in messages), messages
    assert caught[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert FusedGradScaler("cpu").is_enabled()  # the fix, silent
        assert not FusedGradScaler(enabled=False).is_enabled()  # disabled on purpose: no warning


def test_backends_doc_cpu_defaults():
    """docs/backends.md's CPU column: the matmuls and the FP8 elementwise ops default to torch on CPU tensors even
    where other backends run (auto and cublas for FP8 operands; Triton under TRITON_INTERPRET=1); the scaler and
    optimizer ops to native where the extension is built, else torch."""
    from ampkernels import dispatch

    cpu = torch.device("cpu")
    for op in ("scaled_matmul", "scaled_matmul_float8", "to_float8", "float8_fused"):
        assert dispatch.select(op, cpu) == "torch", op
    assert dispatch.why_not("scaled_matmul_float8", "cublas", cpu) is None  # runs, but is not the default
    native = "native" if dispatch.why_not("adam", "native", cpu) is None else "torch"
    for op in ("unscale_reduce_", "update_scale_", "adam", "sgd", "adam_blockwise"):
        assert dispatch.select(op, cpu) == native, op
