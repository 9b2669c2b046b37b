"""Build ampkernels and its native extension ``ampkernels._C``.

The CPU kernels are always built. The CUDA kernels are built when torch is a CUDA build, a CUDA toolkit is found
(``CUDA_HOME``, else the toolkit of the ``nvcc`` on PATH, followed through wrapper scripts and links) and one of these
holds, as PyTorch extensions and flash-attn do:

- ``TORCH_CUDA_ARCH_LIST`` is set: for those GPU architectures;
- ``AMPKERNELS_FORCE_CUDA=1``: for the default list (sm_75 to sm_90a with CUDA 13, sm_70 to sm_90a with CUDA 12),
  even without a GPU (for a build machine or CI);
- a GPU is visible to torch: for the GPUs present (Hopper as 9.0a, which the wgmma kernel needs).

Without a visible GPU and neither variable, only the CPU kernels are built (minutes, not the better part of an hour
for five architectures on a small machine). ``plan_build`` makes that decision from its inputs alone; the build
prints it, with a rough duration, to stderr (``pip install -v`` shows it). Other switches:

- ``AMPKERNELS_NO_NATIVE=1``: build no native code at all (the package then runs on Triton / plain torch);
- ``AMPKERNELS_NO_CUDA=1``: build the CPU kernels only, whatever else is set;
- ``MAX_JOBS``: parallel compile jobs (ninja).
"""

import os
import re
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
CSRC = ROOT / "csrc"


def _truthy(name: str, environ=os.environ) -> bool:
    return environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def find_cuda_home(environ=os.environ, which=shutil.which) -> str | None:
    """The CUDA toolkit root: CUDA_HOME or CUDA_PATH when set, else the toolkit of the nvcc on PATH.

    An nvcc on PATH may be a wrapper script (``exec /usr/local/cuda-13.0/bin/nvcc "$@"``) or a symbolic link; torch
    would then guess the wrong root (the wrapper's ``/usr/local``) and the build fail late, on a missing
    cuda_runtime_api.h. A script is read for the first ``.../bin/nvcc`` path it names. None when no toolkit with
    ``include/cuda_runtime_api.h`` is found that way.
    """
    for name in ("CUDA_HOME", "CUDA_PATH"):
        if environ.get(name):
            return environ[name]
    nvcc = which("nvcc")
    if nvcc is None:
        return None
    real = Path(nvcc).resolve()
    try:
        head = real.read_bytes()[:4096]
    except OSError:
        return None
    if not head.startswith(b"\x7fELF"):  # a script: follow the nvcc it runs
        for match in re.finditer(rb"(/[^\s\"']*/bin/nvcc)(?![\w.-])", head):
            candidate = Path(match.group(1).decode(errors="replace")).resolve()
            if candidate != real and candidate.is_file():
                real = candidate
                break
    root = real.parent.parent
    return str(root) if (root / "include" / "cuda_runtime_api.h").is_file() else None


def _default_arch_list(cuda_version: str) -> str:
    # CUDA 13 dropped sm_70 (Volta): cover what the toolkit can build. Hopper as 9.0a (CUDA 12+): the wgmma kernel
    # needs it, and sm_90a code runs on every compute capability 9.0 GPU.
    major = int(cuda_version.split(".")[0])
    if major >= 13:
        return "7.5;8.0;8.6;8.9;9.0a"
    return "7.0;7.5;8.0;8.6;8.9;9.0a" if major == 12 else "7.0;7.5;8.0;8.6;8.9;9.0"


class BuildPlan(NamedTuple):
    """What ``setup.py`` compiles: ``cuda`` (the CUDA kernels too, for ``arch_list``, a ``TORCH_CUDA_ARCH_LIST``
    value) or the CPU kernels only; ``message`` says what and why; ``error``, when set, stops the build."""

    cuda: bool
    arch_list: str | None
    message: str
    error: str | None = None


# Rough compile work, in core-minutes, from a 2-core machine (torch 2.14.1+cu130, nvcc 13.0): the CPU kernels
# alone took 134 s; the default five CUDA architectures 26 min. Each architecture adds ~9.5 core-minutes.
_CPU_CORE_MINUTES = 4.5
_CUDA_CORE_MINUTES_PER_ARCH = 9.5
_FORCE_HINT = 'set AMPKERNELS_FORCE_CUDA=1 or TORCH_CUDA_ARCH_LIST="8.0;9.0a" to compile the CUDA kernels'


