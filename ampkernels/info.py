"""``python -m ampkernels.info``: versions, the GPU, its Tensor Core dtypes, and the backend of each op."""

from __future__ import annotations

import importlib
import platform

import torch

from ampkernels import __version__, _backend

# Lowest compute capability whose Tensor Cores take each dtype.
_TENSOR_CORE_DTYPES = [("float16", (7, 0)), ("bfloat16", (8, 0)), ("tf32", (8, 0)), ("float8 (e4m3/e5m2)", (8, 9))]

OPS = ["unscale_reduce_ (unscale + non-finite check + norm)", "update_scale_"]


def _scaled_matmul_line(device: torch.device) -> str:
    # ampkernels.scaled_matmul the attribute is the function; the module is reached by its import path.
    sm = importlib.import_module("ampkernels.scaled_matmul")

    try:
        chosen = sm.select_backend(device)
    except RuntimeError as exc:  # an override that cannot run here
        return f"  op scaled_matmul: {exc}"
    others = [f"{name}: {sm.why_not(name, device) or 'available'}" for name in sm.BACKENDS if name != chosen]
    if chosen == "auto":
        chosen = f"auto ({' or '.join(sm.AUTO_CANDIDATES)} per problem, the faster as timed on first use)"
    return f"  op scaled_matmul: {chosen} (others: {'; '.join(others)})"


def report() -> str:
    lines = [f"ampkernels {__version__}", f"python {platform.python_version()}, torch {torch.__version__}"]
    try:
        import triton

        lines.append(
            f"triton {triton.__version__}" + (" (TRITON_INTERPRET=1)" if _backend.triton_interpreting() else "")
        )
    except ImportError:
        lines.append("triton: not installed")
    lines.append(f"torch CUDA runtime: {torch.version.cuda or 'none (CPU build of torch)'}")
    native = _backend.native()
    if native is None:
        lines.append(f"native extension: not available: {_backend.why_not('native', torch.device('cpu'))}")
    else:
        archs = native.cuda_arch_list or "-"
        lines.append(f"native extension: built {'with' if native.with_cuda else 'without'} CUDA (archs: {archs})")
        wanted = torch.get_num_threads()
        used = native.parallel_for_threads(max(2, wanted)) if hasattr(native, "parallel_for_threads") else 1
        lines.append(
            f"native CPU kernels and gradient checks: {used} of torch's {wanted} intra-op threads"
            + ("" if used == wanted else " (extension built without OpenMP: see setup.py)")
        )
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            dtypes = [name for name, need in _TENSOR_CORE_DTYPES if cap >= need] or ["none"]
            lines.append(
                f"GPU {i}: {torch.cuda.get_device_name(i)}, compute capability {cap[0]}.{cap[1]}, "
                f"Tensor Core dtypes: {', '.join(dtypes)}"
            )
        devices.append(torch.device("cuda"))
    else:
        lines.append("GPU: none visible to torch")
    for device in devices:
        chosen = _backend.select(device)
        lines.append(f"backends for {device.type} tensors: using {chosen!r}")
        for name in _backend.BACKENDS:
            reason = _backend.why_not(name, device)
            lines.append(f"  {name:7s} {'available' if reason is None else 'unavailable: ' + reason}")
        for op in OPS:
            lines.append(f"  op {op}: {chosen}")
        lines.append(_scaled_matmul_line(device))
    return "\n".join(lines)


def main() -> None:
    print(report())


if __name__ == "__main__":
    main()
