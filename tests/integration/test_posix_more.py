"""Promise 1, the rest of POSIX (issue 10): special files, link counts, hard links,
``user.*`` extended attributes, RENAME_EXCHANGE, EFBIG, fallocate — over a real FUSE
mount on LocalStore and SeaweedFS, each checked from a fresh mount (another node) too.
What one node answers without reading the store runs on LocalStore only."""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import stat
import threading

import pytest

from support.mounts import eventually
from support.posix import renameat2
from support.mounts import fresh

RENAME_EXCHANGE = 2


# ---------------------------------------------------------------- special files

def test_special_files_are_entries_seen_by_a_fresh_mount(mnt, make_mount):
    root = mnt.path
    os.mkfifo(root / "fifo", 0o640)
    os.mknod(root / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    os.mknod(root / "loop", 0o660 | stat.S_IFBLK, os.makedev(7, 12))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(root / "rendezvous.sock"))
    sock.listen(1)
    try:
        # The socket works on this node: the kernel connects through the inode.
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(root / "rendezvous.sock"))
        conn, _ = sock.accept()
        client.sendall(b"hello")
        assert conn.recv(5) == b"hello"
        client.close()
        conn.close()
    finally:
        sock.close()
    os.chmod(root / "fifo", 0o604)
    os.rename(root / "loop", root / "loop0")
    assert sorted(os.listdir(root)) == ["fifo", "loop0", "null", "rendezvous.sock"]
    other = fresh(make_mount, mnt.store)
    for base in (root, other.path):
        st = os.lstat(base / "fifo")
        assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o604
        st = os.lstat(base / "null")
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
        assert stat.S_IMODE(st.st_mode) == 0o600
        st = os.lstat(base / "loop0")
        assert stat.S_ISBLK(st.st_mode) and st.st_rdev == os.makedev(7, 12)
        st = os.lstat(base / "rendezvous.sock")
        assert stat.S_ISSOCK(st.st_mode) and st.st_size == 0
    assert sorted(os.listdir(other.path)) == ["fifo", "loop0", "null", "rendezvous.sock"]
    for name in ("fifo", "null", "loop0", "rendezvous.sock"):
        os.unlink(root / name)
    assert os.listdir(root) == []
    assert eventually(lambda: os.listdir(other.path) == [])


@pytest.mark.parametrize("store", ["local"], indirect=True)   # one node: no store read
def test_a_fifo_carries_bytes_between_processes_of_the_node(mnt):
    os.mkfifo(mnt.path / "pipe")
    got = []

    def reader() -> None:
        with open(mnt.path / "pipe", "rb") as f:
            got.append(f.read())

    t = threading.Thread(target=reader)
    t.start()
    with open(mnt.path / "pipe", "wb") as f:
        f.write(b"through the pipe")
    t.join(30)
    assert got == [b"through the pipe"]


@pytest.mark.parametrize("store", ["local"], indirect=True)   # one node: no store read
def test_mknod_checks_the_name_before_the_type(mnt):
    with pytest.raises(OSError) as info:
        os.mknod(mnt.path / ("x" * 256), 0o644 | stat.S_IFIFO)
    assert info.value.errno == errno.ENAMETOOLONG
    os.mknod(mnt.path / "regular", 0o644 | stat.S_IFREG)
    assert stat.S_ISREG(os.lstat(mnt.path / "regular").st_mode)
    assert (mnt.path / "regular").read_bytes() == b""


# ---------------------------------------------------------------- link counts

