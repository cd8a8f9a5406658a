"""The Python API for training scripts (issue 12 part 4): ``ckptfs.wait``,
``ckptfs.state`` and ``ckptfs.commit`` reach the daemon of the mount that holds a path,
and the CLI's ``wait``/``state``/``commit`` give the same answers."""

from __future__ import annotations

import json
import os

import pytest

import ckptfs
from support.mounts import eventually, run_ckptfs


@pytest.mark.expect_log_errors(r"injected transient fault")
def test_wait_is_per_path_and_times_out(local_store, make_mount, tmp_path):
    control = tmp_path / "faults.json"
    # Every PUT of the entry of "slow" fails (transiently, so it stays queued and retried).
    control.write_text(json.dumps({"rules": [{"op": op, "prefix": "dirs/root/slow",
                                              "kind": "transient"}
                                             for op in ("put", "put_if_absent")]}))
    mnt = make_mount(local_store, durability="async", faults={"control_file": str(control)})
    (mnt.path / "slow").write_bytes(b"s" * 1000)
    (mnt.path / "fast").write_bytes(b"f" * 1000)

    ckptfs.wait(mnt.path / "fast", timeout=60)       # does not wait for "slow"
    assert ckptfs.state(mnt.path / "fast") == "published"
    assert ckptfs.state(mnt.path / "slow") == "uploading"
    with pytest.raises(TimeoutError):
        ckptfs.wait(mnt.path, timeout=1.5)
    with pytest.raises(TimeoutError):
        ckptfs.wait(mnt.path / "slow", timeout=1.5)
    proc = run_ckptfs("state", str(mnt.path / "slow"))
    assert proc.returncode == 0 and proc.stdout.strip() == "uploading", proc

    control.write_text(json.dumps({"rules": []}))
    ckptfs.wait(mnt.path, timeout=120)
    assert ckptfs.state(mnt.path / "slow") == "published"
    assert run_ckptfs("state", str(mnt.path / "slow")).stdout.strip() == "published"


def test_commit_seals_and_reports(store, make_mount):
    mnt = make_mount(store, durability="async")
    ckpt = mnt.path / "checkpoint-7"
    ckpt.mkdir()
    (ckpt / "model.bin").write_bytes(os.urandom(4096))
    assert "checkpoint-7" not in os.listdir(mnt.path)    # staged: unlisted
    result = ckptfs.commit(ckpt)
    # Async mode: the seal is journaled (decision 0012); it shows once it is in the
    # store, after the upload below it, which ckptfs.wait waits for.
    assert result.sealed and result.journaled and result.pending is None
    ckptfs.wait(ckpt)
    assert "checkpoint-7" in os.listdir(mnt.path)
    assert ckptfs.commit(ckpt).sealed is False           # already visible
    assert ckptfs.state(ckpt / "model.bin") == "published"
    # The CLI uses the same client.
    proc = run_ckptfs("commit", str(ckpt))
    assert proc.returncode == 0 and "already visible" in proc.stdout, proc


def test_errors_are_clear(local_store, make_mount, tmp_path):
    mnt = make_mount(local_store)
    with pytest.raises(ckptfs.NotMounted, match="not a ckptfs mount"):
        ckptfs.state(tmp_path)
    with pytest.raises(FileNotFoundError):
        ckptfs.state(mnt.path / "missing")
    with pytest.raises(NotADirectoryError):
        (mnt.path / "f").write_bytes(b"x")
        ckptfs.commit(mnt.path / "f")
    assert eventually(lambda: ckptfs.state(mnt.path / "f") == "published")