def gpu_arch(capability: tuple[int, int], cuda_version: str) -> str:
    """The ``TORCH_CUDA_ARCH_LIST`` entry for a GPU of compute ``capability``: Hopper (9.0) as ``9.0a`` from CUDA 12
    on (the wgmma kernel needs the arch-specific features; sm_90a code runs on every 9.0 GPU)."""
    major, minor = capability
    if (major, minor) == (9, 0) and int(cuda_version.split(".")[0]) >= 12:
        return "9.0a"
    return f"{major}.{minor}"


def arch_names(arch_list: str) -> list[str]:
    """``"8.0;9.0a 8.6+PTX"`` -> ``["sm_80", "sm_90a", "sm_86+PTX"]``."""
    return ["sm_" + a.replace(".", "", 1) for a in re.split(r"[;\s]+", arch_list.strip()) if a]


def _duration(n_archs: int, jobs: int) -> str:
    minutes = (_CPU_CORE_MINUTES + _CUDA_CORE_MINUTES_PER_ARCH * n_archs) / max(jobs, 1)
    return f"roughly {max(1, round(minutes))} min with {jobs} parallel job{'s' if jobs != 1 else ''} (MAX_JOBS)"


def plan_build(
    environ,
    torch_cuda: str | None,
    gpus: list[tuple[int, int]],
    cuda_home: str | None,
    jobs: int,
    gpu_error: str | None = None,
) -> BuildPlan:
    """Decides what to compile, from its arguments alone.

    Args:
        environ: the environment (``AMPKERNELS_NO_CUDA``, ``AMPKERNELS_FORCE_CUDA``, ``TORCH_CUDA_ARCH_LIST``).
        torch_cuda: ``torch.version.cuda`` (None for a CPU build of torch).
        gpus: the compute capabilities of the GPUs torch sees (empty: none).
        cuda_home: the CUDA toolkit root found, or None.
        jobs: parallel compile jobs, for the duration estimate.
        gpu_error: why asking torch for the GPUs failed, if it did.
    """
    cpu_time = _duration(0, jobs)
    if _truthy("AMPKERNELS_NO_CUDA", environ):
        return BuildPlan(False, None, f"building the CPU kernels only (AMPKERNELS_NO_CUDA=1; {cpu_time})")
    force = _truthy("AMPKERNELS_FORCE_CUDA", environ)
    if torch_cuda is None:
        why = "torch is a CPU build, and the CUDA kernels need a CUDA build of torch"
        if force:
            return BuildPlan(
                False, None, "", f"ampkernels: AMPKERNELS_FORCE_CUDA=1 asks for the CUDA kernels, but {why}"
            )
        return BuildPlan(False, None, f"building the CPU kernels only ({why}; {cpu_time})")
    arch_list = (environ.get("TORCH_CUDA_ARCH_LIST") or "").strip() or None
    if arch_list is not None:
        asked, why = "TORCH_CUDA_ARCH_LIST", "from TORCH_CUDA_ARCH_LIST"
    elif force:
        asked, why = "AMPKERNELS_FORCE_CUDA=1", "AMPKERNELS_FORCE_CUDA=1: the default list"
    elif gpus:
        asked, why = "a visible GPU", "the GPUs visible; TORCH_CUDA_ARCH_LIST overrides"
    else:
        seen = f"no GPU visible ({gpu_error})" if gpu_error else "no GPU visible"
        return BuildPlan(False, None, f"building the CPU kernels only ({seen}; {_FORCE_HINT}; {cpu_time})")
    if cuda_home is None:
        why = f"{asked} asks for the CUDA kernels, but no CUDA toolkit was found: set CUDA_HOME to the toolkit root"
        if force:
            return BuildPlan(False, None, "", f"ampkernels: {why}, or unset AMPKERNELS_FORCE_CUDA")
        return BuildPlan(False, None, f"building the CPU kernels only ({why}; {cpu_time})")
    if arch_list is None:
        arch_list = (
            _default_arch_list(torch_cuda) if force else ";".join(gpu_arch(c, torch_cuda) for c in sorted(set(gpus)))
        )
    names = arch_names(arch_list)
    count = f"{len(names)} architecture{'s' if len(names) != 1 else ''}"
    return BuildPlan(
        True,
        arch_list,
        f"building the CPU kernels and the CUDA kernels for {', '.join(names)} ({why}; {count}: "
        f"{_duration(len(names), jobs)})",
    )


def _visible_gpus(torch) -> tuple[list[tuple[int, int]], str | None]:
    """The compute capabilities of the GPUs torch sees, and why the query failed if it did. A CUDA build of torch
    on a machine without a GPU (or without a driver) answers False, or raises on some driver setups."""
    try:
        if torch.version.cuda is None or not torch.cuda.is_available():
            return [], None
        return [tuple(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())], None
    except Exception as error:  # noqa: BLE001 - any failure to see a GPU means: build as if none
        return [], f"{type(error).__name__}: {error}"


