"""Promise 8 at the front door: a mount that cannot work fails at once, with exit status
non-zero and one line that says why and what to do, in the terminal and in the log;
nothing is left mounted.  A missing or unusable /dev/fuse is made in a private mount
namespace of the mount command (unshare -m), never on the host."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from support.asuser import run_as
from support.mounts import BUCKET, Mount, run_ckptfs

# Each test here makes a mount fail on purpose: the daemon logs why at ERROR.
pytestmark = pytest.mark.expect_log_errors(r"ERROR ckptfs: mount failed: ")


def mount_fails(mountpoint, store_url, *extra, env=None, state_dir=None,
                prefix: tuple[str, ...] = ()) -> str:
    """Run ``ckptfs mount`` (under ``prefix``, e.g. in a namespace of its own) and return
    its one line on stderr; the daemon's log, if it started, says the same."""
    state = state_dir or mountpoint.parent / "state"
    argv = ["mount", str(mountpoint), "--store", store_url, "--state-dir", str(state), *extra]
    mounted = os.path.ismount(mountpoint)       # a test of a mount point in use
    if prefix:
        full_env = dict(os.environ)
        full_env.update(env or {})
        proc = subprocess.run([*prefix, sys.executable, "-m", "ckptfs", *argv], env=full_env,
                              capture_output=True, text=True, timeout=60)
    else:
        proc = run_ckptfs(*argv, env=env, timeout=60)
    assert proc.returncode != 0, proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Exceptions from Trio nursery" not in lines[0], lines[0]
    assert mounted or not os.path.ismount(mountpoint)       # nothing mounted by us
    log = Path(state) / "ckptfs.log"
    if log.exists():
        assert lines[0].removeprefix("ckptfs: ") in log.read_text(), log.read_text()
    return lines[0]


needs_root_and_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare (util-linux) for a private mount namespace")


def in_namespace(script: str) -> tuple[str, ...]:
    """A command prefix: a private mount namespace, set up by the shell ``script``."""
    return ("unshare", "-m", "--propagation", "private", "sh", "-ec",
            script + '\nexec "$@"', "sh")


@pytest.fixture
def mp(tmp_path):
    path = tmp_path / "mnt"
    path.mkdir()
    return path


def test_bad_url(mp):
    assert "bad store URL" in mount_fails(mp, "ftp://example/x")
    assert "absolute" in mount_fails(mp, "file://relative/path")


def test_missing_local_store_dir(mp, tmp_path):
    assert "does not exist" in mount_fails(mp, f"file://{tmp_path}/nope")


def test_unreachable_store(mp):
    # A port bound and held, never listened on: connections are refused, and nothing
    # else can take the port meanwhile.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        env = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
               "AWS_DEFAULT_REGION": "us-east-1"}
        line = mount_fails(mp, "s3://bucket/p", "--endpoint-url", f"http://127.0.0.1:{port}",
                           env=env)
    assert "unreachable" in line


def test_wrong_credentials(mp, seaweed):
    env = dict(seaweed.env())
    env["AWS_SECRET_ACCESS_KEY"] = "wrong-secret"
    assert "access denied" in mount_fails(mp, f"s3://{BUCKET}/p", env=env)


def test_missing_bucket(mp, seaweed):
    line = mount_fails(mp, "s3://no-such-bucket-ckptfs/p", env=seaweed.env())
    assert "no-such-bucket-ckptfs" in line and "does not exist" in line


def test_mountpoint_not_empty(mp, local_store):
    (mp / "something").write_text("x")
    assert "not empty" in mount_fails(mp, local_store.url)


def test_mountpoint_not_a_directory(tmp_path, local_store):
    f = tmp_path / "file"
    f.write_text("x")
    assert "not a directory" in mount_fails(f, local_store.url)


def test_mountpoint_missing(tmp_path, local_store):
    assert "does not exist" in mount_fails(tmp_path / "missing", local_store.url)


def test_store_without_conditional_writes_refused(mp, local_store):
    faults = '{"rules": [{"op": "put_if_absent", "prefix": "probe/", "kind": "no_conditional"}]}'
    line = mount_fails(mp, local_store.url, env={"CKPTFS_FAULTS": faults})
    assert "conditional writes" in line and "--single-writer" in line


def test_state_dir_of_another_store_refused(mp, tmp_path, local_store, make_mount):
    mnt = make_mount(local_store)
    mnt.stop()
    other = tmp_path / "other-store"
    other.mkdir()
    line = mount_fails(mp, f"file://{other}", state_dir=mnt.state_dir)
    assert "belongs to store" in line


# --------------------------------------------------------------------------- the host's side


def test_metrics_address_in_use(mp, local_store):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        line = mount_fails(mp, local_store.url, "--metrics-address", address)
    assert address in line and "in use" in line, line
    assert "choose another --metrics-address or stop what listens there" in line, line


