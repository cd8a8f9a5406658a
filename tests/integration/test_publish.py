"""Promise 2, 3 and 5: publish on close only by a writer that meant it; directory
rename as one metadata step; dedup; sync and async durability, crashes included."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.mounts import fresh

MiB = 1 << 20

WRITER = r"""
import os, sys, hashlib
path, total_mib, stop_after_mib, mode, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
flags = os.O_CREAT | os.O_WRONLY | (os.O_TRUNC if mode == "trunc" else 0)
fd = os.open(path, flags, 0o644)
block = hashlib.sha256(seed.encode()).digest() * (1 << 15)   # 1 MiB
for i in range(total_mib):
    os.write(fd, block)
    if i + 1 == stop_after_mib:
        print("half", flush=True)
        sys.stdin.readline()       # wait to be killed (or told to go on)
how = sys.argv[6] if len(sys.argv) > 6 else "close"
if how == "exit0":
    os._exit(0)                    # descriptors still open: the kernel closes them
if how == "exit3":
    os._exit(3)
os.close(fd)
print("done", flush=True)
"""


def start_writer(path: Path, total_mib: int, stop_after_mib: int, mode: str, seed: str,
                 how: str = "close") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(total_mib),
                             str(stop_after_mib), mode, seed, how],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "half"
    return proc


def pattern(seed: str, mib: int) -> bytes:
    import hashlib
    return hashlib.sha256(seed.encode()).digest() * (1 << 15) * mib


def test_sigkilled_writer_of_new_file_publishes_nothing(store, make_mount):
    mnt = make_mount(store)
    writer = start_writer(mnt.path / "model.bin", 256, 128, "new", "v2")
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert os.listdir(fresh(make_mount, store).path) == []
    # The live mount does not show the torn file either.
    assert not (mnt.path / "model.bin").exists()


def test_sigkilled_o_trunc_overwrite_keeps_previous_version(store, make_mount):
    mnt = make_mount(store)
    v1 = pattern("v1", 16)
    (mnt.path / "model.bin").write_bytes(v1)
    writer = start_writer(mnt.path / "model.bin", 256, 128, "trunc", "v2")
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert (fresh(make_mount, store).path / "model.bin").read_bytes() == v1
    assert (mnt.path / "model.bin").read_bytes() == v1


@pytest.mark.parametrize("how,published", [("exit0", True), ("exit3", False), ("sigterm", False)])
def test_exit_status_decides(how, published, local_store, make_mount):
    mnt = make_mount(local_store)
    writer = start_writer(mnt.path / "f", 4, 2, "new", "x", how="exit0" if how == "exit0" else
                          "exit3")
    if how == "sigterm":
        writer.send_signal(signal.SIGTERM)
    else:
        writer.stdin.write("\n")
        writer.stdin.flush()
    writer.wait()
    names = os.listdir(fresh(make_mount, local_store).path)
    assert names == (["f"] if published else [])
    if published:
        assert (mnt.path / "f").read_bytes() == pattern("x", 4)


def test_dedup_same_file_twice_uploads_chunks_once(store, make_mount):
    mnt = make_mount(store)
    data = os.urandom(256 * MiB)
    (mnt.path / "a.bin").write_bytes(data)
    first = mnt.stats()
    assert first["bytes_uploaded"] == len(data)
    (mnt.path / "b.bin").write_bytes(data)
    second = mnt.stats()
    assert second["bytes_uploaded"] == first["bytes_uploaded"]
    assert second["bytes_deduplicated"] - first["bytes_deduplicated"] == len(data)
    store_bytes = mnt.store_stats()["chunk_bytes_put"]
    assert store_bytes == len(data)
    other = fresh(make_mount, store)
    assert (other.path / "b.bin").read_bytes() == data
    del data


def _store_requests(mnt) -> int:
    s = mnt.store_stats()
    return s["puts"] + s["deletes"] + s["gets"]


def test_directory_rename_is_one_metadata_step(store, make_mount):
    mnt = make_mount(store)
    for count, name in ((1, "tmp-small"), (1000, "tmp-big")):
        d = mnt.path / name
        d.mkdir()
        for i in range(count):
            (d / f"shard-{i:05d}").write_bytes(b"%d" % i)
    os.listdir(mnt.path / "tmp-small")
    os.listdir(mnt.path / "tmp-big")
    timings = {}
    costs = {}
    for name in ("tmp-small", "tmp-big"):
        before = _store_requests(mnt)
        t0 = time.perf_counter()
        os.rename(mnt.path / name, mnt.path / name.removeprefix("tmp-"))
        timings[name] = time.perf_counter() - t0
        costs[name] = _store_requests(mnt) - before
    print(f"rename timings: {timings}; store requests: {costs}")
    # GET, claim PUT, PUT, conditional DELETE (decision 0006), whatever the tree's size.
    assert costs["tmp-small"] == costs["tmp-big"] == 4
    other = fresh(make_mount, store)
    big = other.path / "big"
    assert len(os.listdir(big)) == 1000
    assert (big / "shard-00999").read_bytes() == b"999"
    assert sorted(os.listdir(other.path)) == ["big", "small"]


@pytest.mark.expect_log_errors(r"failed after \d+ attempts: injected transient fault")
def test_sync_close_reports_eio_then_background_retry_publishes(s3_store, make_mount, tmp_path):
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"rules": [{"op": "put", "prefix": "chunks/",
                                              "kind": "transient"}]}))
    mnt = make_mount(s3_store, faults={"control_file": str(control)})
    with pytest.raises(OSError) as info:
        with open(mnt.path / "f", "wb") as f:
            f.write(b"precious")
    assert info.value.errno == 5  # EIO
    assert mnt.store_stats()["retries"] > 0
    assert os.listdir(fresh(make_mount, s3_store).path) == []
    assert mnt.status()["fs"]["pending_uploads"] == 1
    control.write_text(json.dumps({"rules": []}))
    from support.mounts import run_ckptfs
    run_ckptfs("wait", str(mnt.path), check=True)
    assert (fresh(make_mount, s3_store).path / "f").read_bytes() == b"precious"


@pytest.mark.expect_log_errors(r"failed after \d+ attempts: injected transient fault")
def test_async_close_returns_before_upload_and_survives_daemon_sigkill(store, make_mount,
                                                                      tmp_path):
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"rules": [{"op": "put", "prefix": "chunks/",
                                              "kind": "transient"}]}))
    mnt = make_mount(store, durability="async", faults={"control_file": str(control)})
    files = {f"shard-{i}.bin": os.urandom(3 * MiB + i) for i in range(4)}
    (mnt.path / "ckpt").mkdir()
    for name, data in files.items():
        (mnt.path / "ckpt" / name).write_bytes(data)   # close returns: staged, not durable
    assert mnt.status()["fs"]["pending_uploads"] == 4
    assert os.listdir(fresh(make_mount, store).path / "ckpt") == []
    mnt.kill()
    # Same node restarts with the same state dir (and a healthy store): it finishes them.
    control.write_text(json.dumps({"rules": []}))
    mnt.start(durability="async")
    from support.mounts import run_ckptfs
    run_ckptfs("wait", str(mnt.path), check=True)
    other = fresh(make_mount, store)
    assert sorted(os.listdir(other.path / "ckpt")) == sorted(files)
    for name, data in files.items():
        assert (other.path / "ckpt" / name).read_bytes() == data


@pytest.mark.expect_log_errors(r"failed after \d+ attempts: injected transient fault")
def test_umount_waits_for_pending_uploads(local_store, make_mount, tmp_path):
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"rules": [{"op": "put", "prefix": "chunks/",
                                              "kind": "transient", "times": 8}]}))
    mnt = make_mount(local_store, durability="async", faults={"control_file": str(control)})
    (mnt.path / "late").write_bytes(b"eventually")
    mnt.stop()
    assert not os.path.ismount(mnt.path)
    assert (fresh(make_mount, local_store).path / "late").read_bytes() == b"eventually"


def test_staging_disk_full_gives_enospc_and_publishes_nothing(local_store, make_mount,
                                                               tmp_path):
    state = tmp_path / "small-state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(state)], check=True)
    try:
        from support.mounts import Mount
        mnt = Mount(tmp_path, local_store, "full")
        mnt.state_dir = state
        mnt.start()
        try:
            (mnt.path / "model.bin").write_bytes(b"v1")
            with pytest.raises(OSError) as info:
                with open(mnt.path / "model.bin", "wb") as f:
                    for _ in range(64):
                        f.write(os.urandom(MiB))
            assert info.value.errno == 28  # ENOSPC
            assert (mnt.path / "model.bin").read_bytes() == b"v1"
            (mnt.path / "after").write_bytes(b"daemon still up")
            other = fresh(make_mount, local_store)
            assert (other.path / "model.bin").read_bytes() == b"v1"
            assert (other.path / "after").read_bytes() == b"daemon still up"
        finally:
            mnt.cleanup()
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


def test_async_publish_after_close_reads_the_right_bytes(store, make_mount):
    """Regression: background uploads used the handle's descriptor, which release()
    closes; uploads failed with EBADF, or read another file through a reused number."""
    mnt = make_mount(store, durability="async")
    files = {f"f{i}": os.urandom(20 * MiB + i) for i in range(4)}
    for name, data in files.items():
        (mnt.path / name).write_bytes(data)
    from support.mounts import run_ckptfs
    run_ckptfs("wait", str(mnt.path), check=True)
    stats = mnt.stats()
    assert stats["publish_failures"] == 0
    other = fresh(make_mount, store)
    for name, data in files.items():
        assert (other.path / name).read_bytes() == data


def test_writeback_cache_option_keeps_the_promises(local_store, make_mount):
    """--writeback-cache (experimental): data round-trips, a killed writer still
    publishes nothing (the kernel writes dirty pages back before the FLUSH)."""
    mnt = make_mount(local_store, extra=("--writeback-cache",))
    data = os.urandom(10 * MiB + 3)
    (mnt.path / "a.bin").write_bytes(data)
    with open(mnt.path / "a.bin", "r+b") as f:
        f.seek(5)
        f.write(b"patch")
    expected = data[:5] + b"patch" + data[10:]
    assert (mnt.path / "a.bin").read_bytes() == expected
    writer = start_writer(mnt.path / "torn.bin", 64, 32, "new", "wb")
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    other = fresh(make_mount, local_store)
    assert os.listdir(other.path) == ["a.bin"]
    assert (other.path / "a.bin").read_bytes() == expected


# The injected faults last ~1.5 s: the store's six jittered tries of a chunk PUT may all
# fail inside that window (then the publish queue retries): an expected ERROR line.
@pytest.mark.expect_log_errors(r"failed after \d+ attempts: injected transient fault")
def test_control_client_that_goes_away_does_not_stop_the_daemon(local_store, make_mount,
                                                                 tmp_path):
    """Regression: a `ckptfs wait` interrupted while the daemon was sending progress
    raised BrokenResourceError in the daemon's nursery and took the mount down."""
    import socket as socketlib
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"rules": [{"op": "put", "prefix": "chunks/",
                                              "kind": "transient"}]}))
    mnt = make_mount(local_store, durability="async", faults={"control_file": str(control)})
    (mnt.path / "pending").write_bytes(b"x")
    path = os.getxattr(mnt.path, "user.ckptfs.node.control").decode()
    for _ in range(3):
        s = socketlib.socket(socketlib.AF_UNIX)
        s.connect(path)
        s.sendall(b'{"cmd": "wait"}\n')
        s.recv(100)                       # first progress line
        s.setsockopt(socketlib.SOL_SOCKET, socketlib.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()                         # gone, with a reset
    time.sleep(1.5)                       # the daemon's next progress send hits the reset
    control.write_text(json.dumps({"rules": []}))
    assert mnt.status()["ok"]
    from support.mounts import run_ckptfs
    run_ckptfs("wait", str(mnt.path), check=True)
    assert (mnt.path / "pending").read_bytes() == b"x"


def _resident_bytes(path) -> int:
    """Bytes of ``path`` in the page cache (util-linux ``fincore``: mincore(2))."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES",
                          str(path)], check=True, capture_output=True, text=True).stdout
    return int(out.split()[0])


def test_published_staging_files_leave_the_page_cache(s3_store, make_mount):
    """Decision 0014: once a file is in the store, its staging pages are dropped (they
    would crowd out the training job's memory; fresh pages cost more than reused ones).
    The bytes stay readable, from the local copy on disk."""
    mnt = make_mount(s3_store)
    data = os.urandom(48 * MiB)
    with open(mnt.path / "model.bin", "wb") as f:
        f.write(data)
        os.fsync(f.fileno())           # clean pages: droppable at once
    staged = [p for p in (mnt.state_dir / "staging").rglob("*") if p.is_file()
              and p.stat().st_size == len(data)]
    assert len(staged) == 1
    assert _resident_bytes(staged[0]) < 8 * MiB
    assert (mnt.path / "model.bin").read_bytes() == data
