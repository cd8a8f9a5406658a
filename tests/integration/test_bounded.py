"""Issue 9: bounded and clear under store faults and bad input.  A store that accepts
connections and never answers, or answers 503 forever, or goes away while uploads are
pending, never hangs a writer, an unmount or a SIGTERM past its bound; every failure
says what happened in one line; the daemon stays up.  Real FUSE mounts, real SeaweedFS
behind a fault-injecting TCP proxy (tests/proxy.py)."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import time

import pytest

from support.mounts import eventually, run_ckptfs
from support.mounts import fresh

MiB = 1 << 20


def daemon_log(mnt) -> str:
    return (mnt.state_dir / "ckptfs.log").read_text(errors="replace")


@pytest.mark.expect_log_errors(r"store timeout: ", r"upload failed")
def test_sync_close_against_a_hanging_store_fails_within_the_timeout(store_proxy, s3_store,
                                                                     make_mount):
    mnt = make_mount(store_proxy, extra=("--store-timeout", "5"))
    data = os.urandom(20 * MiB)
    f = open(mnt.path / "model.bin", "wb")     # the name is looked up while the store answers
    store_proxy.proxy.mode = "hang"
    started = time.monotonic()
    with pytest.raises(OSError) as info:
        with f:
            f.write(data)
    elapsed = time.monotonic() - started
    print(f"sync close of 20 MiB against a hanging store: EIO after {elapsed:.1f} s")
    assert info.value.errno == errno.EIO
    assert elapsed < 60, elapsed               # bounded: 397 s before the deadline
    # One line names the operation and the key that timed out.
    timeouts = [line for line in daemon_log(mnt).splitlines()
                if re.search(r"ERROR ckptfs.store: store timeout: [a-z_]+ [^ ]+ after 5 s", line)]
    assert timeouts, daemon_log(mnt)
    # The daemon stays up; once the store answers again, work goes on.
    assert mnt.status()["ok"]
    store_proxy.proxy.mode = "pass"
    (mnt.path / "after.bin").write_bytes(b"store is back")
    run_ckptfs("wait", str(mnt.path), check=True, timeout=120)
    other = fresh(make_mount, s3_store)
    assert eventually(lambda: (other.path / "model.bin").exists())   # retried in background
    assert (other.path / "model.bin").read_bytes() == data
    assert (other.path / "after.bin").read_bytes() == b"store is back"


@pytest.mark.parametrize("mode", ["503", "slow", "reset"])
@pytest.mark.expect_log_errors(r"store timeout: ", r"upload failed", r"failed after \d+ attempts",
                               r"store error: ")
def test_sync_close_against_a_failing_store_fails_within_the_timeout(store_proxy, s3_store,
                                                                     make_mount, mode):
    """503 forever, a trickle (each socket read succeeds, so only the overall deadline
    bounds the call), resets mid-response: EIO in bounded time, the daemon stays up."""
    store_proxy.proxy.slow_bps = 16 << 10
    mnt = make_mount(store_proxy, extra=("--store-timeout", "5"))
    data = os.urandom(20 * MiB)
    f = open(mnt.path / "model.bin", "wb")
    store_proxy.proxy.mode = mode
    started = time.monotonic()
    with pytest.raises(OSError) as info:
        with f:
            f.write(data)
    elapsed = time.monotonic() - started
    print(f"sync close of 20 MiB against a store in {mode!r} mode: EIO after {elapsed:.1f} s")
    assert info.value.errno == errno.EIO
    assert elapsed < 60, elapsed
    if mode == "503":
        assert re.search(r"(503|ServiceUnavailable) on [^ ]+", daemon_log(mnt))
    store_proxy.proxy.mode = "pass"
    assert mnt.status()["ok"]
    run_ckptfs("wait", str(mnt.path), check=True, timeout=120)
    assert (fresh(make_mount, s3_store).path / "model.bin").read_bytes() == data


@pytest.mark.expect_log_errors(r"mount failed: ", r"store timeout: check after 5 s")
def test_mount_against_a_hanging_store_fails_in_bounded_time(store_proxy, tmp_path):
    store_proxy.proxy.mode = "hang"
    mp = tmp_path / "mnt"
    mp.mkdir()
    started = time.monotonic()
    proc = run_ckptfs("mount", str(mp), "--store", store_proxy.url, "--state-dir",
                      str(tmp_path / "state"), "--store-timeout", "5", env=store_proxy.env,
                      timeout=120)
    elapsed = time.monotonic() - started
    print(f"mount against a hanging store: failed after {elapsed:.1f} s: {proc.stderr.strip()}")
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and ("unreachable" in lines[0] or "timeout" in lines[0]), lines
    assert elapsed < 60
    assert not os.path.ismount(mp)


def wait_gone(pid: int, timeout: float = 90) -> bool:
    def gone() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(")")[-1].split()[0] == "Z"
        except FileNotFoundError:
            return True
    return bool(eventually(gone, timeout))


def stage_while_store_hangs(mnt, proxy, mode: str) -> bytes:
    """Async mount: list the root while the store answers, then break the store and save
    a file (staged locally; its upload cannot finish)."""
    os.listdir(mnt.path)
    proxy.mode = mode
    data = os.urandom(3 * MiB)
    (mnt.path / "saved.bin").write_bytes(data)
    assert mnt.status()["fs"]["pending_uploads"] == 1
    return data


@pytest.mark.parametrize("mode", ["hang", "refuse"])
@pytest.mark.expect_log_errors(r"store timeout: ", r"store closed: ", r"store error: ",
                               r"failed after \d+ attempts")
def test_umount_timeout_unmounts_and_keeps_uploads_journaled(store_proxy, s3_store, make_mount,
                                                            mode):
    mnt = make_mount(store_proxy, durability="async",
                     extra=("--store-timeout", "5", "--metadata-ttl", "3600"))
    pid = mnt.pid
    data = stage_while_store_hangs(mnt, store_proxy.proxy, mode)
    started = time.monotonic()
    proc = run_ckptfs("umount", str(mnt.path), "--timeout", "5", timeout=120)
    elapsed = time.monotonic() - started
    print(f"umount --timeout 5 with the store in {mode!r} mode: {elapsed:.1f} s; "
          f"{proc.stderr.strip()!r}")
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 90
    assert "waiting for 1 pending upload(s) (3.0 MiB)" in proc.stderr
    assert "1 upload(s) not finished stay journaled in" in proc.stderr
    assert "the next mount resumes them" in proc.stderr
    assert not os.path.ismount(mnt.path)
    assert wait_gone(pid)
    # The next mount, with the store back, resumes the upload from the journal.
    store_proxy.proxy.mode = "pass"
    mnt.start(durability="async")
    run_ckptfs("wait", str(mnt.path), check=True, timeout=120)
    assert (fresh(make_mount, s3_store).path / "saved.bin").read_bytes() == data


@pytest.mark.expect_log_errors(r"store timeout: ", r"store closed: ", r"store error: ")
def test_sigterm_waits_at_most_stop_timeout_then_unmounts(store_proxy, s3_store, make_mount):
    mnt = make_mount(store_proxy, durability="async",
                     extra=("--store-timeout", "5", "--metadata-ttl", "3600",
                            "--stop-timeout", "3"))
    pid = mnt.pid
    data = stage_while_store_hangs(mnt, store_proxy.proxy, "hang")
    started = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    assert wait_gone(pid)
    print(f"SIGTERM with stop_timeout 3 and a hanging store: gone after "
          f"{time.monotonic() - started:.1f} s")
    assert not os.path.ismount(mnt.path)
    log = daemon_log(mnt)
    assert "1 upload(s) not finished stay journaled" in log
    store_proxy.proxy.mode = "pass"
    mnt.start(durability="async")
    run_ckptfs("wait", str(mnt.path), check=True, timeout=120)
    assert (fresh(make_mount, s3_store).path / "saved.bin").read_bytes() == data


@pytest.mark.expect_log_errors(r"store timeout: ", r"store closed: ", r"store error: ")
def test_second_sigterm_stops_at_once(store_proxy, s3_store, make_mount):
    mnt = make_mount(store_proxy, durability="async",
                     extra=("--store-timeout", "30", "--metadata-ttl", "3600"))
    pid = mnt.pid
    data = stage_while_store_hangs(mnt, store_proxy.proxy, "hang")
    os.kill(pid, signal.SIGTERM)
    assert eventually(lambda: "waiting at most 600 s" in daemon_log(mnt))
    time.sleep(1)
    assert os.path.ismount(mnt.path)          # the first SIGTERM waits for the upload
    started = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    assert wait_gone(pid)
    print(f"second SIGTERM: gone after {time.monotonic() - started:.1f} s")
    assert not os.path.ismount(mnt.path)
    store_proxy.proxy.mode = "pass"
    mnt.start(durability="async")
    run_ckptfs("wait", str(mnt.path), check=True, timeout=120)
    assert (fresh(make_mount, s3_store).path / "saved.bin").read_bytes() == data


@pytest.mark.expect_log_errors(r"mount failed: state dir .* is in use by another ckptfs daemon")
def test_one_state_dir_one_daemon(local_store, make_mount, tmp_path):
    first = make_mount(local_store, name="first")
    (first.path / "kept").write_bytes(b"first's")
    second = tmp_path / "second-mnt"
    second.mkdir()
    proc = run_ckptfs("mount", str(second), "--store", local_store.url, "--state-dir",
                      str(first.state_dir), timeout=60)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert f"pid {first.pid}" in lines[0] and str(first.path) in lines[0], lines[0]
    assert not os.path.ismount(second)
    # The first daemon is untouched: its control socket is its own.
    assert first.status()["mountpoint"] == str(first.path)
    first.stop()
    assert not os.path.ismount(first.path)


@pytest.mark.expect_log_errors(r"store error: injected fault", r"needs an operator")
def test_a_refused_upload_waits_for_an_operator_and_shows_in_status(local_store, make_mount,
                                                                    tmp_path):
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"rules": []}))
    mnt = make_mount(local_store, durability="async", faults={"control_file": str(control)})
    # (a new name's first publish is a conditional create)
    control.write_text(json.dumps({"rules": [{"op": "put_if_absent", "prefix": "dirs/",
                                              "kind": "permanent"}]}))
    (mnt.path / "refused").write_bytes(b"v1")
    started = time.monotonic()
    proc = run_ckptfs("wait", str(mnt.path), timeout=60)
    print(f"ckptfs wait on a permanently failing upload: exit {proc.returncode} after "
          f"{time.monotonic() - started:.1f} s: {proc.stderr.strip()!r}")
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "needs an operator" in line]
    assert len(lines) == 1 and "injected fault on put_if_absent dirs/root/refused" in lines[0]
    failing = mnt.status()["fs"]["failing_uploads"]
    assert len(failing) == 1 and "needs an operator" in next(iter(failing.values()))
    assert mnt.status()["fs"]["pending_uploads"] == 1     # kept, never dropped
    time.sleep(5)          # retried slowly (every 300 s), said once
    assert daemon_log(mnt).count("background publish of inode") == 1
    # A new close of the file is a new chance; with the store fixed it publishes.
    control.write_text(json.dumps({"rules": []}))
    (mnt.path / "refused").write_bytes(b"v2")
    run_ckptfs("wait", str(mnt.path), check=True, timeout=60)
    assert mnt.status()["fs"]["failing_uploads"] == {}
    assert (fresh(make_mount, local_store).path / "refused").read_bytes() == b"v2"


@pytest.mark.expect_log_errors(r"injected fault", r"needs an operator")
def test_a_refused_metadata_record_makes_wait_answer_at_once(local_store, make_mount,
                                                             tmp_path):
    """A rename the store refuses (a 4xx about the request): ``ckptfs wait`` blocked
    for good and said nothing, where a refused upload answers at once (a hostile run).
    Now it answers non-zero at once, naming the record; the record is kept and lands
    once the store takes it."""
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"rules": []}))
    mnt = make_mount(local_store, durability="async", faults={"control_file": str(control)})
    (mnt.path / "tmp-1").mkdir()
    (mnt.path / "tmp-1" / "model.bin").write_bytes(b"w" * 1000)
    run_ckptfs("wait", str(mnt.path), check=True, timeout=60)
    control.write_text(json.dumps({"rules": [{"op": "put", "prefix": "dirs/",
                                              "kind": "permanent"},
                                             {"op": "put_if_absent", "prefix": "dirs/",
                                              "kind": "permanent"}]}))
    os.rename(mnt.path / "tmp-1", mnt.path / "ckpt-1")
    started = time.monotonic()
    proc = run_ckptfs("wait", str(mnt.path), timeout=60)
    took = time.monotonic() - started
    assert proc.returncode != 0 and took < 20, (proc.returncode, took, proc.stderr)
    assert "needs an operator" in proc.stderr and "ckpt-1" in proc.stderr, proc.stderr
    failing = mnt.status()["fs"]["failing_metadata"]
    assert len(failing) == 1 and "needs an operator" in next(iter(failing.values())), \
        "kept, never dropped, and said so"
    control.write_text(json.dumps({"rules": []}))
    run_ckptfs("wait", str(mnt.path), check=True, timeout=400)
    assert sorted(os.listdir(fresh(make_mount, local_store).path)) == ["ckpt-1"]


@pytest.mark.expect_log_errors(r"failed after \d+ attempts: injected transient fault")
def test_deleted_file_leaves_no_failing_upload(local_store, make_mount, tmp_path):
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"rules": [{"op": "put", "prefix": "chunks/",
                                              "kind": "transient", "delay": 0.5}]}))
    mnt = make_mount(local_store, durability="async", faults={"control_file": str(control)})
    (mnt.path / "doomed").write_bytes(b"x" * 1000)
    assert eventually(lambda: mnt.status()["fs"]["failing_uploads"])
    time.sleep(3)          # the next attempt is in flight (2 s retry delay, ~3 s attempts)
    (mnt.path / "doomed").unlink()
    # The publish that was in flight when the file went fails in its turn.
    assert eventually(lambda: daemon_log(mnt).count("failed after 6 attempts") >= 2, 60)
    time.sleep(0.5)
    fs = mnt.status()["fs"]
    assert fs["failing_uploads"] == {} and fs["pending_uploads"] == 0
    run_ckptfs("wait", str(mnt.path), check=True, timeout=30)


def staged_versions(mnt) -> list[str]:
    """The staging files of versions (not the empty spares made ahead: data/spares.py)."""
    return sorted(name for name in os.listdir(mnt.state_dir / "staging")
                  if not name.startswith(".spare."))


def test_name_too_long_as_a_store_key_is_refused_before_staging(store, make_mount):
    """A 240-byte name of '%' is a valid POSIX name but a 720-byte key component
    (encode_name escapes '%' as '%25'): refused with ENAMETOOLONG up front, on every
    path that creates a name, and nothing is staged."""
    mnt = make_mount(store)
    long_name = "%" * 240
    (mnt.path / "short").write_bytes(b"x")
    staged_before = staged_versions(mnt)
    for attempt in (lambda: open(mnt.path / long_name, "wb"),
                    lambda: os.mkdir(mnt.path / long_name),
                    lambda: os.symlink("target", mnt.path / long_name),
                    lambda: os.rename(mnt.path / "short", mnt.path / long_name)):
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.ENAMETOOLONG
    assert staged_versions(mnt) == staged_before
    assert os.listdir(mnt.state_dir / "abandoned") == []
    assert sorted(os.listdir(mnt.path)) == ["short"]
    # Names that fit once escaped are fine: 85 '%' make 255 bytes.
    (mnt.path / ("%" * 85)).write_bytes(b"fits")
    run_ckptfs("wait", str(mnt.path), check=True, timeout=60)
    assert mnt.status()["fs"]["failing_uploads"] == {}
    other = fresh(make_mount, store)
    assert sorted(os.listdir(other.path)) == sorted(["short", "%" * 85])
    assert (other.path / ("%" * 85)).read_bytes() == b"fits"


@pytest.mark.expect_log_errors(r"injected fault on put", r"needs an operator",
                               r"upload failed", r"incomplete")
def test_commit_above_an_upload_failed_for_good_answers_at_once(local_store, make_mount,
                                                                tmp_path):
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"rules": []}))
    mnt = make_mount(local_store, durability="async", faults={"control_file": str(control)})
    (mnt.path / "checkpoint-7").mkdir()
    entry = local_store.root / "dirs" / "root" / "checkpoint-7"
    eventually(entry.exists)     # async mode: the directory reaches the store in log order
    dir_id = json.loads(entry.read_text())["id"]
    control.write_text(json.dumps({"rules": [{"op": op, "prefix": f"dirs/{dir_id}/",
                                              "kind": "permanent"}
                                             for op in ("put", "put_if_absent")]}))
    (mnt.path / "checkpoint-7" / "model.bin").write_bytes(b"weights")
    assert run_ckptfs("wait", str(mnt.path), timeout=60).returncode != 0   # failed for good
    # The checkpoint is incomplete for good: commit says so instead of waiting forever.
    proc = run_ckptfs("commit", str(mnt.path / "checkpoint-7"), timeout=60)
    assert proc.returncode != 0 and "Input/output error" in proc.stderr, proc.stderr
    assert "checkpoint-7" not in os.listdir(fresh(make_mount, local_store).path)
