"""Containers as a first-class place (issue 25 item 1): ckptfs mounts, writes, reads
and unmounts as root of a user namespace (``unshare --user --map-root-user --mount``, as
rootless podman runs it), in a mount + pid namespace, as an ordinary user (fusermount3,
no ``allow_other`` without ``user_allow_other``) and as an ordinary user in a user
namespace of its own; ``allow_other = on`` where it is not permitted fails with one
line naming /etc/fuse.conf's ``user_allow_other``.

What a container's runtime would set up is made in a private mount namespace of the
test's child, never on the host: /dev/fuse here is root's (0600), so the ordinary user
gets its own FUSE device node (``mknod`` on a tmpfs, bind-mounted over /dev/fuse: what
``--device /dev/fuse`` gives a container) and, where a test needs it, its own
/etc/fuse.conf.  A mount made in such a namespace is seen only there, so the child does
the I/O itself.  The user's child cannot exec the venv's Python (root's 0700 home): it
runs the CLI in-process (support/asuser.py)."""

from __future__ import annotations

import ctypes
import logging
import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.asuser import run_as
from support.posix import open_dir, system_user

USER = "ckptfs-job"
# What the daemon imports lazily, imported before the user's child cuts off the disk.
DAEMON_IMPORTS = ("ckptfs.node.daemon", "lmdb._envid")
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                       reason="needs root and unshare (util-linux) to make namespaces"),
    # The allow_other = on case fails its mount on purpose.
    pytest.mark.expect_log_errors(r"ERROR ckptfs: mount failed: "),
]


@pytest.fixture(scope="module")
def job_user() -> pwd.struct_passwd:
    return system_user(USER)


@pytest.fixture
def base(tmp_path):
    """A directory the user may enter, with a mount point and a file:// store the user
    owns; the daemon logs (state dirs in here) are copied to ``tmp_path`` for the log
    check."""
    with open_dir("ckptfs-ctr-") as base:
        yield base
        for log in base.glob("*/ckptfs.log"):
            target = tmp_path / log.parent.name
            target.mkdir(exist_ok=True)
            shutil.copy(log, target / "ckptfs.log")


def _owned_dirs(base: Path, uid: int, gid: int) -> tuple[Path, Path, Path]:
    mnt, store, state = base / "mnt", base / "store", base / "state"
    for d in (mnt, store, state):
        d.mkdir()
        os.chown(d, uid, gid)
    return mnt, store, state


