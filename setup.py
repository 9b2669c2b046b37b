"""Build ampkernels and its native extension ``ampkernels._C``.

The CPU kernels are always built; the CUDA kernels whenever torch is a CUDA build and a CUDA toolkit is found
(``CUDA_HOME``, else the toolkit of the ``nvcc`` on PATH, followed through wrapper scripts and links). Environment
switches:

- ``AMPKERNELS_NO_NATIVE=1``: build no native code at all (the package then runs on Triton / plain torch);
- ``AMPKERNELS_NO_CUDA=1``: build the CPU kernels only;
- ``TORCH_CUDA_ARCH_LIST``: the GPU architectures (default: sm_75 to sm_90a with CUDA 13, sm_70 to sm_90a with CUDA 12;
  the wgmma kernel is built only for 9.0a).
- ``MAX_JOBS``: parallel compile jobs (ninja).
"""

import os
import re
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
CSRC = ROOT / "csrc"


def _truthy(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


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


def _extensions():
    if _truthy("AMPKERNELS_NO_NATIVE"):
        return [], {}
    import torch

    want_cuda = torch.version.cuda is not None and not _truthy("AMPKERNELS_NO_CUDA")
    if want_cuda and not os.environ.get("CUDA_HOME"):
        # Before torch.utils.cpp_extension is imported: it reads CUDA_HOME once, at import.
        home = find_cuda_home()
        if home is not None:
            os.environ["CUDA_HOME"] = home
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    if want_cuda and CUDA_HOME is not None and not (Path(CUDA_HOME) / "include" / "cuda_runtime_api.h").is_file():
        sys.exit(
            f"ampkernels: no CUDA toolkit at CUDA_HOME={CUDA_HOME} (include/cuda_runtime_api.h is missing). Set "
            "CUDA_HOME to the toolkit root (the directory holding bin/nvcc and include/), or AMPKERNELS_NO_CUDA=1 "
            "to build the CPU kernels only."
        )

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
    with_cuda = want_cuda and CUDA_HOME is not None
    if with_cuda:
        arch_list = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", _default_arch_list(torch.version.cuda))
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
    install_requires=["torch>=2.4"],
    extras_require={
        "triton": ["triton"],
        "plot": ["matplotlib"],
        "bench": ["matplotlib", "tqdm"],
        # The models of the training and precision benchmarks; apart from "bench" because torchvision pins the
        # torch version it was built for, and installing it may replace the torch already there.
        "models": ["transformers", "torchvision"],
        "test": ["pytest", "matplotlib", "tqdm"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
