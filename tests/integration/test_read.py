"""Promise 6 and 7: remote files are listed without fetching data, fetched once per node
however many readers, verified before use, and what one mount publishes another sees
within the metadata TTL."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from support.mounts import eventually, run_ckptfs

MiB = 1 << 20



def chunk_bytes_got(mnt) -> int:
    return mnt.store_stats()["chunk_bytes_got"]


def test_listing_and_stat_fetch_no_data(store, make_mount):
    a = make_mount(store, name="a")
    data = os.urandom(20 * MiB)
    (a.path / "ckpt").mkdir()
    (a.path / "ckpt" / "w.bin").write_bytes(data)
    os.chmod(a.path / "ckpt" / "w.bin", 0o640)
    os.utime(a.path / "ckpt" / "w.bin", ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_001))
    b = make_mount(store, name="b")
    st = (b.path / "ckpt" / "w.bin").stat()
    assert os.listdir(b.path / "ckpt") == ["w.bin"]
    assert (st.st_size, st.st_mode & 0o777, st.st_mtime_ns) == (len(data), 0o640,
                                                                1_700_000_000_000_000_001)
    assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())
    assert chunk_bytes_got(b) == 0
    assert os.getxattr(b.path / "ckpt" / "w.bin", "user.ckptfs.state") == b"remote"
    assert (b.path / "ckpt" / "w.bin").read_bytes() == data
    assert chunk_bytes_got(b) == len(data)
    assert os.getxattr(b.path / "ckpt" / "w.bin", "user.ckptfs.state") == b"cached"


def test_two_live_mounts_see_each_other_within_ttl(store, make_mount):
    a = make_mount(store, name="a")
    b = make_mount(store, name="b")
    assert os.listdir(b.path) == []
    (a.path / "step-1").mkdir()
    (a.path / "step-1" / "model.bin").write_bytes(b"v1")
    assert eventually(lambda: os.path.exists(b.path / "step-1" / "model.bin"))
    assert (b.path / "step-1" / "model.bin").read_bytes() == b"v1"
    # Overwrite on A: B sees the new version (its kernel cache is invalidated).
    (a.path / "step-1" / "model.bin").write_bytes(b"version-2")
    assert eventually(lambda: (b.path / "step-1" / "model.bin").read_bytes()
                      == b"version-2")
    # Rotation on A (rmtree of an old checkpoint) disappears on B; negative lookups expire.
    (a.path / "step-2").mkdir()
    import shutil
    shutil.rmtree(a.path / "step-1")
    assert eventually(lambda: sorted(os.listdir(b.path)) == ["step-2"])
    # The kernel may keep B's last lookup of step-1 for one metadata TTL after the
    # listing drops it (entry_timeout): within the TTL, as the name says.
    assert eventually(lambda: not (b.path / "step-1").exists())


READER = r"""
import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    while True:
        block = f.read(1 << 20)
        if not block:
            break
        h.update(block)
