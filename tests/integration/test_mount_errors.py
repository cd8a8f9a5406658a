"""Promise 8 at the front door: a mount that cannot work fails at once, with exit status
non-zero and one line that says why; nothing is left mounted."""

from __future__ import annotations

import os

import pytest

from ckptfs.seaweed import free_port
from conftest import BUCKET, run_ckptfs

# Each test here makes a mount fail on purpose: the daemon logs why at ERROR.
pytestmark = pytest.mark.expect_log_errors(r"ERROR ckptfs: mount failed: ")


def mount_fails(mountpoint, store_url, *extra, env=None, state_dir=None) -> str:
    state = state_dir or mountpoint.parent / "state"
    proc = run_ckptfs("mount", str(mountpoint), "--store", store_url, "--state-dir", str(state),
                      *extra, env=env, timeout=60)
    assert proc.returncode != 0, proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert not os.path.ismount(mountpoint)
    return lines[0]


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
    port = free_port()  # nothing listens here
    env = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
           "AWS_DEFAULT_REGION": "us-east-1"}
    line = mount_fails(mp, "s3://bucket/p", "--endpoint-url", f"http://127.0.0.1:{port}", env=env)
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
