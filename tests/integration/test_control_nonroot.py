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
import ckptfs.cli.api
import ckptfs.bench.runner
import ckptfs.node.config
import ckptfs.cli.commands
import ckptfs.cli.display
import ckptfs.node.fstab
from support import asuser
from support.mounts import Mount, run_ckptfs
from support.posix import open_dir, system_user

USER = "ckptfs-job"
MiB = 1 << 20

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


@pytest.fixture(scope="module")
def job_user() -> pwd.struct_passwd:
    return system_user(USER)


@pytest.fixture
def open_base(tmp_path):
    """A directory every user may enter (tmp_path's parents are root's only); the
    daemon logs are linked into ``tmp_path`` so the log check reads them."""
    with open_dir("ckptfs-nonroot-") as base:
        yield base
        for log in base.glob("*-state/ckptfs.log"):
            target = tmp_path / log.parent.name
            target.mkdir(exist_ok=True)
            shutil.copy(log, target / "ckptfs.log")


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
    proc = asuser.run_as(user.pw_name, fn, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


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
        from ckptfs.cli.commands import main
        return main(["prefetch", str(mine)])

    status, out, err = run_as(job_user, prefetch)
    assert status == 0, err
    assert "prefetched 1 file(s)" in out, out
    assert "2 skipped" in out, out
    assert fetched_bytes(b) - before == MiB              # open.bin only

    def raw_reply() -> int:
        from ckptfs.cli import api
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


# --------------------------------------------------------------------------- abuse (7)

IDLE = 3000


def hog(path: str, stop_r: int, ready_w: int) -> int:
    """As the ordinary user: keep ``IDLE`` idle connections open (a rolling window,
    so closed ones are replaced), and stream a request that never ends, reconnecting
    whenever the daemon hangs up, until ``stop_r`` closes."""
    stopping = threading.Event()

    def stream() -> None:
        piece = b"x" * 65536
        while not stopping.is_set():
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(2)
                    s.connect(path)
                    s.sendall(b'{"cmd": "status", "pad": "')
                    while not stopping.is_set():
                        s.sendall(piece)
            except OSError:
                time.sleep(0.01)

    threading.Thread(target=stream, daemon=True).start()
    held: collections.deque[socket.socket] = collections.deque()
    attempts = 0
    while not select.select([stop_r], [], [], 0)[0]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(1)
        try:
            s.connect(path)
            held.append(s)
        except OSError:
            s.close()
        attempts += 1
        if len(held) > IDLE:
            held.popleft().close()
        if attempts == IDLE:
            os.write(ready_w, b"r")
        if attempts >= IDLE:
            time.sleep(0.002)       # then a steady trickle of new ones
    stopping.set()
    return 0


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


WRITE_AND_LS = textwrap.dedent("""
    import os, sys
    d = sys.argv[1]
    with open(os.path.join(d, sys.argv[2]), "wb") as f:
        f.write(os.urandom(1 << 20))
    print(len(os.listdir(d)))
""")


def write_and_ls(mnt: Mount, name: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WRITE_AND_LS, str(mnt.path), name],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.timeout(240)
def test_a_user_flooding_the_control_socket_cannot_starve_the_daemon(
        open_base, mounts, local_store, job_user):
    mnt = mounts("node", local_store)
    # The fd limit a systemd service gets by default: a flood without a cap reaches it.
    resource.prlimit(mnt.pid, resource.RLIMIT_NOFILE, (1024, 1024))
    assert write_and_ls(mnt, "warm.bin").returncode == 0
    path = os.getxattr(mnt.path, "user.ckptfs.node.control").decode()
    log = mnt.state_dir / "ckptfs.log"
    log_before = log.read_text()
    rss_before, fds_before = rss_kib(mnt.pid), fd_count(mnt.pid)

    stop_r, stop_w = os.pipe()
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:
        status = 99
        try:
            os.close(stop_w)
            drop_to(job_user)
            status = hog(path, stop_r, ready_w)
        finally:
            os._exit(status)
    os.close(stop_r)
    os.close(ready_w)
    try:
        assert select.select([ready_r], [], [], 120)[0], "the flood never got going"
        rss_peak, fds_peak = 0, 0
        answers: list[tuple[int, int]] = []
        cpu_before, started = cpu_seconds(mnt.pid), time.monotonic()   # shown, not asserted
        for second in range(12):                 # past the request deadline, twice
            rss_peak = max(rss_peak, rss_kib(mnt.pid))
            fds_peak = max(fds_peak, fd_count(mnt.pid))
            if second in (3, 9):
                status = run_ckptfs("status", "--json", str(mnt.path), timeout=30)
                answers.append((status.returncode,
                                write_and_ls(mnt, f"during-{second}.bin").returncode))
            time.sleep(1)
        rss_peak = max(rss_peak, rss_kib(mnt.pid))
        fds_peak = max(fds_peak, fd_count(mnt.pid))
        seen = {"answers": answers, "fds": (fds_before, fds_peak),
                "rss_kib": (rss_before, rss_peak),
                "daemon_cpu": round((cpu_seconds(mnt.pid) - cpu_before)
                                    / (time.monotonic() - started), 2)}
        print(seen)
        assert answers == [(0, 0), (0, 0)], seen
        assert fds_peak - fds_before < 200, seen
        assert rss_peak - rss_before < 8 * 1024, seen
        # Root's umount is answered while the flood goes on.
        mnt.stop()
    finally:
        os.close(stop_w)
        os.waitpid(child, 0)
    new = log.read_text()[len(log_before):]
    assert "Traceback" not in new, new[:3000]
    about = [line for line in new.splitlines() if "control" in line]
    assert 1 <= len(about) <= 4, new[:3000]
    assert str(job_user.pw_uid) in about[0], about
