"""Promise 1 on one node: the POSIX surface frameworks use, over a real FUSE mount and
both LocalStore and SeaweedFS.  Each test also checks what a fresh mount sees; those that
only ask what one node answers without reading the store run on LocalStore alone."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import stat
from multiprocessing import get_context

import pytest
from support.posix import renameat2
from support.mounts import fresh


def test_create_write_read_and_fresh_mount(mnt, make_mount):
    p = mnt.path / "model.bin"
    data = os.urandom(3 * 1024 * 1024 + 17)
    p.write_bytes(data)
    assert p.read_bytes() == data
    assert p.stat().st_size == len(data)
    other = fresh(make_mount, mnt.store)
    assert (other.path / "model.bin").read_bytes() == data


def test_write_at_offsets_pread_and_sparse(mnt, make_mount):
    p = mnt.path / "sparse"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    os.pwrite(fd, b"tail", 10_000_000)
    os.pwrite(fd, b"head", 0)
    os.pwrite(fd, b"mid", 5_000_000)
    assert os.pread(fd, 4, 10_000_000) == b"tail"
    assert os.pread(fd, 3, 5_000_000) == b"mid"
    assert os.pread(fd, 8, 4) == b"\0" * 8
    os.close(fd)
    expected = bytearray(10_000_004)
    expected[0:4] = b"head"
    expected[5_000_000:5_000_003] = b"mid"
    expected[10_000_000:] = b"tail"
    assert (fresh(make_mount, mnt.store).path / "sparse").read_bytes() == bytes(expected)


def test_o_trunc_o_append_o_direct_accepted(mnt, make_mount):
    p = mnt.path / "f"
    p.write_bytes(b"0123456789")
    with open(p, "ab") as f:
        f.write(b"abc")
    assert p.read_bytes() == b"0123456789abc"
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    os.write(fd, b"new")
    os.close(fd)
    assert p.read_bytes() == b"new"
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    os.close(fd)
    assert (fresh(make_mount, mnt.store).path / "f").read_bytes() == b"new"


def test_ftruncate_grow_and_shrink(mnt, make_mount):
    p = mnt.path / "t"
    with open(p, "wb") as f:
        f.truncate(1 << 20)             # safetensors pre-extends
        f.seek(100)
        f.write(b"x" * 10)
    assert p.stat().st_size == 1 << 20
    with open(p, "r+b") as f:
        f.truncate(105)
    assert p.read_bytes() == b"\0" * 100 + b"xxxxx"
    os.truncate(p, 200)
    assert p.read_bytes() == b"\0" * 100 + b"xxxxx" + b"\0" * 95
    assert (fresh(make_mount, mnt.store).path / "t").read_bytes() == b"\0" * 100 + b"xxxxx" + b"\0" * 95


def test_mmap_read(mnt, make_mount):
    p = mnt.path / "weights"
    data = os.urandom(9 * 1024 * 1024)
    p.write_bytes(data)
    other = fresh(make_mount, mnt.store)
    for path in (p, other.path / "weights"):
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            assert m[:1000] == data[:1000]
            assert m[8 * 1024 * 1024 - 5: 8 * 1024 * 1024 + 5] == \
                data[8 * 1024 * 1024 - 5: 8 * 1024 * 1024 + 5]
            assert m[:] == data


def test_fsync_and_fdatasync_make_durable_but_publish_at_close(mnt, make_mount):
    p = mnt.path / "synced"
    with open(p, "wb") as f:
        f.write(b"durable")
        f.flush()
        os.fsync(f.fileno())
        os.fdatasync(f.fileno())
        # fsync publishes nothing (issue 8 §1c): the name changes at close.
        assert not (fresh(make_mount, mnt.store).path / "synced").exists()
        assert p.read_bytes() == b"durable"   # this node's readers see the writer's bytes
    assert (fresh(make_mount, mnt.store).path / "synced").read_bytes() == b"durable"


def test_rename_file_over_existing(mnt, make_mount):
    (mnt.path / "a").write_bytes(b"A")
    (mnt.path / "b").write_bytes(b"B")
    os.rename(mnt.path / "a", mnt.path / "b")
    assert not (mnt.path / "a").exists()
    assert (mnt.path / "b").read_bytes() == b"A"
    other = fresh(make_mount, mnt.store)
    assert sorted(os.listdir(other.path)) == ["b"]
    assert (other.path / "b").read_bytes() == b"A"


def test_rename_directory_over_empty_directory(mnt, make_mount):
    (mnt.path / "tmp-ckpt" / "sub").mkdir(parents=True)
    (mnt.path / "tmp-ckpt" / "sub" / "w").write_bytes(b"w")
    (mnt.path / "ckpt").mkdir()
    os.rename(mnt.path / "tmp-ckpt", mnt.path / "ckpt")
    assert (mnt.path / "ckpt" / "sub" / "w").read_bytes() == b"w"
    assert not (mnt.path / "tmp-ckpt").exists()
    (mnt.path / "full").mkdir()
    (mnt.path / "full" / "x").write_bytes(b"x")
    with pytest.raises(OSError) as info:
        os.rename(mnt.path / "ckpt", mnt.path / "full")
    assert info.value.errno == errno.ENOTEMPTY
    other = fresh(make_mount, mnt.store)
    assert sorted(os.listdir(other.path)) == ["ckpt", "full"]
    assert (other.path / "ckpt" / "sub" / "w").read_bytes() == b"w"


@pytest.mark.parametrize("store", ["local"], indirect=True)   # one node: no store read
def test_rename_noreplace(mnt):
    (mnt.path / "a").write_bytes(b"A")
    (mnt.path / "b").write_bytes(b"B")
    assert renameat2(mnt.path / "a", mnt.path / "b", 1) == errno.EEXIST
    assert (mnt.path / "b").read_bytes() == b"B"
    assert renameat2(mnt.path / "a", mnt.path / "c", 1) == 0
    assert (mnt.path / "c").read_bytes() == b"A"


def test_rename_open_file_before_close(mnt, make_mount):
    """safetensors: write a temp file, rename it while still open, then close."""
    tmp = mnt.path / "model.safetensors.tmp"
    final = mnt.path / "model.safetensors"
    final.write_bytes(b"old")
    f = open(tmp, "wb")
    f.write(b"new-content")
    f.flush()
    os.rename(tmp, final)
    f.write(b"+more")
    f.close()
    assert final.read_bytes() == b"new-content+more"
    other = fresh(make_mount, mnt.store)
    assert sorted(os.listdir(other.path)) == ["model.safetensors"]
    assert (other.path / "model.safetensors").read_bytes() == b"new-content+more"


def test_unlink_rmdir_rmtree(mnt, make_mount):
    d = mnt.path / "tree"
    for i in range(3):
        (d / f"s{i}").mkdir(parents=True)
        (d / f"s{i}" / "f").write_bytes(b"x" * i)
    os.symlink("s0/f", d / "link")
    with pytest.raises(OSError) as info:
        os.rmdir(d)
    assert info.value.errno == errno.ENOTEMPTY
    os.unlink(d / "s0" / "f")
    os.rmdir(d / "s0")
    shutil.rmtree(d)
    assert not d.exists()
    (mnt.path / "keep").write_bytes(b"k")
    assert os.listdir(fresh(make_mount, mnt.store).path) == ["keep"]


@pytest.mark.parametrize("store", ["local"], indirect=True)   # one node: no store read
def test_unlinked_open_file_stays_readable(mnt):
    p = mnt.path / "gone"
    p.write_bytes(b"still here")
    with open(p, "rb") as f:
        os.unlink(p)
        assert f.read() == b"still here"
    assert not p.exists()


@pytest.mark.parametrize("store", ["local"], indirect=True)   # one node: no store read
def test_stat_stable_inodes_samefile(mnt):
    p = mnt.path / "s"
    p.write_bytes(b"1")
    ino = p.stat().st_ino
    assert os.path.samefile(p, mnt.path / "." / "s")
    os.rename(p, mnt.path / "s2")
    assert (mnt.path / "s2").stat().st_ino == ino
    (mnt.path / "s2").write_bytes(b"22")
    assert (mnt.path / "s2").stat().st_ino == ino


def test_chmod_chown_utime_kept(mnt, make_mount):
    p = mnt.path / "meta"
    p.write_bytes(b"m")
    os.chmod(p, 0o640)
    os.chown(p, 1234, 5678)
    os.utime(p, ns=(1_600_000_000_000_000_000, 1_600_000_000_123_456_789))
    (mnt.path / "d").mkdir(mode=0o700)
    for root in (mnt.path, fresh(make_mount, mnt.store).path):
        st = (root / "meta").stat()
        assert stat.S_IMODE(st.st_mode) == 0o640
        assert (st.st_uid, st.st_gid) == (1234, 5678)
        assert st.st_mtime_ns == 1_600_000_000_123_456_789
        assert stat.S_IMODE((root / "d").stat().st_mode) == 0o700


def test_symlinks(mnt, make_mount):
    (mnt.path / "target").write_bytes(b"t")
    os.symlink("target", mnt.path / "link")
    os.symlink("/nonexistent/abs", mnt.path / "dangling")
    other = fresh(make_mount, mnt.store)
    for root in (mnt.path, other.path):
        assert os.readlink(root / "link") == "target"
        assert (root / "link").read_bytes() == b"t"
        assert os.readlink(root / "dangling") == "/nonexistent/abs"
        assert os.lstat(root / "link").st_size == len("target")


@pytest.mark.parametrize("store", ["local"], indirect=True)   # one node: no store read
def test_foreign_xattr_namespaces_enotsup(mnt):
    """user.* is stored (test_posix_more.py); other namespaces are not."""
    p = mnt.path / "x"
    p.write_bytes(b"x")
    with pytest.raises(OSError) as info:
        os.setxattr(p, "trusted.foo", b"bar")
    assert info.value.errno == errno.ENOTSUP
    assert os.getxattr(p, "user.ckptfs.state") == b"published"
    assert os.listxattr(p) == []


def test_readdir_many_entries(mnt, make_mount):
    d = mnt.path / "many"
    d.mkdir()
    names = {f"file-{i:04d}" for i in range(300)}
    for name in names:
        (d / name).write_bytes(name.encode())
    assert set(os.listdir(d)) == names
    other = fresh(make_mount, mnt.store)
    assert set(os.listdir(other.path / "many")) == names
    assert (other.path / "many" / "file-0123").read_bytes() == b"file-0123"


def test_odd_names_roundtrip(mnt, make_mount):
    names = ["with space", "100%", "ünïcødé", "a\tb", "x" * 255]
    for name in names:
        (mnt.path / name).write_bytes(name.encode())
    raw = b"bad-\xff-utf8"
    with open(os.path.join(os.fsencode(mnt.path), raw), "wb") as f:
        f.write(b"raw")
    with pytest.raises(OSError) as info:
        (mnt.path / ("y" * 256)).write_bytes(b"")
    assert info.value.errno == errno.ENAMETOOLONG
    other = fresh(make_mount, mnt.store)
    assert set(os.listdir(os.fsencode(other.path))) == {os.fsencode(n) for n in names} | {raw}
    for name in names:
        assert (other.path / name).read_bytes() == name.encode()


def _makedirs_worker(root: str, rank: int) -> None:
    path = os.path.join(root, "a", "b", "c", "d")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, f"rank{rank}"), "wb") as f:
        f.write(str(rank).encode())


def test_concurrent_makedirs_from_processes(mnt, make_mount):
    ctx = get_context("spawn")
    procs = [ctx.Process(target=_makedirs_worker, args=(str(mnt.path), r)) for r in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    d = mnt.path / "a" / "b" / "c" / "d"
    assert sorted(os.listdir(d)) == [f"rank{r}" for r in range(6)]
    other = fresh(make_mount, mnt.store)
    assert sorted(os.listdir(other.path / "a" / "b" / "c" / "d")) == [f"rank{r}" for r in range(6)]
    assert os.listdir(other.path / "a") == ["b"]


@pytest.mark.parametrize("store", ["local"], indirect=True)   # one node: no store read
def test_errors_are_errnos(mnt):
    with pytest.raises(FileNotFoundError):
        (mnt.path / "missing").read_bytes()
    (mnt.path / "d").mkdir()
    with pytest.raises(FileExistsError):
        (mnt.path / "d").mkdir()
    with pytest.raises(IsADirectoryError):
        open(mnt.path / "d", "wb")
    (mnt.path / "f").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        (mnt.path / "f" / "x").write_bytes(b"")
    with pytest.raises(OSError) as info:
        os.rename(mnt.path / "d", mnt.path / "d" / "inside")
    assert info.value.errno == errno.EINVAL
    with pytest.raises(FileExistsError):
        os.open(mnt.path / "f", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
