"""An ordinary local user against the control socket (issue items 7 and 8): it cannot
starve the daemon — idle connections, a request that never ends, a flood of
connections — and ``prefetch`` walks a tree as that user would, skipping what they
cannot search or read.

The tests run as root; the other user is a forked child that drops its credentials
with ``setresuid`` before it connects (``SO_PEERCRED`` reports them at connect time)
and before it runs the CLI's code in-process (a non-root child may not exec the venv's
Python: it lives in root's 0700 home)."""

from __future__ import annotations

import collections
import os
import pwd
import resource
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

# The child that acts as the user cannot import from root's home once it dropped its
# credentials: what it runs is imported here, before the fork.
import ckptfs.api
import ckptfs.bench
import ckptfs.config
import ckptfs.cli
import ckptfs.display
import ckptfs.fstab
from conftest import Mount, run_ckptfs

USER = "ckptfs-job"
MiB = 1 << 20

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


@pytest.fixture(scope="module")
def job_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/sh",
                        USER], check=True)
        return pwd.getpwnam(USER)


@pytest.fixture
def open_base(tmp_path):
    """A directory every user may enter (tmp_path's parents are root's only); the
    daemon logs are linked into ``tmp_path`` so the log check reads them."""
    base = Path(tempfile.mkdtemp(prefix="ckptfs-nonroot-"))
    os.chmod(base, 0o755)
    yield base
    for log in base.glob("*-state/ckptfs.log"):
        target = tmp_path / log.parent.name
        target.mkdir(exist_ok=True)
        shutil.copy(log, target / "ckptfs.log")
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def mounts(open_base):
    made: list[Mount] = []

    def factory(name: str, store, **kwargs) -> Mount:
        mount = Mount(open_base, store, name)
        os.chmod(mount.path, 0o755)
        made.append(mount)
        mount.start(**kwargs)
        return mount

    yield factory
    for mount in made:
        mount.cleanup()


def drop_to(user: pwd.struct_passwd) -> None:
    os.setgroups([])
    os.setresgid(user.pw_gid, user.pw_gid, user.pw_gid)
    os.setresuid(user.pw_uid, user.pw_uid, user.pw_uid)


def run_as(user: pwd.struct_passwd, fn: Callable[[], int], timeout: float = 120
           ) -> tuple[int, str, str]:
    """``fn()`` in a forked child running as ``user``: (exit status, stdout, stderr)."""
    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:        # the child: never returns into pytest
        status = 99
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.stdout = open(1, "w", closefd=False)      # not pytest's capture
            sys.stderr = open(2, "w", closefd=False)
            drop_to(user)
            status = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            print(f"child failed: {exc!r}", file=sys.stderr)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError(f"the child as {user.pw_name} did not finish in {timeout} s")
        time.sleep(0.05)
    out.seek(0)
    err.seek(0)
    return os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode()


def fetched_bytes(mnt: Mount) -> int:
    return mnt.store_stats()["chunk_bytes_got"]


# --------------------------------------------------------------------------- prefetch (8)


def test_prefetch_as_a_user_skips_what_they_cannot_search_or_read(open_base, mounts,
                                                                    local_store, job_user):
    a = mounts("a", local_store)
    pub = a.path / "pub"
    (pub / "private").mkdir(parents=True)
    os.chmod(pub, 0o755)
    os.chmod(pub / "private", 0o700)                     # root's: not searchable by others
    (pub / "private" / "secret.bin").write_bytes(os.urandom(3_000_000))
    os.chmod(pub / "private" / "secret.bin", 0o644)
    (pub / "locked.bin").write_bytes(os.urandom(2 * MiB))
    os.chmod(pub / "locked.bin", 0o600)                  # not readable by others
    (pub / "open.bin").write_bytes(os.urandom(MiB))
    b = mounts("b", local_store)                          # a fresh node: nothing cached
    mine = b.path / "pub"

    def cat_secret() -> int:
        try:
            (mine / "private" / "secret.bin").read_bytes()
        except PermissionError:
            return 13
        return 0

    assert run_as(job_user, cat_secret)[0] == 13          # the kernel says no, too
    before = fetched_bytes(b)

    def prefetch() -> int:
        from ckptfs.cli import main
        return main(["prefetch", str(mine)])

    status, out, err = run_as(job_user, prefetch)
    assert status == 0, err
    assert "prefetched 1 file(s)" in out, out
    assert "2 skipped" in out, out
    assert fetched_bytes(b) - before == MiB              # open.bin only

    def raw_reply() -> int:
        from ckptfs import api
        for reply in api.request(b.path, {"cmd": "prefetch", "path": str(mine)}, timeout=60):
            if reply.get("done"):
                print(reply["files"], reply["bytes"], reply["skipped"])
        return 0

    status, out, err = run_as(job_user, raw_reply)
    assert status == 0, err
    assert out.split() == ["1", str(MiB), "2"]
    assert fetched_bytes(b) - before == MiB
    # Root walks it all.
    proc = run_ckptfs("prefetch", str(mine))
    assert proc.returncode == 0, proc.stderr
    assert "prefetched 3 file(s)" in proc.stdout and "skipped" not in proc.stdout
    assert fetched_bytes(b) - before == MiB + 2 * MiB + 3_000_000
