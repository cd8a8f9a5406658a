"""Every CLI error is one line on stderr, never a traceback, and a non-zero exit: a
non-root user, a directory that is not a mount, a daemon that is gone, a control socket
that is gone."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from support.asuser import ckptfs_as
from support import mounts
from support.mounts import Mount, run_ckptfs
from support.posix import open_dir


def one_line_failure(proc: subprocess.CompletedProcess) -> str:
    return mounts.one_line_failure(proc, prefix="ckptfs: ")


COMMANDS = (("status",), ("wait",), ("umount",), ("commit",), ("gc",), ("prefetch",))


@pytest.mark.parametrize("command", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_not_a_mount(tmp_path, command):
    line = one_line_failure(run_ckptfs(*command, str(tmp_path)))
    assert "not a ckptfs mount" in line or "not a directory" in line


def test_daemon_gone_and_socket_gone(local_store, make_mount):
    mnt = make_mount(local_store)
    socket_path = os.getxattr(mnt.path, "user.ckptfs.node.control").decode()
    os.unlink(socket_path)
    for command in COMMANDS[:3]:
        line = one_line_failure(run_ckptfs(*command, str(mnt.path)))
        assert "control socket" in line and "is gone" in line, line
    os.kill(mnt.pid, signal.SIGKILL)
    mnt._wait_exit()
    line = one_line_failure(run_ckptfs("status", str(mnt.path)))
    assert "the daemon is gone" in line
    line = one_line_failure(run_ckptfs("umount", str(mnt.path)))
    assert "lazily unmounted" in line
    assert not os.path.ismount(mnt.path)


@pytest.fixture
def open_base():
    """A directory every user may enter (tmp_path's parents are root's only)."""
    with open_dir("ckptfs-cli-") as base:
        yield base


def as_nobody(*args: str) -> subprocess.CompletedProcess:
    """``ckptfs ARGS...`` as nobody, in a child forked from this (root) process: it works
    from any clone, whatever the modes of its directories (tests/asuser.py)."""
    return ckptfs_as("nobody", *args, timeout=60)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_non_root_user_gets_one_line(open_base, local_store):
    """nobody may ask status and wait; commit and prefetch of root's private directory,
    gc and umount are refused with one line (tests/integration/test_nonroot.py has a
    user doing real work)."""
    mnt = Mount(open_base, local_store)
    os.chmod(mnt.path, 0o755)
    try:
        mnt.start()
        (mnt.path / "ckpt").mkdir()
        os.chmod(mnt.path / "ckpt", 0o700)
        for command in COMMANDS:
            target = mnt.path / "ckpt" if command[0] in ("commit", "prefetch") else mnt.path
            proc = as_nobody(*command, str(target))
            if command[0] in ("status", "wait"):
                assert proc.returncode == 0, proc.stderr
                continue
            line = one_line_failure(proc)
            assert "permission denied" in line.lower(), line
        assert os.path.ismount(mnt.path)          # nobody's umount did nothing
        mnt.stop()
        log = (mnt.state_dir / "ckptfs.log").read_text()
        assert "Traceback" not in log and " ERROR " not in log, log
    finally:
        mnt.cleanup()