def _say(message: str) -> None:
    # pip shows a build's output only with -v (or when it fails); stderr is not buffered behind the compiler's.
    print(f"ampkernels: {message}", file=sys.stderr, flush=True)


def _extensions():
    if _truthy("AMPKERNELS_NO_NATIVE"):
        _say("building no native code (AMPKERNELS_NO_NATIVE=1)")
        return [], {}
    import torch

    maybe_cuda = torch.version.cuda is not None and not _truthy("AMPKERNELS_NO_CUDA")
    if maybe_cuda and not os.environ.get("CUDA_HOME"):
        # Before torch.utils.cpp_extension is imported: it reads CUDA_HOME once, at import.
        home = find_cuda_home()
        if home is not None:
            os.environ["CUDA_HOME"] = home
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    gpus, gpu_error = _visible_gpus(torch) if maybe_cuda else ([], None)
    jobs = int(os.environ["MAX_JOBS"]) if os.environ.get("MAX_JOBS", "").isdigit() else (os.cpu_count() or 1)
    plan = plan_build(os.environ, torch.version.cuda, gpus, CUDA_HOME, jobs, gpu_error)
    if plan.error is not None:
        sys.exit(plan.error)
    if plan.cuda and not (Path(CUDA_HOME) / "include" / "cuda_runtime_api.h").is_file():
        sys.exit(
            f"ampkernels: no CUDA toolkit at CUDA_HOME={CUDA_HOME} (include/cuda_runtime_api.h is missing). Set "
            "CUDA_HOME to the toolkit root (the directory holding bin/nvcc and include/), or AMPKERNELS_NO_CUDA=1 "
            "to build the CPU kernels only."
        )
    _say(plan.message)

    cpp_sources = [str(p.relative_to(ROOT)) for p in sorted(CSRC.rglob("*.cpp"))]
    cuda_sources = [str(p.relative_to(ROOT)) for p in sorted(CSRC.rglob("*.cu"))]
    include_dirs = [str(CSRC)]  # sources include "common/...", "scaler/...", "optim/...", "matmul/..."
    # The C++ standard comes from torch (C++17 or C++20 by version). No FMA contraction: the CPU kernels round
    # each operation as the reference does (contraction is on by default where the base ISA has FMA, e.g. arm64).
    # No errno from math functions and no trapping floating point (neither changes a result): with them, sqrt does
    # not vectorize, nor does a select between two float expressions (both sides may not be computed).
    cxx_flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
    link_flags = []
    if torch.backends.openmp.is_available() and sys.platform.startswith("linux"):
        # at::parallel_for is an inline template: without -fopenmp it compiles to a serial loop (no _OPENMP, so no
        # INTRA_OP_PARALLEL), and the CPU kernels and per-parameter checks ran on one thread whatever
        # torch.set_num_threads said. The runtime is torch's own libgomp.so.1 (same soname, already loaded).
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    if plan.cuda:
        arch_list = os.environ["TORCH_CUDA_ARCH_LIST"] = plan.arch_list
        defines = ["-DAMPK_WITH_CUDA", f'-DAMPK_CUDA_ARCH_LIST="{arch_list}"']
        ext = CUDAExtension(
            "ampkernels._C",
            cpp_sources + cuda_sources,
            include_dirs=include_dirs,
            extra_compile_args={
                "cxx": cxx_flags + defines,
                # No --use_fast_math: the non-finite checks need IEEE isfinite and exact reciprocals.
                "nvcc": ["-O3", "-lineinfo"] + defines,
            },
            extra_link_args=link_flags,
        )
    else:
        ext = CppExtension(
            "ampkernels._C",
            cpp_sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

setup(
    name="ampkernels",
    version="0.1.0",
    description="Fused, sync-free mixed-precision (AMP) kernels for PyTorch",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ampkernels", "ampkernels.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.14"],  # CI tests torch 2.14 and 2.15 (.ci/run)
    extras_require={
        "triton": ["triton"],
        "plot": ["matplotlib"],
        "bench": ["matplotlib", "tqdm"],
        # The models of the training and precision benchmarks; apart from "bench" because torchvision pins the
        # torch version it was built for, and installing it may replace the torch already there.
        "models": ["transformers", "torchvision"],
        "test": ["pytest", "matplotlib", "tqdm"],
        # The frameworks ampkernels.integrations plugs into (tests/test_integrations_*.py skip without them).
        "integrations": ["transformers", "accelerate", "lightning"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
