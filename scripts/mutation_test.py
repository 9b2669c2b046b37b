#!/usr/bin/env python
"""Targeted mutation testing: put one deliberate bug at a time into the kernel and reference math, run the tests
that should catch it, and report the bugs that got through (the "survivors").

Every entry of ``scripts/mutations.py`` names a file, an exact snippet that must occur there exactly once, the
snippet that replaces it, a one-line description and the pytest selection that should fail. For each entry the
runner copies the file aside, applies the change, runs ``python -m pytest -x -q <selection>`` (``TRITON_INTERPRET=1``,
with a timeout), and restores the file, always (also on Ctrl-C or an exception; the restore is checked by hash).
Entries on the C++ CPU kernels (``native=True``) rebuild the extension in place after the change and after the
restore; they run only with ``--native`` (an incremental build takes one to a few minutes).

Usage::

    python scripts/mutation_test.py --ci              # every Python/Triton entry (what CI runs)
    python scripts/mutation_test.py --list            # the entries, where they apply, their tests
    python scripts/mutation_test.py --only NAME ...   # chosen entries (shell-style patterns allowed)
    python scripts/mutation_test.py --native          # the C++ entries too (slow)
    python scripts/mutation_test.py --root DIR        # mutate a copy of the repository instead of this one

Exit status: 0 when every entry that ran was killed; 1 when one survived, timed out, could not run, or is stale
(its snippet no longer occurs exactly once); 2 for a usage error.

A run that is killed outright (SIGKILL, power loss) leaves a journal beside the saved original in the temporary
directory; the next run restores the file from it before doing anything else.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

from mutations import MUTATIONS, Mutation  # noqa: E402

DEFAULT_ROOT = SCRIPTS.parent
BUILD_COMMAND = [sys.executable, "setup.py", "build_ext", "--inplace"]
BUILD_TIMEOUT_S = 1800

# pytest exit codes (pytest.ExitCode): 1 = tests failed, 2 = interrupted (a collection error: the mutant does not
# even import), 3 = internal error, 4 = usage error (a node id that does not exist), 5 = no tests collected.
KILLED_CODES = (1, 2)


# --------------------------------------------------------------------------------------------------------------------
# Applying and restoring one mutation
# --------------------------------------------------------------------------------------------------------------------


class StaleMutation(Exception):
    """The entry's original snippet does not occur exactly once in its file."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def locate(m: Mutation, root: Path) -> int:
    """The 1-based line where ``m.original`` starts in its file; raises StaleMutation unless it occurs once."""
    path = root / m.file
    if not path.is_file():
        raise StaleMutation(f"{m.file} does not exist")
    text = path.read_text()
    count = text.count(m.original)
    if count != 1:
        raise StaleMutation(f"the original snippet occurs {count} times in {m.file} (must be exactly once)")
    return text[: text.index(m.original)].count("\n") + 1


def mutated_text(text: str, m: Mutation) -> str:
    count = text.count(m.original)
    if count != 1:
        raise StaleMutation(f"the original snippet occurs {count} times in {m.file} (must be exactly once)")
    return text.replace(m.original, m.mutated, 1)


def _forget_bytecode(path: Path) -> None:
    """Remove the cached bytecode of ``path``: a stale .pyc of the same size and mtime second would be trusted."""
    if path.suffix == ".py":
        for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
            pyc.unlink(missing_ok=True)


def _write(path: Path, data: bytes) -> None:
    """Write ``data`` and give the file a fresh mtime (so that ninja rebuilds what includes it)."""
    path.write_bytes(data)
    os.utime(path)
    _forget_bytecode(path)


class Journal:
    """The saved original of the file being mutated, outside the tree, with a record a later run can recover from."""

    def __init__(self, root: Path):
        key = sha256(str(root).encode())[:12]
        self.dir = Path(tempfile.gettempdir()) / f"ampkernels-mutation-{key}"
        self.record = self.dir / "journal.json"
        self.saved = self.dir / "original"

    def recover(self, root: Path) -> str | None:
        """Restore a file left mutated by a run that died; returns what was done, or None."""
        if not self.record.exists():
            return None
        entry = json.loads(self.record.read_text())
        path = root / entry["file"]
        original = self.saved.read_bytes()
        if sha256(original) != entry["sha256"]:
            raise RuntimeError(f"the saved original in {self.dir} is damaged; restore {path} with git")
        message = f"{entry['file']} was already the original"
        if not path.exists() or sha256(path.read_bytes()) != entry["sha256"]:
            _write(path, original)
            message = f"restored {entry['file']} left mutated by an interrupted run ({entry['name']})"
            if entry.get("native"):
                message += "; the native extension may hold the mutation: rebuild it (or run with --native)"
        self.clear()
        return message

    def save(self, m: Mutation, original: bytes) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.saved.write_bytes(original)
        record = {"file": m.file, "sha256": sha256(original), "name": m.name, "native": m.native}
        tmp = self.record.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self.record)  # the record appears only once the saved copy is complete

    def clear(self) -> None:
        self.record.unlink(missing_ok=True)
        self.saved.unlink(missing_ok=True)
        if self.dir.is_dir() and not any(self.dir.iterdir()):
            self.dir.rmdir()


