"""Promise 6 on the node's own copy: a chunk that rots in the node cache (one byte flipped
in its cache file) is never served nor copied into a new version; the node logs one
WARNING naming it, drops the cache file and fetches the chunk again from the store."""

from __future__ import annotations

import mmap
import os

from ckptfs.format.chunkid import chunk_id, chunk_ok, digest_hex
from support.mounts import eventually

KiB = 1 << 10
CHUNK = 64 * KiB
CHUNK_FLAG = ("--chunk-size", "64K")
ROTTEN = 2          # the index of the chunk whose cache file rots


def _chunks(data: bytes) -> list[str]:
    return [chunk_id(data[i:i + CHUNK]) for i in range(0, len(data), CHUNK)]


def _publish_and_cache(store, make_mount) -> tuple[bytes, list[str], object]:
    """A file of 5+ chunks written on node a, read through once on node b (so b's cache
    holds every chunk): (its bytes, its chunk hashes, node b)."""
    a = make_mount(store, name="a", extra=CHUNK_FLAG)
    data = os.urandom(5 * CHUNK + 1000)
    (a.path / "w.bin").write_bytes(data)
    b = make_mount(store, name="b", extra=CHUNK_FLAG)
    assert eventually(lambda: (b.path / "w.bin").exists())
    assert (b.path / "w.bin").read_bytes() == data
    return data, _chunks(data), b


def _cache_file(node, sha: str):
    return node.state_dir / "cache" / digest_hex(sha)[:2] / sha


def _rot(node, sha: str, at: int = 100) -> None:
    """Flip one byte of the chunk's cache file in place (what disk rot does)."""
    path = _cache_file(node, sha)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def _drop_page_cache(path) -> None:
    """Drop the kernel's cached pages of one file of the mount, so the next read asks the
    daemon again."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _warnings_naming(node, sha: str) -> list[str]:
    text = (node.state_dir / "ckptfs.log").read_text(errors="replace")
    return [line for line in text.splitlines() if " WARNING " in line and sha in line]


def _read_mmap(path) -> bytes:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        return bytes(m)


def test_rotten_cache_chunk_is_refetched_by_the_running_daemon(store, make_mount):
    data, shas, b = _publish_and_cache(store, make_mount)
    _rot(b, shas[ROTTEN])
    _drop_page_cache(b.path / "w.bin")
    assert (b.path / "w.bin").read_bytes() == data
    assert len(_warnings_naming(b, shas[ROTTEN])) == 1
    # The bad cache file was replaced by the good chunk.
    assert chunk_ok(_cache_file(b, shas[ROTTEN]).read_bytes(), shas[ROTTEN])
    assert b.stats()["rotten_cache_chunks"] == 1


def test_rotten_cache_chunk_is_caught_after_a_remount(store, make_mount):
    data, shas, b = _publish_and_cache(store, make_mount)
    # Read again from the daemon, so this daemon has read the file back once too.
    _drop_page_cache(b.path / "w.bin")
    assert (b.path / "w.bin").read_bytes() == data
    _rot(b, shas[ROTTEN])
    b.stop()
    b.start(*CHUNK_FLAG)
    assert _read_mmap(b.path / "w.bin") == data
    _drop_page_cache(b.path / "w.bin")
    assert (b.path / "w.bin").read_bytes() == data
    assert len(_warnings_naming(b, shas[ROTTEN])) == 1
    # Only the rotten chunk was fetched again.
    assert b.store_stats()["chunk_bytes_got"] == CHUNK


def test_an_edit_after_rot_publishes_the_original_bytes(store, make_mount):
    data, shas, b = _publish_and_cache(store, make_mount)
    # Read back once by this daemon (so it trusts the cache files for reads), then rot:
    # a copy into a new version checks its bytes every time all the same.
    _drop_page_cache(b.path / "w.bin")
    assert (b.path / "w.bin").read_bytes() == data
    _rot(b, shas[ROTTEN])
    with open(b.path / "w.bin", "r+b") as f:
        f.seek(10)
        f.write(b"EDIT")
    expected = data[:10] + b"EDIT" + data[14:]
    fresh = make_mount(store, name="fresh", extra=CHUNK_FLAG)
    assert eventually(lambda: (fresh.path / "w.bin").exists())
    got = (fresh.path / "w.bin").read_bytes()
    assert len(got) == len(data)
    assert [i for i in range(len(data)) if got[i] != data[i]] == \
        [i for i in range(10, 14) if data[i] != expected[i]]
    assert got == expected
    assert len(_warnings_naming(b, shas[ROTTEN])) == 1
