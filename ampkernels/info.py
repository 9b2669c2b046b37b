"""``python -m ampkernels.info``: versions, the GPU, its Tensor Core dtypes, the ampkernels environment variables that
are set, and per op and device the backend chosen and why each other one cannot run (:mod:`ampkernels.dispatch`)."""

from __future__ import annotations

import os
import platform

import torch

from ampkernels import __version__, dispatch

# Lowest compute capability whose Tensor Cores take each dtype.
_TENSOR_CORE_DTYPES = [("float16", (7, 0)), ("bfloat16", (8, 0)), ("tf32", (8, 0)), ("float8 (e4m3/e5m2)", (8, 9))]

_OP_NAMES = {
    "unscale_reduce_": "unscale_reduce_ (unscale + non-finite check + norm)",
    "update_scale_": "update_scale_",
    "adam": "adam (FusedAdam, FusedAdamW)",
    "sgd": "sgd (FusedSGD)",
    "adam_blockwise": "adam_blockwise (FusedAdam with low-bit moments or stochastic rounding)",
    "scaled_matmul": "scaled_matmul (and ScaledLinear)",
    "scaled_matmul_float8": "scaled_matmul_float8 (scaled_matmul on float8 operands)",
    "to_float8": "to_float8 (FP8 casts: to_float8, to_float8_pair)",
    "float8_fused": "float8_fused (fused rms_norm, silu_mul, rotary_embedding)",
}


def _op_line(op: str, device: torch.device) -> str:
    label = _OP_NAMES[op]
    try:
        chosen = dispatch.select(op, device)
    except (RuntimeError, ValueError) as exc:  # an override that cannot run here, or a bad name in it
        return f"  {label}: {exc}"
    asked, source = dispatch.requested(op)
    how = f"{source}={asked}" if asked is not None else "default"
    shown = chosen
    if chosen == "auto":
        candidates = dispatch.auto_candidates(device, op)
        shown = f"auto ({' or '.join(candidates)} per problem, the fastest as timed on first use)"
    others = []
    for name in dispatch.BACKENDS[op]:
        if name != chosen:
            reason = dispatch.why_not(op, name, device)
            others.append(f"{name}: {'available' if reason is None else reason}")
    return f"  {label}: {shown} [{how}] (others: {'; '.join(others)})"


def report() -> str:
    """What ``python -m ampkernels.info`` prints, as one string."""
    lines = [f"ampkernels {__version__}", f"python {platform.python_version()}, torch {torch.__version__}"]
    try:
        import triton

        lines.append(
            f"triton {triton.__version__}" + (" (TRITON_INTERPRET=1)" if dispatch.triton_interpreting() else "")
        )
    except ImportError:
        lines.append("triton: not installed")
    lines.append(f"torch CUDA runtime: {torch.version.cuda or 'none (CPU build of torch)'}")
    set_variables = [f"{name}={os.environ[name]}" for name in dispatch.ENVIRONMENT if name in os.environ]
    lines.append(f"environment: {', '.join(set_variables) if set_variables else 'no ampkernels variable set'}")
    native = dispatch.native()
    if native is None:
        lines.append(f"native extension: not available: {dispatch.why_not('adam', 'native', 'cpu')}")
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
        lines.append(f"backends for {device.type} tensors:")
        for op in dispatch.BACKENDS:
            lines.append(_op_line(op, device))
    return "\n".join(lines)


def main() -> None:
    """Print :func:`report`."""
    print(report())


if __name__ == "__main__":
    main()