def test_directory_link_count_is_two_plus_subdirectories(mnt, make_mount):
    d = mnt.path / "d"
    d.mkdir()
    assert os.stat(d).st_nlink == 2
    (d / "a").mkdir()
    (d / "b").mkdir()
    (d / "file").write_bytes(b"f")
    assert os.stat(d).st_nlink == 4
    os.rmdir(d / "a")
    assert os.stat(d).st_nlink == 3
    os.rename(d / "b", mnt.path / "b")
    assert os.stat(d).st_nlink == 2
    assert os.stat(mnt.path).st_nlink == 4   # root: ., .., d and b
    other = fresh(make_mount, mnt.store)
    os.listdir(other.path / "d")
    assert os.stat(other.path / "d").st_nlink == 2
    os.listdir(other.path)
    assert os.stat(other.path).st_nlink == 4


@pytest.mark.parametrize("store", ["local"], indirect=True)   # one node: no store read
def test_an_unlinked_open_file_has_no_links(mnt):
    p = mnt.path / "gone"
    p.write_bytes(b"x")
    with open(p, "rb") as f:
        assert os.fstat(f.fileno()).st_nlink == 1
        os.unlink(p)
        assert os.fstat(f.fileno()).st_nlink == 0
    fd = os.open(mnt.path / "new", os.O_CREAT | os.O_WRONLY, 0o644)
    os.unlink(mnt.path / "new")
    assert os.fstat(fd).st_nlink == 0
    os.close(fd)


# ---------------------------------------------------------------- truncate, fallocate

@pytest.mark.parametrize("store", ["local"], indirect=True)   # one node: no store read
def test_truncate_to_an_impossible_size_is_efbig_without_a_traceback(mnt):
    p = mnt.path / "f"
    p.write_bytes(b"data")
    with pytest.raises(OSError) as info:
        os.truncate(p, 1 << 62)
    assert info.value.errno == errno.EFBIG
    assert p.read_bytes() == b"data"
    log = (mnt.state_dir / "ckptfs.log").read_text()
    assert "Traceback" not in log


@pytest.mark.parametrize("store", ["local"], indirect=True)   # one node: no store read
def test_fallocate(mnt):
    """pyfuse3 3.5 does not expose FUSE_FALLOCATE: libfuse answers ENOSYS and the kernel
    turns that into EOPNOTSUPP for fallocate(2); glibc's posix_fallocate then writes
    zeros itself, which works."""
    p = mnt.path / "pre"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        assert libc.fallocate(fd, 0, 0, 1 << 20) == -1
        assert ctypes.get_errno() == errno.EOPNOTSUPP
        os.posix_fallocate(fd, 0, 1 << 20)
        os.pwrite(fd, b"end", (1 << 20) - 3)
    finally:
        os.close(fd)
    assert p.stat().st_size == 1 << 20
    assert p.read_bytes() == b"\0" * ((1 << 20) - 3) + b"end"


# ---------------------------------------------------------------- xattrs

def test_user_xattrs_round_trip_and_reach_a_fresh_mount(mnt, make_mount):
    p = mnt.path / "f"
    p.write_bytes(b"content")
    d = mnt.path / "d"
    d.mkdir()
    os.setxattr(p, "user.checksum", b"\x00\xffbinary")
    os.setxattr(p, "user.empty", b"")
    os.setxattr(d, "user.tag", b"dir-tag")
    assert os.getxattr(p, "user.checksum") == b"\x00\xffbinary"
    assert sorted(os.listxattr(p)) == ["user.checksum", "user.empty"]
    with pytest.raises(OSError) as info:
        os.setxattr(p, "user.checksum", b"x", os.XATTR_CREATE)
    assert info.value.errno == errno.EEXIST
    with pytest.raises(OSError) as info:
        os.setxattr(p, "user.absent", b"x", os.XATTR_REPLACE)
    assert info.value.errno == errno.ENODATA
    with pytest.raises(OSError) as info:
        os.setxattr(p, "user.ckptfs.state", b"published")
    assert info.value.errno == errno.EPERM
    with pytest.raises(OSError) as info:
        os.setxattr(p, "trusted.thing", b"x")
    assert info.value.errno in (errno.ENOTSUP, errno.EPERM)
    with pytest.raises(OSError) as info:
        os.setxattr(p, "user.huge", b"x" * 65536)
    assert info.value.errno == errno.ENOSPC
    assert os.getxattr(p, "user.ckptfs.state") == b"published"
    # Writing the file again keeps its attributes (they ride with each publish).
    p.write_bytes(b"content 2")
    other = fresh(make_mount, mnt.store)
    q = other.path / "f"
    assert sorted(os.listxattr(q)) == ["user.checksum", "user.empty"]
    assert os.getxattr(q, "user.checksum") == b"\x00\xffbinary"
    assert os.getxattr(q, "user.empty") == b""
    assert os.getxattr(other.path / "d", "user.tag") == b"dir-tag"
    os.removexattr(p, "user.checksum")
    with pytest.raises(OSError) as info:
        os.removexattr(p, "user.checksum")
    assert info.value.errno == errno.ENODATA
    assert os.listxattr(p) == ["user.empty"]
    assert eventually(lambda: os.listxattr(q) == ["user.empty"])
    assert q.read_bytes() == b"content 2"


