"""A bare pyfuse3 passthrough: the floor for any Python FUSE daemon on this machine.

``python -m ckptfs.bench.passthrough SOURCE MOUNTPOINT`` mounts ``SOURCE`` (a local directory)
at ``MOUNTPOINT`` and forwards each request to the local file it names: a ``write`` is
one ``pwrite``, a ``read`` one ``pread``.  No staging, no hashing, no store.  ``ckptfs
bench`` starts it beside ckptfs so that both are measured in the same rounds (issue 13);
it stops on SIGTERM/SIGINT (unmounting).  Only what the bench's workload needs is
implemented (files and directories); it knows nothing of ckptfs.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
from dataclasses import dataclass, field

import pyfuse3
import trio

log = logging.getLogger(__name__)


@dataclass
class _Tables:
    paths: dict[int, str] = field(default_factory=dict)       # inode -> path
    fds: dict[int, int] = field(default_factory=dict)         # fh (= fd) -> fd
    dirs: dict[int, list[tuple[bytes, int]]] = field(default_factory=dict)


class Passthrough(pyfuse3.Operations):
    """Inodes are the source files' own ``st_ino``; the root is ``ROOT_INODE``."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.t = _Tables()
        self.t.paths[pyfuse3.ROOT_INODE] = source
        self._next_dir = 1

    def _path(self, ino: int) -> str:
        try:
            return self.t.paths[ino]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    def _attrs(self, path: str, ino: int | None = None) -> pyfuse3.EntryAttributes:
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        if ino is None:
            ino = st.st_ino
            self.t.paths[ino] = path
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.st_mode = st.st_mode
        a.st_nlink = st.st_nlink
        a.st_uid = st.st_uid
        a.st_gid = st.st_gid
        a.st_size = st.st_size
        a.st_blksize = st.st_blksize
        a.st_blocks = st.st_blocks
        a.st_atime_ns = st.st_atime_ns
        a.st_mtime_ns = st.st_mtime_ns
        a.st_ctime_ns = st.st_ctime_ns
        a.entry_timeout = a.attr_timeout = 1.0
        return a

    def _child(self, parent: int, name: bytes) -> str:
        return os.path.join(self._path(parent), os.fsdecode(name))

    async def lookup(self, parent_inode, name, ctx=None):
        return self._attrs(self._child(parent_inode, name))

    async def getattr(self, inode, ctx=None):
        return self._attrs(self._path(inode), inode)

    async def setattr(self, inode, attr, fields, fh, ctx):
        path = self._path(inode)
        try:
            if fields.update_size:
                if fh is not None and fh in self.t.fds:
                    os.ftruncate(self.t.fds[fh], attr.st_size)
                else:
                    os.truncate(path, attr.st_size)
            if fields.update_mode:
                os.chmod(path, attr.st_mode & 0o7777)
            if fields.update_mtime or fields.update_atime:
                st = os.lstat(path)
                os.utime(path, ns=(attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                                   attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns))
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        return self._attrs(path, inode)

    async def open(self, inode, flags, ctx):
        try:
            fd = os.open(self._path(inode), flags & ~os.O_CREAT)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        self.t.fds[fd] = fd
        return pyfuse3.FileInfo(fh=fd)

    async def create(self, parent_inode, name, mode, flags, ctx):
        path = self._child(parent_inode, name)
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_TRUNC, mode)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        self.t.fds[fd] = fd
        return pyfuse3.FileInfo(fh=fd), self._attrs(path)

    async def read(self, fh, off, size):
        return os.pread(fh, size, off)

    async def write(self, fh, off, buf):
        return os.pwrite(fh, buf, off)

    async def flush(self, fh):
        pass

    async def fsync(self, fh, datasync):
        os.fdatasync(fh) if datasync else os.fsync(fh)

    async def release(self, fh):
        if self.t.fds.pop(fh, None) is not None:
            os.close(fh)

    async def mkdir(self, parent_inode, name, mode, ctx):
        path = self._child(parent_inode, name)
        try:
            os.mkdir(path, mode)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        return self._attrs(path)

    async def unlink(self, parent_inode, name, ctx):
        try:
            os.unlink(self._child(parent_inode, name))
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None

    async def rmdir(self, parent_inode, name, ctx):
        try:
            os.rmdir(self._child(parent_inode, name))
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags,
                     ctx):
        if flags:
            raise pyfuse3.FUSEError(errno.EINVAL)
        old = self._child(parent_inode_old, name_old)
        new = self._child(parent_inode_new, name_new)
        try:
            os.rename(old, new)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        prefix = old + os.sep          # a moved directory moves the paths below it
        for ino, path in list(self.t.paths.items()):
            if path == old:
                self.t.paths[ino] = new
            elif path.startswith(prefix):
                self.t.paths[ino] = new + path[len(old):]

    async def symlink(self, parent_inode, name, target, ctx):
        path = self._child(parent_inode, name)
        try:
            os.symlink(target, path)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        return self._attrs(path)

    async def readlink(self, inode, ctx):
        try:
            return os.fsencode(os.readlink(self._path(inode)))
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None

    async def opendir(self, inode, ctx):
        path = self._path(inode)
        entries = []
        for entry in os.scandir(path):
            self.t.paths[entry.inode()] = entry.path
            entries.append((os.fsencode(entry.name), entry.inode()))
        fh = self._next_dir
        self._next_dir += 1
        self.t.dirs[fh] = entries
        return fh

    async def readdir(self, fh, start_id, token):
        entries = self.t.dirs.get(fh, [])
        for index in range(start_id, len(entries)):
            name, ino = entries[index]
            attrs = self._attrs(self.t.paths[ino], ino)
            if not pyfuse3.readdir_reply(token, name, attrs, index + 1):
                break

    async def releasedir(self, fh):
        self.t.dirs.pop(fh, None)

    async def statfs(self, ctx):
        st = os.statvfs(self._path(pyfuse3.ROOT_INODE))
        out = pyfuse3.StatvfsData()
        for attr in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                     "f_ffree", "f_favail"):
            setattr(out, attr, getattr(st, attr))
        out.f_namemax = 255
        return out


async def _serve() -> None:
    async with trio.open_nursery() as nursery:
        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    pyfuse3.terminate()
                    return
        nursery.start_soon(on_signal)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m ckptfs.bench.passthrough SOURCE MOUNTPOINT", file=sys.stderr)
        return 2
    source, mountpoint = (os.path.abspath(a) for a in argv)
    ops = Passthrough(source)
    options = set(pyfuse3.default_options) | {"fsname=passthrough", "subtype=passthrough"}
    pyfuse3.init(ops, mountpoint, options)
    try:
        trio.run(_serve)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