def _private_mounts(script: str) -> None:
    """In the forked child, as root: a private mount namespace set up by ``script``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["sh", "-ec", script], check=True)


def _device_for(user: pwd.struct_passwd, base: Path, fuse_conf: str | None = None) -> str:
    """The shell lines that give ``user`` a FUSE device of its own at /dev/fuse (mode
    0600, owned by it: /dev/fuse itself stays root's), and optionally an /etc/fuse.conf
    with ``fuse_conf`` in it."""
    dev = base / "dev"
    dev.mkdir()
    script = (f"mount -t tmpfs -o mode=0755 tmpfs {dev}\n"
              f"mknod -m 600 {dev}/fuse c 10 229\n"
              f"chown {user.pw_uid}:{user.pw_gid} {dev}/fuse\n"
              f"mount --bind {dev}/fuse /dev/fuse\n")
    if fuse_conf is not None:
        (base / "fuse.conf").write_text(fuse_conf)
        os.chmod(base / "fuse.conf", 0o644)
        script += f"mount --bind {base / 'fuse.conf'} /etc/fuse.conf\n"
    return script


def _enter_user_namespace(uid: int, gid: int) -> None:
    """After dropping to an ordinary user: a user namespace (this user is its root) and
    a mount namespace it owns, as ``unshare --user --map-root-user --mount`` makes."""
    libc = ctypes.CDLL(None, use_errno=True)
    # setuid() from root made the process undumpable: /proc/self would stay root's.
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER | CLONE_NEWNS)")
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
    Path("/proc/self/gid_map").write_text(f"0 {gid} 1")


def _mount_write_read_umount(mnt: str, store: str, state: str, extra: list[str],
                             userns: tuple[int, int] | None = None) -> int:
    """As the user, in-process: ``ckptfs mount --foreground`` in a forked daemon, a
    file written and read back through the mount, ``ckptfs status`` and
    ``ckptfs umount`` as the same user.  Prints what it saw; 0 if all went well."""
    from ckptfs.cli.commands import main
    if userns is not None:
        _enter_user_namespace(*userns)
    argv = ["mount", mnt, "--store", f"file://{store}", "--state-dir", state,
            "--foreground", *extra]
    pid = os.fork()
    if pid == 0:                            # the daemon
        code = 1
        try:
            logging.getLogger().handlers.clear()    # pytest's: the daemon logs to stderr
            code = main(argv)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + 30
    while not os.path.ismount(mnt):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print(f"daemon exited with {os.waitstatus_to_exitcode(status)}")
            return 1
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            print("not mounted after 30 s")
            return 1
        time.sleep(0.05)
    try:
        with open(os.path.join(mnt, "model.bin"), "wb") as f:
            f.write(b"weights " * 1000)
        with open(os.path.join(mnt, "model.bin"), "rb") as f:
            print(f"read back {len(f.read())} bytes")
        print(f"status {main(['status', mnt, '--json'])}")
    finally:
        print(f"umount {main(['umount', mnt])}")
    _, status = os.waitpid(pid, 0)
    print(f"daemon {os.waitstatus_to_exitcode(status)}")
    return 0


def _daemon_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " ckptfs" in line]


# --------------------------------------------------------------------------- root in namespaces


@pytest.mark.parametrize("namespaces", [
    ("--user", "--map-root-user", "--mount"),
    ("--user", "--map-root-user", "--mount", "--pid", "--fork", "--mount-proc"),
    ("--mount", "--pid", "--fork", "--mount-proc")],
    ids=["userns+mount", "userns+mount+pid", "mount+pid"])
def test_root_in_namespaces(tmp_path, namespaces):
    mnt, store, state = tmp_path / "mnt", tmp_path / "store", tmp_path / "state"
    mnt.mkdir()
    store.mkdir()
    ckptfs = f"{sys.executable} -m ckptfs"
    script = (f"{ckptfs} mount {mnt} --store file://{store} --state-dir {state}\n"
              f"printf hello > {mnt}/f\ncat {mnt}/f; echo\n"
              f"{ckptfs} umount {mnt}\n")
    proc = subprocess.run(["unshare", *namespaces, "--propagation", "private", "sh", "-ec",
                           script],
                          capture_output=True, text=True, timeout=90,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    assert "hello" in proc.stdout.splitlines(), proc.stdout
    assert not os.path.ismount(mnt)
    log = (state / "ckptfs.log").read_text()
    assert "allow_other on: every user may use this mount" in log, log
    assert b"hello" in b"".join(p.read_bytes() for p in store.rglob("*") if p.is_file())


def test_container_volume_shared_with_the_host(tmp_path):
    # docker -v /mnt/ckpt:/mnt/ckpt:rshared (or a Kubernetes emptyDir / hostPath with
    # Bidirectional propagation): the mount point is itself a mount, the daemon runs in
    # the container's mount namespace, and the host sees and unmounts the mount.
    # The volume here is a tmpfs (another device, as a volume is to a container's root).
    # Before, the daemon refused the mount point ("already a mount point (in use)") and
    # ckptfs umount waited for the volume to go ("still mounted after 60 s").
    mnt, store, state = tmp_path / "mnt", tmp_path / "store", tmp_path / "state"
    mnt.mkdir()
    store.mkdir()
    ckptfs = f"{sys.executable} -m ckptfs"
    make = f"mount -t tmpfs -o mode=0755 volume {mnt}"
    container = f"{ckptfs} mount {mnt} --store file://{store} --state-dir {state}"
    host = (f"{make}\nmount --make-shared {mnt}\n"           # the host's shared volume
            f"unshare -m --propagation unchanged sh -ec '{container}'\n"
            f"printf hello > {mnt}/f\ncat {mnt}/f; echo\n"       # the host, through it
            f"grep -c ' {mnt} .* - fuse.ckptfs ' /proc/self/mountinfo\n"
            f"{ckptfs} umount {mnt}\n"
            f"grep -c ' {mnt} .* - fuse.ckptfs ' /proc/self/mountinfo || true\n")
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-ec", host],
                          capture_output=True, text=True, timeout=90,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-3:] == ["hello", "1", "0"], proc.stdout + proc.stderr
    assert b"hello" in b"".join(p.read_bytes() for p in store.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- an ordinary user


def test_ordinary_user_mounts_without_allow_other(base, job_user):
    # Before allow_other = auto, the mount always asked for allow_other and fusermount3
    # refused it ("option allow_other only allowed if 'user_allow_other' is set in
    # /etc/fuse.conf"): no ordinary user could mount.
    mnt, store, state = _owned_dirs(base, job_user.pw_uid, job_user.pw_gid)
    proc = run_as(USER, _mount_write_read_umount, str(mnt), str(store), str(state), [],
                  imports=DAEMON_IMPORTS, timeout=90,
                  before=lambda: _private_mounts(_device_for(job_user, base,
                                                             "# no user_allow_other\n")))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "read back 8000 bytes" in proc.stdout, proc.stdout + proc.stderr
    assert "status 0" in proc.stdout and "umount 0" in proc.stdout, proc.stdout + proc.stderr
    assert '"allow_other": false' in proc.stdout, proc.stdout
    said = [line for line in _daemon_lines(proc.stderr) if "allow_other" in line]
    assert len(said) == 1 and f"allow_other off: only uid {job_user.pw_uid} ({USER}) can " \
        "use this mount" in said[0] and "user_allow_other in /etc/fuse.conf" in said[0], said
    assert not [line for line in proc.stderr.splitlines()
                if " ERROR " in line or "Traceback" in line], proc.stderr


def test_ordinary_user_allow_other_on_needs_user_allow_other(base, job_user):
    from ckptfs.cli.commands import main
    mnt, store, state = _owned_dirs(base, job_user.pw_uid, job_user.pw_gid)
    argv = ["mount", str(mnt), "--store", f"file://{store}", "--state-dir", str(state),
            "--foreground", "--allow-other", "on"]
    proc = run_as(USER, main, argv, imports=DAEMON_IMPORTS, timeout=60,
                  before=lambda: _private_mounts(_device_for(job_user, base, "")))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"ckptfs: allow_other = on, but uid {job_user.pw_uid} ({USER}) "
                           "may not mount with allow_other"), line
    assert "user_allow_other in /etc/fuse.conf" in line, line
    assert not os.path.ismount(mnt)


def test_ordinary_user_allow_other_on_with_user_allow_other(base, job_user):
    mnt, store, state = _owned_dirs(base, job_user.pw_uid, job_user.pw_gid)
    proc = run_as(USER, _mount_write_read_umount, str(mnt), str(store), str(state),
                  ["--allow-other", "on"], imports=DAEMON_IMPORTS, timeout=90,
                  before=lambda: _private_mounts(_device_for(job_user, base,
                                                             "user_allow_other\n")))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "read back 8000 bytes" in proc.stdout and "umount 0" in proc.stdout, \
        proc.stdout + proc.stderr
    assert '"allow_other": true' in proc.stdout, proc.stdout


def test_ordinary_user_in_a_user_namespace(base, job_user):
    # Rootless podman: the user is root of its own user namespace, with the device.
    mnt, store, state = _owned_dirs(base, job_user.pw_uid, job_user.pw_gid)
    proc = run_as(USER, _mount_write_read_umount, str(mnt), str(store), str(state), [],
                  (job_user.pw_uid, job_user.pw_gid), imports=DAEMON_IMPORTS,
                  timeout=90, before=lambda: _private_mounts(_device_for(job_user, base)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "read back 8000 bytes" in proc.stdout and "umount 0" in proc.stdout, \
        proc.stdout + proc.stderr
    said = [line for line in _daemon_lines(proc.stderr) if "allow_other" in line]
    assert len(said) == 1 and "allow_other on" in said[0], said


# --------------------------------------------------------------------------- what an ordinary user cannot do


def _mount_fails_as_user(base: Path, job_user: pwd.struct_passwd, script: str,
                         *extra: str, before=None) -> str:
    """``ckptfs mount --foreground`` as the user, in a private mount namespace set up
    by ``script``: it fails with one line, which is returned."""
    from ckptfs.cli.commands import main
    mnt, store, state = _owned_dirs(base, job_user.pw_uid, job_user.pw_gid)
    argv = ["mount", str(mnt), "--store", f"file://{store}", "--state-dir", str(state),
            "--foreground", *extra]

    def setup() -> None:
        _private_mounts(script)
        if before is not None:
            before()

    proc = run_as(USER, main, argv, imports=DAEMON_IMPORTS, timeout=60, before=setup)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Exceptions from Trio" not in proc.stderr, \
        proc.stderr
    assert not os.path.ismount(mnt)
    return proc.stderr.strip().splitlines()[-1]


def test_ordinary_user_without_permission_on_dev_fuse(base, job_user):
    # /dev/fuse is root's 0600 (as here, and in a container whose device is not the
    # user's): the line says so, with the mode and who asked.
    dev = base / "dev"
    dev.mkdir()
    script = (f"mount -t tmpfs -o mode=0755 tmpfs {dev}\nmknod -m 600 {dev}/fuse c 10 229\n"
              f"mount --bind {dev}/fuse /dev/fuse\n")
    line = _mount_fails_as_user(base, job_user, script)
    assert line.startswith("ckptfs: /dev/fuse is not permitted: Permission denied "
                           "(device crw------- root:root; you are uid "
                           f"{job_user.pw_uid} ({USER})"), line
    assert "let this user open it (mode 0666 is usual for /dev/fuse), or mount as root" \
        in line, line
    assert "modprobe" not in line


def test_ordinary_user_under_no_new_privs(base, job_user):
    # docker --security-opt no-new-privileges: the setuid fusermount3 runs as the user and
    # cannot mount; libfuse would say only "mount failed: Operation not permitted".
    def no_new_privs() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")

    line = _mount_fails_as_user(base, job_user, _device_for(job_user, base),
                                before=no_new_privs)
    assert "cannot mount for a non-root user: this process runs with no_new_privs" in line, \
        line
    assert "--security-opt no-new-privileges" in line and \
        "allowPrivilegeEscalation: false" in line, line


def test_ordinary_user_on_a_mount_point_it_may_not_write(base, job_user):
    # A volume mounted root's 0755 into the container: fusermount3 would refuse it
    # ("user has no write access to mountpoint"), behind libfuse's generic failure.
    mnt = base / "mnt"
    line = _mount_fails_as_user(base, job_user, _device_for(job_user, base),
                                before=lambda: os.chown(mnt, 0, 0))
    assert line == (f"ckptfs: mount point {mnt} is not writable by uid {job_user.pw_uid} "
                    f"({USER}) (owned by root, drwxr-xr-x): fusermount3 mounts only on a "
                    f"directory the user may write; chown it to the user, or mount as root"), \
        line