# ---------------------------------------------------------------- RENAME_EXCHANGE

def test_rename_exchange_swaps_two_entries(mnt, make_mount):
    (mnt.path / "a").write_bytes(b"A")
    (mnt.path / "sub").mkdir()
    (mnt.path / "sub" / "b").write_bytes(b"B")
    ino_a = os.stat(mnt.path / "a").st_ino
    assert renameat2(mnt.path / "a", mnt.path / "sub" / "b", RENAME_EXCHANGE) == 0
    assert (mnt.path / "a").read_bytes() == b"B"
    assert (mnt.path / "sub" / "b").read_bytes() == b"A"
    assert os.stat(mnt.path / "sub" / "b").st_ino == ino_a
    # A directory and a file trade places too.
    (mnt.path / "dir").mkdir()
    (mnt.path / "dir" / "inside").write_bytes(b"in")
    assert renameat2(mnt.path / "dir", mnt.path / "a", RENAME_EXCHANGE) == 0
    assert (mnt.path / "a" / "inside").read_bytes() == b"in"
    assert (mnt.path / "dir").read_bytes() == b"B"
    assert renameat2(mnt.path / "a", mnt.path / "missing", RENAME_EXCHANGE) == errno.ENOENT
    assert renameat2(mnt.path / "a", mnt.path / "a" / "inside", RENAME_EXCHANGE) == \
        errno.EINVAL
    other = fresh(make_mount, mnt.store)
    assert sorted(os.listdir(other.path)) == ["a", "dir", "sub"]
    assert (other.path / "a" / "inside").read_bytes() == b"in"
    assert (other.path / "dir").read_bytes() == b"B"
    assert (other.path / "sub" / "b").read_bytes() == b"A"


# ---------------------------------------------------------------- hard links

def test_hard_links_on_one_node(mnt, make_mount):
    a = mnt.path / "a"
    a.write_bytes(b"first")
    (mnt.path / "d").mkdir()
    b = mnt.path / "d" / "b"
    os.link(a, b)
    sa, sb = os.stat(a), os.stat(b)
    assert sa.st_ino == sb.st_ino and sa.st_nlink == sb.st_nlink == 2
    assert b.read_bytes() == b"first"
    with open(b, "r+b") as f:
        f.write(b"FIRST")
    assert a.read_bytes() == b"FIRST"
    os.chmod(a, 0o600)
    assert stat.S_IMODE(os.stat(b).st_mode) == 0o600
    with pytest.raises(OSError) as info:
        os.link(mnt.path / "d", mnt.path / "dlink")
    assert info.value.errno == errno.EPERM
    with pytest.raises(FileExistsError):
        os.link(a, b)
    other = fresh(make_mount, mnt.store)
    oa, ob = other.path / "a", other.path / "d" / "b"
    assert ob.read_bytes() == b"FIRST" and oa.read_bytes() == b"FIRST"
    assert os.stat(oa).st_ino == os.stat(ob).st_ino
    assert os.stat(oa).st_nlink == 2
    assert stat.S_IMODE(os.stat(ob).st_mode) == 0o600
    os.unlink(a)
    assert os.stat(b).st_nlink == 1
    assert b.read_bytes() == b"FIRST"
    third = fresh(make_mount, mnt.store)
    assert os.listdir(third.path / "d") == ["b"] and not (third.path / "a").exists()
    assert (third.path / "d" / "b").read_bytes() == b"FIRST"
    assert os.stat(third.path / "d" / "b").st_nlink == 1


