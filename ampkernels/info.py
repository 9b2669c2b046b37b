"""``python -m ampkernels.info``: versions, the GPU, its Tensor Core dtypes, the ampkernels environment variables that
are set, and per op and device the backend chosen and why each other one cannot run (:mod:`ampkernels.dispatch`).

A backend module that is installed but fails to import (:class:`ampkernels.dispatch.BackendImportError`) is shown
where it is needed, its traceback printed after the report, and the command exits with status 1.

``python -m ampkernels.info --require native,triton,torch`` exits with status 1, naming each, when one of the backends
listed does not run on this machine (on the GPU if torch sees one, else on the CPU, where Triton runs under
``TRITON_INTERPRET=1``: the command sets it when it is unset). CI runs it to fail on a backend it expects.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import traceback

import torch

from ampkernels import __version__, dispatch

# Lowest compute capability whose Tensor Cores take each dtype.
_TENSOR_CORE_DTYPES = [("float16", (7, 0)), ("bfloat16", (8, 0)), ("tf32", (8, 0)), ("float8 (e4m3/e5m2)", (8, 9))]


def _op_line(op: str, device: torch.device, errors: list[BaseException]) -> str:
    label = next(spec.label for spec in dispatch.ops() if spec.name == op)
    try:
        return _op_line_or_raise(op, label, device)
    except dispatch.BackendImportError as exc:  # a broken module: shown, and the command fails
        errors.append(exc)
        return f"  {label}: BROKEN: {exc}"


def _op_line_or_raise(op: str, label: str, device: torch.device) -> str:
    try:
        backend = dispatch.choose(op, device)
    except (RuntimeError, ValueError) as exc:  # an override that cannot run here, or a bad name in it
        return f"  {label}: {exc}"
    asked, source = dispatch.requested(op)
    how = f"{source}={asked}" if asked is not None else "default"
    chosen = shown = backend.name
    if isinstance(backend, dispatch.AutoBackend):
        candidates = dispatch.auto_candidates(device, op)
        shown = f"auto ({' or '.join(candidates)} per problem, the fastest as timed on first use)"
    others = []
    for name in dispatch.BACKENDS[op]:
        if name != chosen:
            reason = dispatch.why_not(op, name, device)
            others.append(f"{name}: {'available' if reason is None else reason}")
    return f"  {label}: {shown} [{how}] (others: {'; '.join(others)})"


def report(errors: list[BaseException] | None = None) -> str:
    """What ``python -m ampkernels.info`` prints, as one string. A backend module that fails to import is shown as
    ``BROKEN`` where it is needed, and its exception appended to ``errors`` (when given)."""
    errors = [] if errors is None else errors
    lines = [f"ampkernels {__version__}", f"python {platform.python_version()}, torch {torch.__version__}"]
    try:
        import triton

        lines.append(
            f"triton {triton.__version__}" + (" (TRITON_INTERPRET=1)" if dispatch.triton_interpreting() else "")
        )
    except ImportError as exc:
        if dispatch._not_installed(exc, "triton"):
            lines.append("triton: not installed")
        else:
            errors.append(exc)
            lines.append(f"triton: BROKEN: installed but fails to import ({type(exc).__name__}: {exc})")
    lines.append(f"torch CUDA runtime: {torch.version.cuda or 'none (CPU build of torch)'}")
    set_variables = [f"{name}={os.environ[name]}" for name in dispatch.ENVIRONMENT if name in os.environ]
    lines.append(f"environment: {', '.join(set_variables) if set_variables else 'no ampkernels variable set'}")
    try:
        native = dispatch.native()
    except dispatch.BackendImportError as exc:
        errors.append(exc)
        native = exc
    if isinstance(native, dispatch.BackendImportError):
        lines.append(f"native extension: BROKEN: {native}")
    elif native is None:
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
            lines.append(_op_line(op, device, errors))
    return "\n".join(lines)


def unavailable(backends: list[str], errors: list[BaseException] | None = None) -> dict[str, str]:
    """Each of ``backends`` that does not run on this machine's main device (the GPU if torch sees one, else the
    CPU), with the reason: a backend runs when at least one op that has it runs on it there, and every op's check of
    it returns (a module that fails to import makes it unavailable, its exception appended to ``errors``)."""
    errors = [] if errors is None else errors
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    known = {name for names in dispatch.BACKENDS.values() for name in names}
    missing = {}
    for backend in backends:
        if backend not in known:
            missing[backend] = f"not a backend name (names: {', '.join(sorted(known))})"
            continue
        runs, reasons, broken = False, {}, {}
        for op, names in dispatch.BACKENDS.items():
            if backend not in names:
                continue
            try:
                reason = dispatch.why_not(op, backend, device)
            except dispatch.BackendImportError as exc:
                errors.append(exc)
                broken.setdefault(str(exc), []).append(op)
                continue
            runs |= reason is None
            if reason is not None:
                reasons.setdefault(reason, []).append(op)
        if broken:
            missing[backend] = "BROKEN: " + "; ".join(f"{text} ({', '.join(ops)})" for text, ops in broken.items())
        elif not runs:
            missing[backend] = "; ".join(f"{text} ({', '.join(ops)})" for text, ops in reasons.items())
    return missing


def _print_errors(errors: list[BaseException]) -> None:
    seen = set()
    for exc in errors:
        if str(exc) not in seen:  # the same module met by several ops: its traceback once
            seen.add(str(exc))
            print("".join(traceback.format_exception(exc)), file=sys.stderr, end="")


def main(argv: list[str] | None = None) -> int:
    """Print :func:`report`; with ``--require``, check those backends first. Returns the exit status: 1 when a
    backend module fails to import or a required backend does not run here."""
    parser = argparse.ArgumentParser(prog="python -m ampkernels.info", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--require",
        metavar="BACKEND[,BACKEND...]",
        help="exit with status 1 unless each of these backends runs on this machine (e.g. native,triton,torch)",
    )
    args = parser.parse_args(argv)
    errors: list[BaseException] = []
    missing = {}
    if args.require is not None:
        required = [name.strip() for name in args.require.split(",") if name.strip()]
        if not required:
            parser.error("--require: name at least one backend")
        if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
            # Before any Triton kernel is imported: triton.jit reads it when it decorates them.
            os.environ["TRITON_INTERPRET"] = "1"
        missing = unavailable(required, errors)
    print(report(errors))
    _print_errors(errors)
    for backend, reason in missing.items():
        print(f"ampkernels.info: required backend {backend!r} does not run here: {reason}", file=sys.stderr)
    if args.require is not None and not missing and not errors:
        print(f"required backends all run here: {', '.join(required)}")
    return 1 if errors or missing else 0


if __name__ == "__main__":
    sys.exit(main())
