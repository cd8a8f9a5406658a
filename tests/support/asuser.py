"""Run part of a test as another (non-root) user, from any clone of the repository.

The test process (root) forks; the child drops to the user's uid, gid and groups and
calls a function of the test, with everything it needs already imported by root.  The
child never executes the Python binary, never reads the repository, the virtualenv or
the standard library from disk: a clone in a private directory (mode 0700, as one in
root's home is) and a Python under ``/root/.pyenv`` work as well as any other.  To keep
it so, the child's import system is cut off from the disk after ``setuid``: a module
not imported beforehand fails the test with ``ModuleNotFoundError`` on every machine,
instead of only on those whose directory modes hide it.

Knows nothing of ckptfs beyond the modules :data:`PRELOAD` names.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import pwd
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

# What ckptfs's client side imports lazily (cli.py, api.py): imported by root, before
# the fork, so that the user never needs the files.
PRELOAD = ("ckptfs", "ckptfs.cli.api", "ckptfs.cli.commands", "ckptfs.node.config", "ckptfs.cli.display",
           "ckptfs.node.fstab", "ckptfs.bench.runner", "ckptfs.node.metrics", "ckptfs.format.checkpoints",
           "ckptfs.cluster.retention", "argparse", "json", "socket", "struct", "errno")


def preload(extra: tuple[str, ...] = ()) -> None:
    for name in (*PRELOAD, *extra):
        importlib.import_module(name)
    from ckptfs.cli.commands import build_parser
    build_parser()


def _no_disk_imports() -> None:
    """Only modules already in memory (and built-in or frozen ones) can be imported."""
    keep = (importlib.machinery.BuiltinImporter, importlib.machinery.FrozenImporter)
    sys.meta_path[:] = [finder for finder in sys.meta_path if finder in keep]
    sys.path[:] = []
    sys.path_importer_cache.clear()


def run_as(user: str, fn: Callable[..., object], *args: object, env: dict | None = None,
           timeout: float = 120, imports: tuple[str, ...] = (),
           before: Callable[[], None] | None = None) -> subprocess.CompletedProcess:
    """``fn(*args)`` in a forked child running as ``user``; its return value (an int or
    None), ``SystemExit`` or a traceback give the return code, and what it wrote to
    file descriptors 1 and 2 (``print``, ``sys.stderr``) the output.  ``imports`` are
    modules ``fn`` needs beyond :data:`PRELOAD`; ``before`` runs in the child as root,
    before it drops to the user (e.g. to enter a namespace of its own)."""
    preload(imports)
    pw = pwd.getpwnam(user)
    groups = os.getgrouplist(user, pw.pw_gid)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:                                    # the child: never returns
            code = 1
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout = open(1, "w", closefd=False)
                sys.stderr = open(2, "w", closefd=False)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                if before is not None:
                    before()
                os.setgroups(groups)
                os.setgid(pw.pw_gid)
                os.setuid(pw.pw_uid)
                os.environ.clear()
                os.environ.update({"HOME": "/tmp", "PATH": "/usr/bin:/bin"}, **(env or {}))
                _no_disk_imports()
                result = fn(*args)
                code = result if isinstance(result, int) else 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None
                                                                  else 1)
            except BaseException:  # noqa: BLE001 - reported to the parent as stderr
                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(f"{fn.__name__} as {user}", timeout)
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([fn.__name__, *map(str, args)],
                                           os.waitstatus_to_exitcode(status),
                                           out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


def ckptfs_as(user: str, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``ckptfs ARGV...`` as ``user``: the CLI's ``main`` in the forked child."""
    from ckptfs.cli.commands import main
    return run_as(user, main, list(argv), timeout=timeout)