class Applied:
    """``with Applied(m, root, journal):`` the file holds the mutation inside the block, the original after it,
    whatever happens inside (the restore is verified by hash)."""

    def __init__(self, m: Mutation, root: Path, journal: Journal):
        self.m, self.path, self.journal = m, root / m.file, journal
        self.original: bytes = b""

    def __enter__(self) -> Applied:
        self.original = self.path.read_bytes()
        mutated = mutated_text(self.original.decode(), self.m).encode()
        self.journal.save(self.m, self.original)
        _write(self.path, mutated)
        return self

    def __exit__(self, *exc) -> None:
        restore(self.path, self.original)
        self.journal.clear()


def restore(path: Path, original: bytes) -> None:
    _write(path, original)
    if sha256(path.read_bytes()) != sha256(original):
        raise RuntimeError(f"could not restore {path}: its content differs from the saved original")


# --------------------------------------------------------------------------------------------------------------------
# Running the tests and the build
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    m: Mutation
    line: int | None
    result: str  # killed, survived, timeout, error, stale, equivalent, skipped
    seconds: float = 0.0
    detail: str = ""


def _env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    return env


def _run(cmd: list[str], root: Path, timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group; (exit code or None on timeout, combined output)."""
    with tempfile.TemporaryFile(mode="w+") as out:
        proc = subprocess.Popen(
            cmd, cwd=root, env=env or _env(root), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.seek(0)
        return code, out.read()


def _first_failure(output: str) -> str:
    match = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    return match.group(1) if match else ""


#: Imported once by the runner and inherited by every forked test run (none of them imports ampkernels).
PRELOAD = ("numpy", "torch", "triton", "triton.language", "pytest")


class Forker:
    """Runs each test selection in a child forked from this process after the heavy imports (torch, triton,
    pytest), so that a mutation costs its tests, not a fresh interpreter's start (3-15 s each on a 2-core machine).
    The child imports ampkernels, the tests and the extension itself, from the mutated tree."""

    def __init__(self, root: Path):
        self.root = root
        os.environ["TRITON_INTERPRET"] = _env(root)["TRITON_INTERPRET"]  # before triton is imported
        sys.dont_write_bytecode = True
        for name in PRELOAD:
            try:
                __import__(name)
            except ImportError:
                pass
        loaded = [name for name in sys.modules if name == "ampkernels" or name.startswith("ampkernels.")]
        if loaded:
            raise RuntimeError(f"the runner must not import ampkernels before forking (it has {loaded[0]})")

    def call(self, func, timeout: float) -> tuple[int | None, str]:
        """``func()`` (returns an exit code) in a forked child, in ``root`` with ``root`` first on sys.path;
        (exit code or None on timeout, the child's output)."""
        with tempfile.TemporaryFile(mode="w+") as out:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child: never returns
                code = 3
                try:
                    os.setsid()
                    os.dup2(out.fileno(), 1)
                    os.dup2(out.fileno(), 2)
                    os.chdir(self.root)
                    sys.path.insert(0, str(self.root))
                    code = int(func())
                except BaseException:
                    import traceback

                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            status = None
            try:
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    done, st = os.waitpid(pid, os.WNOHANG)
                    if done:
                        status = st
                        break
                    time.sleep(0.1)
            finally:
                if status is None:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    os.waitpid(pid, 0)
            out.seek(0)
            return (None if status is None else os.waitstatus_to_exitcode(status)), out.read()


PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider"]


def run_tests(m: Mutation, root: Path, timeout: float, forker: Forker | None) -> tuple[str, str]:
    if forker is not None:
        import pytest

        code, output = forker.call(lambda: pytest.main([*PYTEST_ARGS, *m.tests]), timeout)
    else:
        code, output = _run([sys.executable, "-m", "pytest", *PYTEST_ARGS, *m.tests], root, timeout)
    if code is None:
        return "timeout", f"the tests ran past {timeout:.0f} s"
    if code == 0:
        return "survived", output.strip().splitlines()[-1] if output.strip() else ""
    if code in KILLED_CODES:
        return "killed", _first_failure(output) or "collection failed"
    tail = "\n".join(output.strip().splitlines()[-5:])
    return "error", f"pytest exited with {code} (the selection is wrong?):\n{tail}"


def native_library(root: Path) -> Path | None:
    found = sorted((root / "ampkernels").glob("_C*.so")) + sorted((root / "ampkernels").glob("_C*.pyd"))
    return found[0] if found else None


def build_native(root: Path, changed: bool) -> None:
    """Rebuild ``ampkernels._C`` in place (the CPU kernels only, unless AMPKERNELS_NO_CUDA=0 is set); with
    ``changed`` (a source was changed since the last build), check that the library was relinked."""
    before = native_library(root)
    before_mtime = before.stat().st_mtime_ns if before else None
    env = _env(root)
    env.setdefault("AMPKERNELS_NO_CUDA", "1")
    env.setdefault("MAX_JOBS", "2")
    start = time.monotonic()
    code, output = _run(BUILD_COMMAND, root, BUILD_TIMEOUT_S, env)
    if code != 0:
        tail = "\n".join(output.strip().splitlines()[-20:])
        raise RuntimeError(f"the native build failed (exit {code}):\n{tail}")
    after = native_library(root)
    if after is None:
        raise RuntimeError("the native build left no ampkernels/_C library")
    print(f"  built {after.name} in {time.monotonic() - start:.0f} s", flush=True)
    if changed and before_mtime is not None and after.stat().st_mtime_ns == before_mtime:
        raise RuntimeError("the native build did not relink the library after a source change")


def check_imports(root: Path, native: bool, forker: Forker | None) -> None:
    """The tests must import the package of ``root`` (and, for native entries, its extension)."""
    code = "import ampkernels; print(ampkernels.__file__)"
    if native:
        code += "; import ampkernels._C"
    if forker is not None:
        rc, out = forker.call(lambda: exec(code) or 0, 300)
    else:
        rc, out = _run([sys.executable, "-c", code], root, 300)
    if rc != 0:
        raise RuntimeError(f"cannot import ampkernels{'._C' if native else ''} from {root}:\n{out.strip()}")
    where = Path(out.strip().splitlines()[-1]).resolve()
    if root.resolve() not in where.parents:
        raise RuntimeError(f"the tests would import ampkernels from {where}, not from {root}")


# --------------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------------


def select(mutations: list[Mutation], only: list[str], native: bool) -> tuple[list[Mutation], list[Mutation]]:
    """(entries to consider, native entries left out for want of --native)."""
    chosen = list(mutations)
    if only:
        patterns = [p for arg in only for p in arg.split(",") if p]
        chosen = [m for m in chosen if any(fnmatch.fnmatchcase(m.name, p) for p in patterns)]
        unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(m.name, p) for m in mutations)]
        if unknown:
            raise SystemExit(f"mutation_test: no entry named {', '.join(unknown)} (see --list)")
    left_out = [m for m in chosen if m.native and not native]
    return [m for m in chosen if not m.native or native], left_out


