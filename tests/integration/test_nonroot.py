"""Non-root jobs (issue 12 part 5): an ordinary user saves, reads and waits on its own
files through the mount; the control socket checks who asks (SO_PEERCRED): anyone may
ask status/wait/state, commit and prefetch need the caller's own permission on the
path, gc and umount are root's."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from support.asuser import ckptfs_as, run_as
from support.mounts import Mount, one_line_failure
from support.posix import open_dir, system_user

USER = "ckptfs-job"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


@pytest.fixture(scope="module")
def job_user() -> pwd.struct_passwd:
    return system_user(USER)


@pytest.fixture
def open_base():
    with open_dir("ckptfs-nonroot-") as base:
        yield base


def ckptfs_as_user(*args: str) -> subprocess.CompletedProcess:
    return ckptfs_as(USER, *args)


def job(jobs: str) -> None:
    """An ordinary user's training job (in the forked child, as USER)."""
    import ckptfs
    ckpt = os.path.join(jobs, "checkpoint-1")
    os.makedirs(ckpt)
    data = os.urandom(300_000)
    with open(os.path.join(ckpt, "model.bin"), "wb") as f:
        f.write(data)
    with open(os.path.join(jobs, "log.txt"), "w") as f:
        f.write("step 1")
    ckptfs.wait(jobs, timeout=120)
    assert ckptfs.state(os.path.join(jobs, "log.txt")) == "published"
    result = ckptfs.commit(ckpt)
    assert result.sealed and result.journaled, result     # async mode: journaled
    ckptfs.wait(ckpt, timeout=120)
    assert "checkpoint-1" in os.listdir(jobs)
    with open(os.path.join(ckpt, "model.bin"), "rb") as f:
        assert f.read() == data
    st = os.stat(os.path.join(ckpt, "model.bin"))
    print(os.getuid(), st.st_uid, oct(st.st_mode & 0o777))


def test_ordinary_user_saves_reads_waits_and_commits(open_base, local_store, job_user):
    mnt = Mount(open_base, local_store)
    os.chmod(mnt.path, 0o755)
    try:
        mnt.start(durability="async")
        jobs = mnt.path / "jobs"
        jobs.mkdir()
        os.chown(jobs, job_user.pw_uid, job_user.pw_gid)
        # root's own things: a staged checkpoint and a private file
        (mnt.path / "checkpoint-9").mkdir()
        private = mnt.path / "private.bin"
        private.write_bytes(b"secret")
        os.chmod(private, 0o600)

        proc = run_as(USER, job, str(jobs))
        assert proc.returncode == 0, proc.stderr
        uid = str(job_user.pw_uid)
        assert proc.stdout.split() == [uid, uid, "0o644"]

        # Anyone may ask status, wait and state.
        proc = ckptfs_as_user("status", "--json", str(mnt.path))
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["pid"] == mnt.pid
        assert ckptfs_as_user("wait", str(mnt.path)).returncode == 0
        proc = ckptfs_as_user("state", str(jobs / "log.txt"))
        assert proc.returncode == 0 and proc.stdout.strip() == "published", proc.stderr

        # commit and prefetch: the caller's own permission on the path.
        line = one_line_failure(ckptfs_as_user("commit", str(mnt.path / "checkpoint-9")))
        assert "permission denied" in line.lower(), line
        line = one_line_failure(ckptfs_as_user("prefetch", str(private)))
        assert "permission denied" in line.lower(), line
        proc = ckptfs_as_user("prefetch", str(jobs))
        assert proc.returncode == 0, proc.stderr
        # gc and umount: root's.
        for command in ("gc", "umount"):
            line = one_line_failure(ckptfs_as_user(command, str(mnt.path)))
            assert "only root" in line, line
        assert os.path.ismount(mnt.path)
        assert "checkpoint-9" not in os.listdir(mnt.path)       # still staged
        mnt.stop()
        log = (mnt.state_dir / "ckptfs.log").read_text()
        assert "Traceback" not in log and " ERROR " not in log, log
    finally:
        mnt.cleanup()
