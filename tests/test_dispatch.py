"""ampkernels.dispatch: the one place that knows each op's backends, why one cannot run, and the overrides."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

import ampkernels
from ampkernels import dispatch, info

PACKAGE = Path(ampkernels.__file__).parent
CSRC = PACKAGE.parent / "csrc"
MULTI_TENSOR_OPS = ("unscale_reduce_", "update_scale_", "adam", "sgd", "adam_blockwise")


@pytest.fixture(autouse=True)
def no_overrides(monkeypatch):
    for name in (dispatch.GLOBAL_VARIABLE, *dispatch.VARIABLES.values()):
        monkeypatch.delenv(name, raising=False)


def test_every_op_has_its_backends_and_one_variable():
    assert set(dispatch.BACKENDS) == {
        "unscale_reduce_",
        "update_scale_",
        "adam",
        "sgd",
        "adam_blockwise",
        "scaled_matmul",
        "scaled_matmul_float8",
        "to_float8",
        "float8_fused",
        "linear_cross_entropy",
    }
    assert set(dispatch.BACKENDS) == set(dispatch.VARIABLES)
    for op in MULTI_TENSOR_OPS:
        assert dispatch.BACKENDS[op] == ("native", "triton", "torch")
    assert dispatch.BACKENDS["scaled_matmul"] == ("auto", "triton", "wgmma", "wmma", "cublas", "torch")
    assert dispatch.BACKENDS["scaled_matmul_float8"] == ("auto", "triton", "wgmma", "cublas", "torch")
    assert dispatch.BACKENDS["to_float8"] == ("native", "triton", "torch")
    assert dispatch.BACKENDS["float8_fused"] == ("triton", "torch")
    assert dispatch.BACKENDS["linear_cross_entropy"] == ("triton", "torch")


@pytest.mark.parametrize("op", ["float8_fused", "linear_cross_entropy"])
def test_triton_or_torch_ops_default_to_torch_on_cpu_and_ignore_native(op, monkeypatch):
    assert dispatch.select(op, "cpu") == "torch"  # the interpreter runs only when asked for
    monkeypatch.setenv(dispatch.GLOBAL_VARIABLE, "native")
    assert dispatch.select(op, "cpu") == "torch"
    monkeypatch.setenv(dispatch.VARIABLES[op], "native")
    if op == "float8_fused":  # the casts' variable: native is theirs, the fused kernels keep their default
        assert dispatch.select(op, "cpu") == "torch"
    else:
        with pytest.raises(ValueError, match=f"{dispatch.VARIABLES[op]}: expected one of triton/torch"):
            dispatch.select(op, "cpu")


@pytest.mark.parametrize("op", list(dispatch.BACKENDS))
def test_torch_always_runs_and_is_the_fallback(op):
    assert dispatch.why_not(op, "torch", "cpu") is None
    assert dispatch.select(op, "cpu", "torch") == "torch"
    assert dispatch.select(op, "cpu") in dispatch.BACKENDS[op]


@pytest.mark.parametrize("op", list(dispatch.BACKENDS))
@pytest.mark.parametrize("bad", ["", "Torch", "cuda", "native ", "none"])
def test_bad_names_raise_value_error_with_the_choices(op, bad):
    choices = "/".join(dispatch.BACKENDS[op])
    with pytest.raises(ValueError, match=f"argument 'backend'.*{re.escape(choices)}"):
        dispatch.select(op, "cpu", bad)
    with pytest.raises(ValueError, match=f"argument 'backend'.*{re.escape(choices)}"):
        dispatch.why_not(op, bad, "cpu")


def test_unknown_op_raises():
    with pytest.raises(ValueError, match="unknown op 'adamw'"):
        dispatch.select("adamw", "cpu")


def test_argument_beats_op_variable_beats_global(monkeypatch):
    monkeypatch.setenv("AMPKERNELS_BACKEND", "native")
    monkeypatch.setenv("AMPKERNELS_OPTIMIZER_BACKEND", "torch")
    assert dispatch.requested("adam") == ("torch", "AMPKERNELS_OPTIMIZER_BACKEND")
    assert dispatch.requested("sgd", "triton") == ("triton", "argument 'backend'")
    assert dispatch.requested("unscale_reduce_") == ("native", "AMPKERNELS_BACKEND")
    monkeypatch.setenv("AMPKERNELS_SCALER_BACKEND", "torch")
    assert dispatch.select("unscale_reduce_", "cpu") == "torch"
    assert dispatch.select("update_scale_", "cpu") == "torch"
    monkeypatch.setenv("AMPKERNELS_SCALER_BACKEND", "")  # empty: unset
    assert dispatch.requested("update_scale_") == ("native", "AMPKERNELS_BACKEND")


def test_bad_variable_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("AMPKERNELS_OPTIMIZER_BACKEND", "wgmma")
    with pytest.raises(ValueError, match="environment variable AMPKERNELS_OPTIMIZER_BACKEND.*native/triton/torch"):
        dispatch.select("adam", "cpu")
    monkeypatch.delenv("AMPKERNELS_OPTIMIZER_BACKEND")
    monkeypatch.setenv("AMPKERNELS_BACKEND", "wmma")  # a scaled_matmul name: the global one takes the common three
    with pytest.raises(ValueError, match="environment variable AMPKERNELS_BACKEND.*native/triton/torch"):
        dispatch.select("scaled_matmul", "cpu")


def test_global_native_means_the_native_matmul_kernel_that_runs(monkeypatch):
    monkeypatch.setenv("AMPKERNELS_BACKEND", "torch")
    assert dispatch.select("scaled_matmul", "cpu") == "torch"
    monkeypatch.setenv("AMPKERNELS_BACKEND", "native")
    with pytest.raises(RuntimeError, match="AMPKERNELS_BACKEND=native.*wgmma: .*wmma: "):
        dispatch.select("scaled_matmul", "cpu")  # neither native kernel runs on CPU tensors
    monkeypatch.setattr(dispatch, "why_not", lambda op, name, device: None if name == "wmma" else "not here")
    assert dispatch.select("scaled_matmul", "cuda") == "wmma"


def test_unrunnable_request_says_who_asked_and_why(monkeypatch):
    monkeypatch.setenv("AMPKERNELS_SCALED_MATMUL_BACKEND", "wgmma")
    with pytest.raises(RuntimeError, match=r"'wgmma' \(AMPKERNELS_SCALED_MATMUL_BACKEND\) cannot run on cpu: .*CUDA"):
        dispatch.select("scaled_matmul", "cpu")


def test_triton_on_cpu_only_under_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    assert dispatch.triton_module("adam") is not None
    monkeypatch.setattr(dispatch, "triton_interpreting", lambda: False)
    assert "TRITON_INTERPRET=1" in dispatch.why_not("adam", "triton", "cpu")
    monkeypatch.setattr(dispatch, "triton_interpreting", lambda: True)
    assert dispatch.why_not("adam", "triton", "cpu") is None
    assert "CPU tensors only" in dispatch.why_not("adam", "triton", "cuda")
    assert dispatch.select("adam", "cpu") != "triton"  # the interpreter runs only when asked for


def _read_variables(root: Path, patterns: tuple[str, ...]) -> set[str]:
    found = set()
    for pattern in patterns:
        for path in root.rglob(pattern):
            text = path.read_text()
            found |= set(re.findall(r"(?:environ(?:\.get)?\(|environ\[|getenv\()\s*\"(\w+)\"", text))
    return found


def test_every_variable_read_is_documented():
    """Each environment variable read in ampkernels/ (and by the C++ launchers) is in ENVIRONMENT and has its line in
    the dispatch docstring."""
    read = _read_variables(PACKAGE, ("*.py",))
    if CSRC.is_dir():
        read |= _read_variables(CSRC, ("*.cpp", "*.cu", "*.h", "*.cuh"))
    assert read, "the scan found nothing: its pattern is out of date"
    assert read <= set(dispatch.ENVIRONMENT), read - set(dispatch.ENVIRONMENT)
    for name in dispatch.ENVIRONMENT:
        assert f"``{name}``" in dispatch.__doc__, name


def test_info_prints_each_op_and_the_variables_set(monkeypatch):
    monkeypatch.setenv("AMPKERNELS_OPTIMIZER_BACKEND", "torch")
    monkeypatch.setenv("AMPKERNELS_TUNE", "0")
    text = info.report()
    assert "AMPKERNELS_OPTIMIZER_BACKEND=torch" in text and "AMPKERNELS_TUNE=0" in text
    lines = text.splitlines()
    cpu = lines.index("backends for cpu tensors:")
    ops = lines[cpu + 1 : cpu + 1 + len(dispatch.BACKENDS)]
    for op, line in zip(dispatch.BACKENDS, ops, strict=True):
        assert line.strip().startswith(op), line
        assert "others:" in line
    assert "adam (FusedAdam, FusedAdamW): torch [AMPKERNELS_OPTIMIZER_BACKEND=torch]" in text
    monkeypatch.setenv("AMPKERNELS_SCALED_MATMUL_BACKEND", "wmma")
    assert "'wmma' (AMPKERNELS_SCALED_MATMUL_BACKEND) cannot run on cpu" in info.report()


def test_wrappers_validate_backend_names_at_construction():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="argument 'backend'.*native/triton/torch"):
        ampkernels.FusedAdam([p], backend="")
    with pytest.raises(ValueError, match="argument 'backend'.*native/triton/torch"):
        ampkernels.FusedSGD([p], lr=0.1, backend="auto")
    with pytest.raises(ValueError, match="argument 'backend'.*native/triton/torch"):
        ampkernels.FusedGradScaler("cpu", backend="")


@pytest.mark.parametrize("op", ["to_float8", "float8_fused", "scaled_matmul_float8", "linear_cross_entropy"])
def test_backend_choice_traces_under_torch_compile(op):
    """The float8 wrappers choose their backend inside a compiled region, so torch.compile traces the choice: it must
    read what an eager call already loaded (the extension, the Triton modules, the native ops), not import again,
    which Dynamo refuses (seen on the H200 for the fused kernels' Triton module)."""
    dispatch.clear_caches()
    names = dispatch.BACKENDS[op]
    eager = [dispatch.why_not(op, name, torch.device("cpu")) is None for name in names]

    def choose(x):
        return x + sum(dispatch.why_not(op, name, x.device) is None for name in names)

    torch._dynamo.reset()
    compiled = torch.compile(choose, backend="eager", fullgraph=True)
    assert compiled(torch.zeros(2)).tolist() == [float(sum(eager))] * 2


# --------------------------------------------------------------------------------------------------------------------
# A missing optional dependency removes a backend; a module of ours that fails to import raises
# --------------------------------------------------------------------------------------------------------------------

# Module bodies planted as the Triton module of "adam": each fails to import for a reason other than a missing triton.
_BROKEN_MODULES = {
    "NameError": ("import triton\nundefined_name_in_a_kernel_module\n", NameError),
    "SyntaxError": ("import triton\ndef f(:\n", SyntaxError),
    "AttributeError": ("import triton\nimport ampkernels\nampkernels.no_such_attribute\n", AttributeError),
    "ImportError": ("import triton\nfrom ampkernels.reference import no_such_function\n", ImportError),
    "ModuleNotFoundError": ("import triton\nimport ampkernels.optim.triton.no_such_module\n", ModuleNotFoundError),
    "misspelt triton module": ("import triton.no_such_submodule\n", ModuleNotFoundError),
}


@pytest.fixture
def plant(monkeypatch, tmp_path):
    """plant(source): makes a fresh module holding ``source`` the Triton module of the "adam" op (dispatch's caches
    emptied for the test) and returns its name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(dispatch, "_LOADED", {})
    planted = []

    def plant(source: str) -> str:
        name = f"ampkernels_planted_{len(planted)}"
        (tmp_path / f"{name}.py").write_text(source)
        planted.append(name)
        monkeypatch.setattr(dispatch.backend("adam", "triton"), "module", name)
        return name

    yield plant
    for name in planted:
        sys.modules.pop(name, None)


@pytest.mark.parametrize("failure", list(_BROKEN_MODULES))
def test_a_broken_triton_module_raises_instead_of_being_unavailable(plant, failure):
    """A module of ours that does not import is a bug: why_not, select and triton_module raise (from the original
    exception, every time they are asked), never report Triton as not installed, which would let every test of the
    backend skip."""
    pytest.importorskip("triton")
    source, cause = _BROKEN_MODULES[failure]
    name = plant(source)
    for _ in range(2):  # not remembered as "unavailable" after the first failure
        with pytest.raises(dispatch.BackendImportError, match=rf"{name} failed to import") as raised:
            dispatch.why_not("adam", "triton", "cpu")
        assert isinstance(raised.value.__cause__, cause), repr(raised.value.__cause__)
        assert "not installed" not in str(raised.value)
    with pytest.raises(dispatch.BackendImportError):
        dispatch.select("adam", "cpu", "triton")
    with pytest.raises(dispatch.BackendImportError):
        dispatch.triton_module("adam")
    assert dispatch.why_not("sgd", "triton", "cpu") is None  # the other modules are untouched


def test_info_shows_a_broken_module_and_fails(plant, capsys):
    pytest.importorskip("triton")
    plant(_BROKEN_MODULES["NameError"][0])
    errors = []
    text = info.report(errors)
    assert errors and isinstance(errors[0].__cause__, NameError)
    line = next(line for line in text.splitlines() if line.strip().startswith("adam ("))
    assert "BROKEN" in line and "undefined_name_in_a_kernel_module" in line, line
    assert info.main([]) == 1
    err = capsys.readouterr().err
    assert "NameError: name 'undefined_name_in_a_kernel_module' is not defined" in err  # the original traceback
    assert info.main(["--require", "torch,triton"]) == 1
    assert "required backend 'triton' does not run here: BROKEN" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["import triton\n", "import triton.language as tl\n"])
def test_a_missing_triton_is_a_clean_reason(plant, monkeypatch, source):
    """Triton not installed (every triton module reads as absent, as on a machine without it): the backend is
    unavailable with the reason, and asking for it by name raises that reason."""
    for module in [m for m in sys.modules if m == "triton" or m.startswith("triton.")] or ["triton"]:
        monkeypatch.setitem(sys.modules, module, None)
    ours = [m for m in sys.modules if m.startswith("ampkernels.") and (".triton." in m or "_triton_" in m)]
    for module in ours:  # imported again, and fail
        monkeypatch.delitem(sys.modules, module)
    plant(source)
    reason = dispatch.why_not("adam", "triton", "cpu")
    assert reason is not None and reason.startswith("triton is not installed"), reason
    assert dispatch.triton_module("adam") is None
    with pytest.raises(RuntimeError, match="'triton' .* cannot run on cpu: triton is not installed"):
        dispatch.select("adam", "cpu", "triton")
    assert dispatch.select("adam", "cpu") in ("native", "torch")
    assert "triton" in info.unavailable(["triton", "torch"])


def test_a_stale_native_build_says_to_rebuild(monkeypatch):
    """An extension that is there but does not load (built against another torch: an undefined symbol) raises with
    the way out; one that is not built is only unavailable."""
    real = importlib.import_module
    failure = {}

    def import_module(name, package=None):
        if name == "ampkernels._C":
            raise failure["exc"]
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", import_module)
    monkeypatch.setattr(dispatch, "_LOADED", {})
    failure["exc"] = ImportError("ampkernels/_C.so: undefined symbol: _ZN3c1017RegisterOperatorsD1Ev")
    with pytest.raises(dispatch.BackendImportError, match="undefined symbol.*rebuild it") as raised:
        dispatch.why_not("adam", "native", "cpu")
    assert raised.value.__cause__ is failure["exc"]
    with pytest.raises(dispatch.BackendImportError, match="rebuild"):
        dispatch.native()
    failure["exc"] = ModuleNotFoundError("No module named 'ampkernels._C'", name="ampkernels._C")
    assert "ampkernels._C is not built" in dispatch.why_not("adam", "native", "cpu")
    assert dispatch.native() is None
    assert dispatch.select("adam", "cpu") == "torch"
    monkeypatch.setattr(dispatch, "_LOADED", {})
    failure["exc"] = ModuleNotFoundError("No module named 'torch._missing'", name="torch._missing")  # not ours
    with pytest.raises(dispatch.BackendImportError):
        dispatch.native()


def test_require_names_each_backend_that_does_not_run_here(capsys):
    missing = info.unavailable(["native", "triton", "torch", "wgmma", "nonsense"])
    assert "torch" not in missing
    assert ("native" in missing) == (dispatch.native() is None)
    assert ("triton" in missing) == (importlib.util.find_spec("triton") is None)
    assert ("wgmma" in missing) == (
        not torch.cuda.is_available() or dispatch.native_op("scaled_matmul_wgmma_") is None
    ), missing
    assert "not a backend name" in missing["nonsense"]
    assert info.main(["--require", "torch,nonsense"]) == 1
    assert "required backend 'nonsense' does not run here" in capsys.readouterr().err
    assert info.main(["--require", "torch"]) == 0


def _environment_without_overrides() -> dict[str, str]:
    """os.environ without the ampkernels variables and TRITON_INTERPRET, and with the package tested first on the
    path (it may be a source tree that is not installed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPKERNELS_") and k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE.parent), env.get("PYTHONPATH")]))
    return env


def test_require_as_ci_calls_it():
    """``python -m ampkernels.info --require native,triton,torch`` in a fresh interpreter without TRITON_INTERPRET:
    on a machine without a GPU it sets it (Triton runs there under the interpreter); exit status 0 exactly when the
    extension is built and Triton installed."""
    env = _environment_without_overrides()
    result = subprocess.run(
        [sys.executable, "-m", "ampkernels.info", "--require", "native,triton,torch"],
        capture_output=True,
        text=True,
        cwd=PACKAGE.parent,
        env=env,
        timeout=300,
    )
    expected = {"native": dispatch.native() is not None, "triton": importlib.util.find_spec("triton") is not None}
    for name, runs in expected.items():
        assert (f"required backend '{name}' does not run here" not in result.stderr) == runs, result.stderr[-3000:]
    assert result.returncode == (0 if all(expected.values()) else 1), result.stderr[-3000:]
    if all(expected.values()):
        assert "required backends all run here: native, triton, torch" in result.stdout


# Run in a fresh interpreter in which the modules named in argv[1] look not installed (every finder returns None for
# them, as on a machine without them): import, info and a CPU training step must still work.
_WITHOUT_OPTIONAL_PIECES = r"""
import sys
import typing

blocked = sys.argv[1].split(",")


class NotInstalled:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in blocked):
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attribute):
        return getattr(self.finder, attribute)


sys.meta_path[:] = [NotInstalled(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]

import torch

import ampkernels
from ampkernels import info

print(info.report())
model = torch.nn.Linear(8, 8)
optimizer = ampkernels.FusedAdamW(model.parameters(), lr=1e-3)
scaler = ampkernels.FusedGradScaler("cpu", telemetry=True)
before = model.weight.detach().clone()
scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
scaler.clip_grad_norm_(optimizer, max_norm=1.0)
scaler.step(optimizer)
scaler.update()
assert not torch.equal(before, model.weight), "the step did not update the weights"
try:
    ampkernels.plot_scale_history(scaler, "unused.png")
except ImportError as error:
    print("plot:", error)
print("require:", info.main(["--require", "torch,triton"]))
"""


def test_import_info_and_a_step_work_without_the_optional_pieces(tmp_path):
    """The README's promise: ``import ampkernels`` and ``python -m ampkernels.info`` work whatever optional piece is
    missing (the native extension, Triton, matplotlib), and every op falls back to plain PyTorch."""
    env = _environment_without_overrides()
    blocked = "ampkernels._C,triton,matplotlib"
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_OPTIONAL_PIECES, blocked],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "triton: not installed" in out and "native extension: not available" in out
    assert "adam (FusedAdam, FusedAdamW): torch [default]" in out
    assert "plot: plot_scale_history needs matplotlib" in out
    assert "triton: triton is not installed" in out and "require: 1" in out
    assert "required backend 'triton' does not run here: triton is not installed" in result.stderr


# --------------------------------------------------------------------------------------------------------------------
# Backends behind one declared interface
# --------------------------------------------------------------------------------------------------------------------


def _protocol_methods(protocol: type) -> dict[str, inspect.Signature]:
    """The methods ``protocol`` declares beyond :class:`dispatch.Backend`'s (its own and its bases')."""
    base = set(vars(dispatch.Backend))
    methods = {}
    for cls in protocol.__mro__:
        if cls in (dispatch.Backend, typing.Protocol, typing.Generic, object):
            continue
        for name, value in vars(cls).items():
            if callable(value) and not name.startswith("_") and name not in base:
                methods.setdefault(name, _parameters(value))
    return methods


def _parameters(fn) -> list[tuple[str, object, object]]:
    """(name, kind, default) of each parameter: annotations are written once, on the Protocol."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("op", [spec.name for spec in dispatch.ops()])
def test_every_backend_implements_its_family_protocol_with_the_same_signatures(op):
    spec = next(s for s in dispatch.ops() if s.name == op)
    declared = _protocol_methods(spec.protocol)
    for backend in spec.backends:
        assert isinstance(backend, dispatch.Backend)
        assert isinstance(backend, spec.protocol), (op, backend.name)
        for name, signature in declared.items():
            actual = _parameters(getattr(type(backend), name))
            assert actual == signature, f"{op}: backend {backend.name!r}: {name}{actual} != {name}{signature}"


def test_no_code_outside_dispatch_compares_backend_names():
    """The choice is dispatch's: families hold a backend object and call it (names travel only as arguments, through
    the custom ops and the error messages)."""
    names = {name for spec in dispatch.ops() for name in spec.names}
    pattern = re.compile(
        r"""(?:==|!=)\s*["'](%s)["']|["'](%s)["']\s*(?:==|!=)|in \(["'](%s)["']""" % (("|".join(names),) * 3)
    )
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "dispatch.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


# --------------------------------------------------------------------------------------------------------------------
# The plain-eager fast path, in one helper
# --------------------------------------------------------------------------------------------------------------------


def test_eager_or_op_launches_directly_on_plain_tensors_and_bumps_what_it_writes():
    from ampkernels._runtime import eager_or_op

    calls = []
    out, flag = torch.zeros(3), torch.zeros(1)
    versions = out._version, flag._version
    result = eager_or_op(
        lambda x, scale, o, f: calls.append("direct") or "launched",
        lambda *args: calls.append(("op", args[-1])),
        (torch.ones(3), 2.0, out, flag),
        "triton",
        (out, None, flag),
    )
    assert result == "launched" and calls == ["direct"]
    assert (out._version, flag._version) == (versions[0] + 1, versions[1] + 1)


def test_eager_or_op_goes_through_the_op_when_something_must_see_it():
    from torch.utils._python_dispatch import TorchDispatchMode

    from ampkernels._runtime import eager_or_op

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Subclass(torch.Tensor):
        pass

    def through_op(*args):
        return ("op", args[-1])

    x = torch.ones(2)
    with Watch():  # a mode: the dispatcher must see the op
        assert eager_or_op(lambda x: "direct", through_op, (x,), "torch") == ("op", "torch")
    assert eager_or_op(lambda x: "direct", through_op, (x.as_subclass(Subclass),), "torch") == ("op", "torch")
    assert eager_or_op(lambda x, n: "direct", through_op, (x, None), "torch") == "direct"