def test_hard_links_across_nodes(mnt, make_mount):
    other = fresh(make_mount, mnt.store)
    (mnt.path / "x").write_bytes(b"v1")
    os.link(mnt.path / "x", mnt.path / "y")
    ox, oy = other.path / "x", other.path / "y"
    assert eventually(lambda: oy.exists() and os.stat(oy).st_nlink == 2)
    assert os.stat(ox).st_ino == os.stat(oy).st_ino
    assert oy.read_bytes() == b"v1"
    # A write through one name on one node is seen through the other on the other node.
    ox.write_bytes(b"version two")
    assert eventually(lambda: (mnt.path / "y").read_bytes() == b"version two")
    with open(mnt.path / "y", "ab") as f:
        f.write(b"+")
    assert eventually(lambda: ox.read_bytes() == b"version two+")
    os.unlink(oy)
    assert eventually(lambda: not (mnt.path / "y").exists())
    assert eventually(lambda: os.stat(mnt.path / "x").st_nlink == 1)
    assert (mnt.path / "x").read_bytes() == b"version two+"
    assert ox.read_bytes() == b"version two+"


def test_a_killed_writer_of_a_linked_file_publishes_under_no_name(mnt, make_mount):
    import signal
    import subprocess
    import sys
    (mnt.path / "x").write_bytes(b"closed")
    os.link(mnt.path / "x", mnt.path / "y")
    code = ("import os,sys,time\n"
            "f=open(sys.argv[1],'wb'); f.write(b'torn'*1000); f.flush()\n"
            "print('ready', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(mnt.path / "y")],
                            stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for name in ("x", "y"):
        assert (mnt.path / name).read_bytes() == b"closed"
    other = fresh(make_mount, mnt.store)
    for name in ("x", "y"):
        assert (other.path / name).read_bytes() == b"closed"


def test_gc_keeps_the_chunks_of_linked_files_and_reports_orphan_inode_objects(
        local_store, make_mount):
    import time
    from support.mounts import run_ckptfs
    mnt = make_mount(local_store, extra=("--gc-settle", "0.3"))
    data = os.urandom(1 << 20)
    (mnt.path / "x").write_bytes(data)
    os.link(mnt.path / "x", mnt.path / "y")
    os.unlink(mnt.path / "x")           # the content now lives only in the inode object
    (mnt.path / "gone").write_bytes(os.urandom(1 << 20))
    os.unlink(mnt.path / "gone")        # an unreferenced chunk gc does delete
    orphan = local_store.root / "inodes" / ("e" * 32)
    orphan.write_bytes(b'{"v":1,"type":"file","mode":420,"size":0,"chunks":[],"nlink":1}')
    chunks = lambda: {p.name for p in (local_store.root / "chunks").glob("*/*")}  # noqa: E731
    before = chunks()
    for _ in range(3):                  # condemn, then delete (decision 0003)
        proc = run_ckptfs("gc", str(mnt.path), "--grace", "0")
        assert proc.returncode == 0, proc.stderr
        time.sleep(1.2)
    assert len(chunks()) == len(before) - 1
    assert f"inodes/{'e' * 32} has no name linking to it" in proc.stderr
    assert orphan.exists()
    other = make_mount(local_store, name="after-gc")
    assert (other.path / "y").read_bytes() == data
