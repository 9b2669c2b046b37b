"""Every script of examples/ runs with --smoke (tiny sizes, on the CPU), as a user would run it: in a subprocess.

Each trains its model with the stock recipe and with ampkernels from the same seed and prints both; the test checks
that both ran, that the losses are finite, and that they agree: to 1e-3 (relative) where ampkernels computes what
stock computes, to 2e-2 for FP8 against bf16. An example whose framework is not installed is skipped, naming it;
and without its framework each example exits with a message that says what to install.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

#: example -> (the modules it needs besides torch, the largest relative gap between stock's and our losses)
CASES = {
    "amp_loop.py": ((), 1e-3),
    "convnet_channels_last.py": (("torchvision",), 1e-3),
    "bert_finetune_trainer.py": (("transformers", "accelerate"), 1e-3),
    "gpt_pretrain_lightning.py": (("lightning", "transformers"), 1e-3),
    "fp8_llama_pretrain.py": (("transformers",), 2e-2),
}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))  # the checkout's ampkernels
    env.pop("TRITON_INTERPRET", None)  # the examples run the default (CPU) backends, as a user's run would
    return env


def _missing(modules) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def test_every_example_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_smoke(name):
    needs, tolerance = CASES[name]
    missing = _missing(needs)
    if missing:
        pytest.skip(f"{name} needs {', '.join(missing)}, not installed")
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--smoke"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, f"{name} --smoke failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    lines = out.stdout.splitlines()
    for recipe in ("stock", "ampkernels"):
        row = next((line for line in lines if re.match(rf"\s*{recipe}: +[\d.]+ ms/step", line)), None)
        assert row is not None, f"{name}: no {recipe} timing line in\n{out.stdout}"
        losses = [float(x) for x in re.findall(r"nan|inf|[-+]?\d+\.\d+(?:e[-+]?\d+)?", row.split(" loss ", 1)[1])]
        assert losses and all(math.isfinite(x) for x in losses), row
    summary = next((line for line in lines if "speedup over stock" in line), None)
    assert summary is not None, out.stdout
    gap = float(re.search(r"largest relative loss gap (\S+)", summary).group(1))
    assert gap <= tolerance, f"{name}: stock and ampkernels losses differ by {gap:.1e} (> {tolerance:.0e})"


def test_examples_name_the_missing_framework():
    """Each example, with its framework made unimportable, exits with a message naming what to install (not with a
    traceback). Runs in one process: torch and ampkernels are imported once."""
    script = f"""
import runpy, sys
cases = {{"convnet_channels_last.py": "torchvision", "bert_finetune_trainer.py": "transformers",
          "gpt_pretrain_lightning.py": "lightning", "fp8_llama_pretrain.py": "transformers"}}
for name, module in cases.items():
    saved = {{k: v for k, v in sys.modules.items() if k == module or k.startswith(module + ".")}}
    for k in saved:
        del sys.modules[k]
    sys.modules[module] = None  # import raises ImportError
    sys.argv = [name, "--smoke"]
    try:
        runpy.run_path({str(EXAMPLES)!r} + "/" + name, run_name="__main__")
        print(name, "RAN")
    except SystemExit as exc:
        print(name, "EXIT", str(exc.code).replace(chr(10), " "))
    del sys.modules[module]
    sys.modules.update(saved)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    results = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    for name, package in (
        ("convnet_channels_last.py", "torchvision"),
        ("bert_finetune_trainer.py", "transformers"),
        ("gpt_pretrain_lightning.py", "lightning"),
        ("fp8_llama_pretrain.py", "transformers"),
    ):
        message = results.get(name, "")
        assert message.startswith("EXIT") and "pip install" in message and package in message, out.stdout