print(h.hexdigest())
"""


def test_eight_concurrent_readers_fetch_each_byte_once(store, make_mount):
    a = make_mount(store, name="a")
    data = os.urandom(256 * MiB)
    digest = hashlib.sha256(data).hexdigest()
    (a.path / "model.bin").write_bytes(data)
    del data
    b = make_mount(store, name="b")
    target = b.path / "model.bin"
    assert target.stat().st_size == 256 * MiB
    procs = [subprocess.Popen([sys.executable, "-c", READER, str(target)],
                              stdout=subprocess.PIPE, text=True) for _ in range(8)]
    digests = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert digests == [digest] * 8
    assert chunk_bytes_got(b) == 256 * MiB


@pytest.mark.expect_log_errors(r"from the store failed verification")
def test_corrupt_chunk_in_local_store_gives_eio_never_wrong_bytes(local_store, make_mount):
    a = make_mount(local_store, name="a")
    (a.path / "w.bin").write_bytes(os.urandom(3 * MiB))
    chunk = next((local_store.root / "chunks").glob("*/*"))
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    b = make_mount(local_store, name="b")
    with pytest.raises(OSError) as info:
        (b.path / "w.bin").read_bytes()
    assert info.value.errno == 5
    assert b.stats()["corrupt_chunks"] >= 1
    (b.path / "still-up").write_bytes(b"ok")   # the daemon stays up


@pytest.mark.expect_log_errors(r"from the store failed verification \(attempt 1/3\)")
def test_corrupt_response_is_refetched(s3_store, make_mount):
    a = make_mount(s3_store, name="a")
    data = os.urandom(10 * MiB)
    (a.path / "w.bin").write_bytes(data)
    faults = {"rules": [{"op": "get", "prefix": "chunks/", "kind": "corrupt", "times": 1}]}
    b = make_mount(s3_store, name="b", faults=faults)
    assert (b.path / "w.bin").read_bytes() == data
    assert b.stats()["corrupt_chunks"] == 1


def test_cache_smaller_than_file(store, make_mount):
    a = make_mount(store, name="a")
    data = os.urandom(64 * MiB)
    (a.path / "big.bin").write_bytes(data)
    b = make_mount(store, name="b", extra=("--cache-size", "16M"))
    with open(b.path / "big.bin", "rb") as f:
        got = b"".join(iter(lambda: f.read(MiB), b""))
    assert got == data
    assert b.stats()["cache_bytes"] <= 16 * MiB + 8 * MiB   # one chunk may be pinned in use


def test_local_copies_count_against_the_cache(local_store, make_mount):
    a = make_mount(local_store, name="a", extra=("--cache-size", "16M"))
    files = {f"f{i}": os.urandom(8 * MiB) for i in range(4)}
    for name, data in files.items():
        (a.path / name).write_bytes(data)
    assert a.stats()["cache_bytes"] <= 16 * MiB
    for name, data in files.items():
        assert (a.path / name).read_bytes() == data


def test_prefetch_warms_a_tree_and_reports_failures(local_store, make_mount):
    a = make_mount(local_store, name="a")
    (a.path / "ckpt" / "sub").mkdir(parents=True)
    files = {"ckpt/a.bin": os.urandom(9 * MiB), "ckpt/sub/b.bin": os.urandom(3 * MiB)}
    for name, data in files.items():
        (a.path / name).write_bytes(data)
    b = make_mount(local_store, name="b")
    proc = run_ckptfs("prefetch", str(b.path / "ckpt"))
    assert proc.returncode == 0, proc.stderr
    assert "prefetched 2 file(s)" in proc.stdout
    fetched = chunk_bytes_got(b)
    assert fetched == 12 * MiB
    for name, data in files.items():
        assert (b.path / name).read_bytes() == data
    assert chunk_bytes_got(b) == fetched
    # A chunk missing from the store: prefetch says so and exits non-zero.
    (a.path / "ckpt" / "c.bin").write_bytes(os.urandom(2 * MiB + 5))
    c_chunk = [p for p in (local_store.root / "chunks").glob("*/*")
               if p.stat().st_size == 2 * MiB + 5][0]
    c_chunk.unlink()
    c = make_mount(local_store, name="c")
    proc = run_ckptfs("prefetch", str(c.path / "ckpt"))
    assert proc.returncode != 0
    assert "c.bin" in proc.stderr


@pytest.mark.expect_log_errors(r"ignoring bad name ", r"corrupt entry dirs/")
def test_hostile_store_entries_give_eio_and_daemon_stays_up(local_store, make_mount):
    a = make_mount(local_store, name="a")
    (a.path / "good").write_bytes(b"fine")
    entries = local_store.root / "dirs" / "root"
    (entries / "bad-json").write_bytes(b"{not json")
    (entries / "bad-size").write_text(json.dumps(
        {"v": 1, "type": "file", "mode": 420, "size": 5, "chunks": [["a" * 64, 3]]}))
    (entries / "evil-id").write_text(json.dumps({"v": 1, "type": "dir", "mode": 493,
                                                 "id": "../../etc"}))
    (entries / "%2E%2E").write_text(json.dumps({"v": 1, "type": "file", "mode": 420,
                                                "size": 0, "chunks": []}))
    b = make_mount(local_store, name="b")
    assert os.listdir(b.path) == ["good"]
    for name in ("bad-json", "bad-size", "evil-id"):
        with pytest.raises(OSError) as info:
            os.stat(b.path / name)
        assert info.value.errno == 5, name
    assert (b.path / "good").read_bytes() == b"fine"
    (b.path / "after").write_bytes(b"still up")
    assert (b.path / "after").read_bytes() == b"still up"