@needs_root_and_unshare
def test_no_dev_fuse(mp, local_store):
    # An empty /dev (a container given no devices) with only what Python itself needs.
    script = ("mount -t tmpfs tmpfs /dev\n"
              "mknod -m 666 /dev/null c 1 3\nmknod -m 666 /dev/urandom c 1 9")
    line = mount_fails(mp, local_store.url, prefix=in_namespace(script))
    assert "no /dev/fuse: load the fuse module on the host, or give the container the " \
        "device (--device /dev/fuse)" in line, line
    assert "modprobe" not in line


@needs_root_and_unshare
def test_dev_fuse_that_is_not_the_fuse_device(mp, local_store):
    line = mount_fails(mp, local_store.url,
                       prefix=in_namespace("mount --bind /dev/null /dev/fuse"))
    assert "/dev/fuse is not the FUSE device" in line and "1:3" in line, line
    assert "--device /dev/fuse" in line, line


@needs_root_and_unshare
def test_dev_fuse_not_permitted(mp, local_store, tmp_path):
    # The FUSE device on a nodev mount: opening it is refused (EACCES), even to root.
    nodev = tmp_path / "nodev"
    nodev.mkdir()
    script = (f"mount -t tmpfs -o nodev tmpfs {nodev}\n"
              f"mknod -m 666 {nodev}/fuse c 10 229\n"
              f"mount --bind {nodev}/fuse /dev/fuse")
    line = mount_fails(mp, local_store.url, prefix=in_namespace(script))
    assert "/dev/fuse is not permitted" in line, line
    assert "crw-rw-rw-" in line and "nodev" in line and "you are uid 0 (root)" in line, line


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv (util-linux)")
def test_root_without_cap_sys_admin(mp, local_store):
    # A container started without --cap-add SYS_ADMIN: root, without the capability.
    line = mount_fails(mp, local_store.url, prefix=(
        "setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin"))
    assert "CAP_SYS_ADMIN" in line and "--cap-add SYS_ADMIN, or a user namespace" in line, line


def _enter_namespace(script: str) -> None:
    """In the forked child, as root: a private mount namespace set up by ``script``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:                       # CLONE_NEWNS
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["sh", "-ec", script], check=True)


@needs_root_and_unshare
def test_non_root_mount_without_fusermount3(local_store):
    from ckptfs.cli.commands import main
    fusermount = shutil.which("fusermount3")
    base = Path(tempfile.mkdtemp(prefix="ckptfs-nofusermount-"))
    try:
        os.chmod(base, 0o777)
        mountpoint = base / "mnt"
        mountpoint.mkdir()
        os.chown(mountpoint, 65534, 65534)
        dev = base / "dev"
        dev.mkdir()
        # /dev/fuse usable by anyone (as on most hosts), fusermount3 gone.
        script = (f"mount -t tmpfs tmpfs {dev}\nmknod -m 666 {dev}/fuse c 10 229\n"
                  f"mount --bind {dev}/fuse /dev/fuse\n")
        if fusermount:
            script += f"mount --bind /dev/null {os.path.realpath(fusermount)}\n"
        argv = ["mount", str(mountpoint), "--store", f"file://{base}", "--state-dir",
                str(base / "state"), "--foreground"]
        proc = run_as("nobody", main, argv, imports=("ckptfs.node.daemon",),
                      before=lambda: _enter_namespace(script), timeout=60)
        assert proc.returncode != 0, proc.stdout
        assert "Traceback" not in proc.stderr, proc.stderr
        line = proc.stderr.strip().splitlines()[-1]
        assert line.startswith("ckptfs: fusermount3 not found"), proc.stderr
        assert "non-root" in line, line
        assert not os.path.ismount(mountpoint)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# --------------------------------------------------------------------------- the mount point


def test_mountpoint_already_mounted(mp, local_store, make_mount):
    mnt = make_mount(local_store)
    line = mount_fails(mnt.path, local_store.url, state_dir=mp.parent / "other-state")
    assert "already a mount point" in line and "unmount it" in line, line


def test_mountpoint_of_a_dead_daemon(tmp_path, local_store):
    mnt = Mount(tmp_path, local_store, "dead")
    try:
        mnt.start()
        os.kill(mnt.pid, signal.SIGKILL)
        mnt._wait_exit()                 # the mount stays, its daemon is gone
        line = mount_fails(mnt.path, local_store.url, state_dir=tmp_path / "other-state")
        assert "daemon is gone" in line and f"fusermount3 -u {mnt.path}" in line, line
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt.path)], capture_output=True)
        mnt.cleanup()


def test_peer_address_in_use(mp, local_store):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        line = mount_fails(mp, local_store.url, "--peer-listen", address)
    assert f"peer address {address}: cannot listen there" in line, line
    assert "in use" in line, line


def test_a_wildcard_peer_address_needs_the_advertised_one(mp, local_store):
    line = mount_fails(mp, local_store.url, "--peer-listen", "0.0.0.0:7601")
    assert "a wildcard --peer-listen needs --peer-advertise" in line, line