def print_list(mutations: list[Mutation], root: Path) -> int:
    stale = 0
    for m in mutations:
        try:
            where = f"{m.file}:{locate(m, root)}"
        except StaleMutation as e:
            where, stale = f"{m.file}: STALE ({e})", stale + 1
        kind = "native" if m.native else "python"
        print(f"{m.name}  [{kind}]  {where}\n    {m.description}\n    tests: {' '.join(m.tests)}")
        if m.equivalent:
            print(f"    equivalent: {m.equivalent}")
    print(f"\n{len(mutations)} entries, {sum(m.native for m in mutations)} native; {stale} stale")
    return 1 if stale else 0


def print_report(outcomes: list[Outcome], total_s: float, root: Path) -> None:
    rows = [(o.m.name, f"{o.m.file}:{o.line if o.line else '?'}", o.result, f"{o.seconds:.0f}") for o in outcomes]
    head = ("mutation", "where", "result", "s")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]

    def fmt(r):
        return "  ".join(f"{c:<{w}}" for c, w in zip(r[:3], widths)) + f"  {r[3]:>{widths[3]}}"

    print("\n" + fmt(head))
    print(fmt(["-" * w for w in widths]))
    for r in rows:
        print(fmt(r))
    counts = {}
    for o in outcomes:
        counts[o.result] = counts.get(o.result, 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    print(f"\n{len(outcomes)} mutations in {total_s:.0f} s: {summary} (root {root})")
    bad = [o for o in outcomes if o.result not in ("killed", "equivalent", "skipped")]
    if bad:
        print("\nNot killed:")
        for o in bad:
            print(f"  {o.m.name} ({o.m.file}:{o.line if o.line else '?'}): {o.result}. {o.m.description}")
            if o.detail and o.result != "survived":
                print("    " + o.detail.replace("\n", "\n    "))
            if o.result == "survived":
                print(f"    tests: {' '.join(o.m.tests)}")


def run_all(selected: list[Mutation], root: Path, timeout: float | None, verbose: bool, fork: bool) -> list[Outcome]:
    journal = Journal(root)
    note = journal.recover(root)
    if note:
        print(f"mutation_test: {note}", flush=True)
    outcomes: list[Outcome] = []
    runnable: list[tuple[Mutation, int]] = []
    for m in selected:
        try:
            line = locate(m, root)
        except StaleMutation as e:
            outcomes.append(Outcome(m, None, "stale", detail=str(e)))
            continue
        if m.equivalent:
            outcomes.append(Outcome(m, line, "equivalent", detail=m.equivalent))
        else:
            runnable.append((m, line))
    if not runnable:
        return outcomes
    natives = [m for m, _ in runnable if m.native]
    forker = Forker(root) if fork else None
    check_imports(root, native=False, forker=forker)
    native_dirty = False  # a native source was restored since the last build
    try:
        if natives:
            print("building the native extension from the unmutated sources", flush=True)
            build_native(root, changed=False)
            check_imports(root, native=True, forker=forker)
        for i, (m, line) in enumerate(runnable, 1):
            print(
                f"[{i}/{len(runnable)}] {m.name} ({m.file}:{line}) ...", end=" " if not m.native else "\n", flush=True
            )
            start = time.monotonic()
            with Applied(m, root, journal):
                if m.native:
                    native_dirty = True
                    build_native(root, changed=True)
                result, detail = run_tests(m, root, timeout or m.timeout, forker)
            seconds = time.monotonic() - start
            print(
                f"{result} ({seconds:.0f} s){'  ' + detail.splitlines()[0] if detail and verbose else ''}", flush=True
            )
            outcomes.append(Outcome(m, line, result, seconds, detail))
    finally:
        if native_dirty:
            print("rebuilding the native extension from the restored sources", flush=True)
            try:
                build_native(root, changed=True)
            except BaseException:
                print(
                    "mutation_test: WARNING: the rebuild from the restored sources did not finish; ampkernels/_C "
                    "may hold a mutation. Rebuild it: AMPKERNELS_NO_CUDA=1 python setup.py build_ext --inplace",
                    file=sys.stderr,
                )
                raise
    return outcomes


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ci", action="store_true", help="run every Python/Triton entry (what CI runs)")
    parser.add_argument("--native", action="store_true", help="also run the C++ entries (rebuilds the extension)")
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="only these entries (patterns)")
    parser.add_argument("--list", action="store_true", help="list the entries and check that none is stale")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="repository to mutate (default: this one)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per entry (default: each entry's own)")
    parser.add_argument(
        "--no-fork", action="store_true", help="run each selection in a fresh interpreter instead of a forked child"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="name the test that killed each mutation")
    args = parser.parse_args(argv)
    if args.ci and args.native:
        parser.error("--ci runs the Python/Triton entries only; leave out --native")
    root = args.root.resolve()
    if not (root / "ampkernels").is_dir():
        parser.error(f"--root {root} is not an ampkernels checkout")
    if args.list:
        return print_list(MUTATIONS, root)
    selected, left_out = select(MUTATIONS, args.only, args.native)
    if left_out:
        print(f"mutation_test: {len(left_out)} native entries left out (add --native to run them)")
    if not selected:
        print("mutation_test: nothing to run")
        return 0 if not args.only else 1
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    start = time.monotonic()
    try:
        outcomes = run_all(selected, root, args.timeout, args.verbose, fork=hasattr(os, "fork") and not args.no_fork)
    except KeyboardInterrupt:
        print("\nmutation_test: interrupted; the mutated file was restored", file=sys.stderr)
        return 130
    print_report(outcomes, time.monotonic() - start, root)
    failed = any(o.result not in ("killed", "equivalent") for o in outcomes)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
