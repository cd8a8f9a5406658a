"""The kernel page cache of a file is kept past its last close (decision 0014) only
while the version it holds is the one a new reader opens: a reader must never see stale
bytes after another node publishes a new version of the same size, after a rename over
the file on either node, or after a local truncate and rewrite."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support.mounts import eventually, run_ckptfs

SIZE = 256 << 10


def _warm(path) -> bytes:
    """Read twice (the second open keeps the page cache) and return the content."""
    first = path.read_bytes()
    assert path.read_bytes() == first
    return first


def test_a_same_size_version_from_another_node_is_seen(local_store, make_mount):
    a = make_mount(local_store, name="a")
    b = make_mount(local_store, name="b")
    v1, v2 = os.urandom(SIZE), os.urandom(SIZE)
    (a.path / "model.bin").write_bytes(v1)
    assert eventually(lambda: (b.path / "model.bin").exists())
    assert _warm(b.path / "model.bin") == v1
    (a.path / "model.bin").write_bytes(v2)
    assert eventually(lambda: (b.path / "model.bin").read_bytes() == v2)
    assert _warm(b.path / "model.bin") == v2


def test_a_rename_over_the_file_on_either_node_is_seen(local_store, make_mount):
    a = make_mount(local_store, name="a")
    b = make_mount(local_store, name="b")
    v1, v2, v3 = (os.urandom(SIZE) for _ in range(3))
    (a.path / "model.bin").write_bytes(v1)
    assert eventually(lambda: (b.path / "model.bin").exists())
    assert _warm(b.path / "model.bin") == v1
    (a.path / "next.bin").write_bytes(v2)
    os.rename(a.path / "next.bin", a.path / "model.bin")
    assert eventually(lambda: (b.path / "model.bin").read_bytes() == v2)
    assert _warm(b.path / "model.bin") == v2
    (b.path / "other.bin").write_bytes(v3)
    os.rename(b.path / "other.bin", b.path / "model.bin")
    assert _warm(b.path / "model.bin") == v3
    assert eventually(lambda: (a.path / "model.bin").read_bytes() == v3)


def test_a_local_truncate_and_rewrite_is_seen(local_store, make_mount):
    b = make_mount(local_store, name="b")
    v1, v2 = os.urandom(SIZE), os.urandom(SIZE)
    path = b.path / "model.bin"
    path.write_bytes(v1)
    assert _warm(path) == v1
    os.truncate(path, 0)
    os.truncate(path, SIZE)
    assert _warm(path) == bytes(SIZE)
    with open(path, "r+b") as f:
        f.write(v2)
    assert _warm(path) == v2


def test_dropped_staging_pages_of_a_rewritten_chunk_lose_nothing(local_store, make_mount):
    """Staging pages are dropped after each pipelined chunk upload and after publish
    (posix_fadvise DONTNEED): bytes written into a chunk after its upload, and not yet
    written back, must still be what the file holds, here and on another node."""
    a = make_mount(local_store, name="a")
    chunk = 8 << 20
    data = bytearray(os.urandom(3 * chunk + 1234))
    with open(a.path / "model.bin", "wb") as f:
        f.write(data[:2 * chunk])
        assert eventually(lambda: a.store_stats()["chunk_bytes_put"] >= chunk)
        f.write(data[2 * chunk:])
        patch = os.urandom(8192)
        f.seek(chunk - 4096)
        f.write(patch)
        data[chunk - 4096:chunk + 4096] = patch
    assert (a.path / "model.bin").read_bytes() == data
    fresh = make_mount(local_store, name="fresh")
    assert eventually(lambda: (fresh.path / "model.bin").exists())
    assert (fresh.path / "model.bin").read_bytes() == data
    assert (a.path / "model.bin").read_bytes() == data


@pytest.mark.parametrize("durability,passthrough", [("sync", "auto"), ("async", "off")],
                         ids=["sync", "async, daemon path"])
def test_a_reader_opened_during_a_save_keeps_it_past_the_next_save(
        durability, passthrough, local_store, make_mount):
    """On the daemon's path a reader that opened while the save was written read it
    live -- and after its close, the next save too (a hostile run: 650 003 bytes
    became 700 001 on the same descriptor)."""
    a = make_mount(local_store, name="a", durability=durability,
                   extra=("--passthrough", passthrough, "--metadata-ttl", "0.2"))
    b = make_mount(local_store, name="b", durability=durability,
                   extra=("--passthrough", passthrough, "--metadata-ttl", "0.2"))
    first, second = os.urandom(650_003), os.urandom(700_001)
    with open(a.path / "f", "wb") as writer:
        writer.write(first)
        writer.flush()
        reader = os.open(a.path / "f", os.O_RDONLY)
    try:
        assert os.pread(reader, 1 << 20, 0) == first
        if durability == "async":
            run_ckptfs("wait", str(a.path), check=True, timeout=60)
        assert eventually(lambda: (b.path / "f").exists())
        (b.path / "f").write_bytes(second)
        if durability == "async":
            run_ckptfs("wait", str(b.path), check=True, timeout=60)
        assert eventually(lambda: (a.path / "f").read_bytes() == second)
        assert os.pread(reader, 1 << 20, 0) == first, "the reader keeps its version"
    finally:
        os.close(reader)


# A hostile run (stop 45): a reader on B holding a 1 MB version read 40 bytes of it once
# B took in A's 40-byte save -- by a listing, or by a chmod on B whose compare-and-swap
# found the new version: the kernel keeps one size per inode, and the inode's size was
# the new version's.  Now the name moves to a fresh inode for the new version; the old
# one stays the reader's.
@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("how", ["listing", "chmod"])
def test_a_reader_keeps_its_whole_version_when_a_smaller_one_comes_in(
        local_store, make_mount, durability, how):
    a = make_mount(local_store, name="a", durability=durability)
    b = make_mount(local_store, name="b", durability=durability)
    v1, v2 = os.urandom(1_000_000), os.urandom(40)
    (a.path / "f").write_bytes(v1)
    run_ckptfs("wait", str(a.path), check=True)
    assert eventually(lambda: (b.path / "f").exists() and
                      os.stat(b.path / "f").st_size == len(v1))
    fd = os.open(b.path / "f", os.O_RDONLY)
    try:
        assert os.pread(fd, 10, 0) == v1[:10]
        (a.path / "f").write_bytes(v2)
        run_ckptfs("wait", str(a.path), check=True)
        if how == "listing":
            assert eventually(lambda: os.stat(b.path / "f").st_size == len(v2))
        else:
            assert eventually(lambda: os.chmod(b.path / "f", 0o600) is None and
                              os.stat(b.path / "f").st_size == len(v2))
        data = bytearray()
        while chunk := os.pread(fd, 1 << 20, len(data)):
            data += chunk
        assert bytes(data) == v1, f"the reader read {len(data)} of its {len(v1)} bytes"
    finally:
        os.close(fd)
    assert (b.path / "f").read_bytes() == v2


# The same on the reader's own node (soak seed 1215616, both stores, sync: "a reader held
# open on A read f0 as f0 truncated to 0"): a save over the file in place, or a
# truncate, set the size of the reader's inode -- a reader of 70 000 bytes read 100 of
# them after a 100-byte save.  Now this node's own new version moves the name to a
# fresh inode too (the writer's open answers ESTALE, the kernel opens by name again).
@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("how", ["save", "truncate"])
def test_a_reader_keeps_its_whole_version_when_its_own_node_saves_over_it(
        local_store, make_mount, durability, how):
    a = make_mount(local_store, name="a", durability=durability)
    v1, v2 = os.urandom(1_000_000), os.urandom(100)
    (a.path / "f").write_bytes(v1)
    fd = os.open(a.path / "f", os.O_RDONLY)
    try:
        assert os.pread(fd, 10, 0) == v1[:10]
        if how == "save":
            (a.path / "f").write_bytes(v2)
        else:
            os.truncate(a.path / "f", 100)
        data = bytearray()
        while chunk := os.pread(fd, 1 << 20, len(data)):
            data += chunk
        assert bytes(data) == v1, f"the reader read {len(data)} of its {len(v1)} bytes"
        assert os.fstat(fd).st_size == len(v1)
    finally:
        os.close(fd)
    assert (a.path / "f").read_bytes() == (v2 if how == "save" else v1[:100])
    if durability == "async":
        run_ckptfs("wait", str(a.path), check=True)
    b = make_mount(local_store, name="b", durability=durability)
    assert (b.path / "f").read_bytes() == (v2 if how == "save" else v1[:100])


# After that move, ``fchmod`` and ``fsetxattr`` through the reader's descriptor reach
# the kernel for the reader's inode, and it never retries them: ESTALE reached the
# program, and an extended attribute stayed on the nameless inode.  They are the file's,
# as on a disk (decision 0031, addendum of stop 49).
@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_change_through_a_readers_descriptor_after_its_own_node_saved_over_the_file(
        local_store, make_mount, durability):
    a = make_mount(local_store, name="a", durability=durability)
    v1, v2 = os.urandom(100_000), os.urandom(100)
    (a.path / "f").write_bytes(v1)
    fd = os.open(a.path / "f", os.O_RDONLY)
    try:
        assert os.pread(fd, 10, 0) == v1[:10]
        (a.path / "f").write_bytes(v2)
        os.fchmod(fd, 0o600)
        os.setxattr(fd, "user.step", b"7")
        assert os.fstat(fd).st_mode & 0o7777 == 0o600
        assert os.pread(fd, len(v1) + 1, 0) == v1
    finally:
        os.close(fd)
    assert os.stat(a.path / "f").st_mode & 0o7777 == 0o600
    assert os.getxattr(a.path / "f", "user.step") == b"7"
    if durability == "async":
        run_ckptfs("wait", str(a.path), check=True)
    b = make_mount(local_store, name="b", durability=durability)
    assert (b.path / "f").read_bytes() == v2
    assert os.stat(b.path / "f").st_mode & 0o7777 == 0o600
    assert os.getxattr(b.path / "f", "user.step") == b"7"


# A mapping (``torch.load(mmap=True)``, numpy's memmap) is a reader too: a save over the
# file in place on its node cut the mapped file, and touching a page past the new size
# killed the process with SIGBUS (as on a local disk).  The mapping keeps its version
# now.  In a child process: the SIGBUS of the code before must not kill the test run.
MAPPED = """
import mmap, os, sys
p = sys.argv[1]
fd = os.open(p, os.O_RDONLY)
m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
os.close(fd)
first = m[:]
with open(p, "wb") as f:
    f.write(b"b" * 100)
assert os.stat(p).st_size == 100
assert m[:] == first, "the mapping changed"
print("kept", len(first))
"""


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_mapping_keeps_its_version_when_its_own_node_saves_over_it(
        local_store, make_mount, durability):
    a = make_mount(local_store, name="a", durability=durability)
    (a.path / "f").write_bytes(b"a" * 1_000_000)
    if durability == "async":
        run_ckptfs("wait", str(a.path), check=True)
    done = subprocess.run([sys.executable, "-c", MAPPED, str(a.path / "f")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "kept 1000000", \
        (done.returncode, done.stdout, done.stderr[-500:])
    assert (a.path / "f").read_bytes() == b"b" * 100
