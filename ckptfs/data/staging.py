"""Local bytes being written: staging files.

``Staging`` keeps one sparse file per version of an inode under ``staging/``, and moves
versions nobody will publish to ``abandoned/``.  Descriptors of staging files are cached
(least recently used first out) up to ``max_fds``, so a job writing 20 000 files does not
hold 20 000 descriptors.  A cached descriptor is *borrowed*: valid until the caller's
next ``await`` (another request may evict it); what crosses an await or goes to a worker
thread is an ``owned_fd`` (a ``dup`` the caller closes), which eviction never touches.
Running out of descriptors (``EMFILE``/``ENFILE``) gives the idle cached ones back and
tries once more, else it is an ``FsError`` with that errno.  The chunk cache (fetched
bytes) is ``cache.py``.  Knows nothing of FUSE, of the store, or of inodes' meaning.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import FsError
from .spares import SpareFiles

log = logging.getLogger(__name__)

# Descriptors of staging files kept open at most (a daemon sizes it from its
# RLIMIT_NOFILE, ``fd_cap``).
DEFAULT_MAX_FDS = 256
OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)


def fd_cap(nofile_soft: int) -> int:
    """The staging descriptor cap for a process allowed ``nofile_soft`` descriptors: a
    quarter of them (the rest serve the cache, LMDB, FUSE, sockets and worker threads),
    at least 8, at most 1024."""
    return max(8, min(1024, nofile_soft // 4))


class Staging:
    """Sparse staging files, one per *version* of an inode: ``<ino>.<ver>``.

    A write session works on a version of its own, so a closed version is never
    changed again (it uploads, or serves reads, while the next save writes beside it).
    Version 0 is the name older state dirs used (``<ino>``).  One descriptor per version
    is opened on demand and shared by the handles reading or writing it, at most
    ``max_fds`` of them at a time."""

    def __init__(self, root: Path, abandoned: Path, max_fds: int = DEFAULT_MAX_FDS,
                 spares: SpareFiles | None = None) -> None:
        self.root = root
        self.spares = spares
        self.abandoned = abandoned
        self.max_fds = max(1, max_fds)
        root.mkdir(parents=True, exist_ok=True)
        abandoned.mkdir(parents=True, exist_ok=True)
        self._fds: OrderedDict[tuple[int, int], int] = OrderedDict()
        self.evictions = 0
        # Versions on disk per inode: the directory read once (``versions_of``), then
        # kept up to date by this class's own creates and removals (the only ones).
        self._index: dict[int, set[int]] | None = None

    def path(self, ino: int, ver: int) -> Path:
        return self.root / (f"{ino}.{ver}" if ver else str(ino))

    @staticmethod
    def parse_name(name: str) -> tuple[int, int] | None:
        ino, _, ver = name.partition(".")
        try:
            return int(ino), int(ver or 0)
        except ValueError:
            return None

    def versions(self) -> list[tuple[int, int]]:
        """Every (ino, ver) with a staging file on disk."""
        out = []
        for entry in os.scandir(self.root):
            parsed = self.parse_name(entry.name)
            if parsed is not None:
                out.append(parsed)
        return out

    def versions_of(self, ino: int) -> list[int]:
        """The versions of ``ino`` with a staging file, without reading the directory
        again (an unlink that listed it per file cost O(files staged) each: issue 25)."""
        if self._index is None:
            self._index = {}
            for i, v in self.versions():
                self._index.setdefault(i, set()).add(v)
        return sorted(self._index.get(ino, ()))

    def _indexed(self, ino: int, ver: int, present: bool) -> None:
        if self._index is None:
            return
        if present:
            self._index.setdefault(ino, set()).add(ver)
        elif (vers := self._index.get(ino)) is not None:
            vers.discard(ver)
            if not vers:
                del self._index[ino]

    def exists(self, ino: int, ver: int) -> bool:
        return (ino, ver) in self._fds or self.path(ino, ver).exists()

    def shared(self, ino: int, ver: int) -> bool:
        """Whether version ``ver``'s file has another name too (``link_version``,
        ``link_from``): written in place, it would change under that name's readers."""
        try:
            return self.path(ino, ver).stat().st_nlink > 1
        except OSError:
            return False

    def held(self) -> int:
        """Descriptors of staging files open now (owned ones not counted)."""
        return len(self._fds)

    def fd(self, ino: int, ver: int, create: bool = False) -> int:
        """A *borrowed* descriptor of a version: use it before the next ``await``."""
        key = (ino, ver)
        fd = self._fds.get(key)
        if fd is not None:
            self._fds.move_to_end(key)
            return fd
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_TRUNC if create else 0)
        try:
            fd = self._retrying(lambda: os.open(self.path(ino, ver), flags, 0o600),
                                f"open staging file {ino}.{ver}")
        except FileNotFoundError:
            raise FsError(errno.EIO, f"staging file {ino}.{ver} is missing") from None
        if create:
            self._indexed(ino, ver, True)
        while len(self._fds) >= self.max_fds:
            _, old = self._fds.popitem(last=False)
            os.close(old)
            self.evictions += 1
        self._fds[key] = fd
        return fd

    @contextmanager
    def owned_fd(self, ino: int, ver: int) -> Iterator[int]:
        """A descriptor of a version that is the caller's own (a ``dup``), for use across
        an ``await`` or in a worker thread; closed when the block ends."""
        fd = self._retrying(lambda: os.dup(self.fd(ino, ver)),
                            f"dup staging file {ino}.{ver}", keep=(ino, ver))
        try:
            yield fd
        finally:
            os.close(fd)

    def _retrying(self, call: Callable[[], int], what: str,
                  keep: tuple[int, int] | None = None) -> int:
        """``call`` (an open or dup); out of descriptors, give the cached ones back (but
        ``keep``'s) and try once more; still out: ``FsError`` with that errno."""
        try:
            return call()
        except OSError as exc:
            if exc.errno not in OUT_OF_FDS:
                raise
        log.warning("%s: out of descriptors; closing %d cached staging descriptors",
                    what, len(self._fds))
        for key in list(self._fds):
            if key != keep:
                self.close_fd(*key)
        try:
            return call()
        except OSError as exc:
            if exc.errno not in OUT_OF_FDS:
                raise
            raise FsError(exc.errno, f"{what}: {exc.strerror}") from None

    def create_empty(self, ino: int, ver: int) -> int:
        """A new empty version (an old file of that name is replaced): a spare renamed
        into place where one is ready (``spares.py``), else a create."""
        self.close_fd(ino, ver)
        if self.spares is not None and (spare := self.spares.take()) is not None:
            try:
                os.rename(spare, self.path(ino, ver))
            except OSError as exc:    # dropped; a create below says what is wrong
                log.debug("spare %s: %s", spare.name, exc.strerror)
            else:
                self._indexed(ino, ver, True)
                try:
                    fd = self.fd(ino, ver)
                    os.utime(fd)     # its times are its version's, not the spare's
                except BaseException:
                    self.remove(ino, ver)    # as a failed create: nothing left behind
                    raise
                return fd
        return self.fd(ino, ver, create=True)

    def free_bytes(self) -> int:
        """Bytes the staging file system can still give this process (root may use the
        blocks kept for it: a root daemon's writes, and the kernel's passthrough writes
        with its credentials, do)."""
        st = os.statvfs(self.root)
        return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize

    def allocated(self, ino: int, ver: int) -> int:
        """512-byte blocks the staging disk holds for a version (``st_blocks``: less than
        its size for a sparse file)."""
        fd = self._fds.get((ino, ver))
        if fd is not None:
            return os.fstat(fd).st_blocks
        try:
            return os.stat(self.path(ino, ver)).st_blocks
        except FileNotFoundError:
            raise FsError(errno.EIO, f"staging file {ino}.{ver} is missing") from None

    def size(self, ino: int, ver: int) -> int:
        fd = self._fds.get((ino, ver))
        if fd is not None:
            return os.fstat(fd).st_size
        try:
            return os.stat(self.path(ino, ver)).st_size
        except FileNotFoundError:
            raise FsError(errno.EIO, f"staging file {ino}.{ver} is missing") from None

    def copy(self, ino: int, src: int, dst: int) -> None:
        """Copy version ``src`` into a new version ``dst`` (blocking: run in a thread).
        Only its data is copied (``SEEK_DATA``/``SEEK_HOLE``): a sparse file's holes stay
        holes, where ``copy_file_range`` alone wrote them out as zeros."""
        with open(self.path(ino, src), "rb") as fin, open(self.path(ino, dst), "wb") as fout:
            # Indexed once it exists (this runs in a worker thread: an index read from
            # the directory meanwhile has it or gets it here).
            self._indexed(ino, dst, True)
            src_fd, dst_fd = fin.fileno(), fout.fileno()
            size = os.fstat(src_fd).st_size
            for start, end in _data_extents(src_fd, size):
                offset = start
                while offset < end:
                    n = os.copy_file_range(src_fd, dst_fd, min(end - offset, 1 << 30),
                                           offset, offset)
                    if n == 0:
                        break
                    offset += n
            os.ftruncate(dst_fd, size)

    def rename_version(self, ino: int, src: int, dst: int) -> None:
        self.close_fd(ino, src)
        os.replace(self.path(ino, src), self.path(ino, dst))
        self._indexed(ino, src, False)
        self._indexed(ino, dst, True)

    def link_version(self, ino: int, src: int, dst: int) -> None:
        """Name the staging file of version ``src`` as version ``dst`` too (a hard link:
        the same bytes, no copy)."""
        os.link(self.path(ino, src), self.path(ino, dst))
        self._indexed(ino, dst, True)

    def link_from(self, src_ino: int, src_ver: int, ino: int, ver: int) -> None:
        """Name another inode's staging file as version ``ver`` of ``ino`` too (a hard
        link: the same bytes, no copy)."""
        os.link(self.path(src_ino, src_ver), self.path(ino, ver))
        self._indexed(ino, ver, True)

    def has_another_name(self, ino: int, ver: int) -> bool:
        """Whether the staging file's bytes have a name besides this version's (a hard
        link: ``link_from``)."""
        try:
            return self.path(ino, ver).stat().st_nlink > 1
        except FileNotFoundError:
            return False

    def close_fd(self, ino: int, ver: int) -> None:
        fd = self._fds.pop((ino, ver), None)
        if fd is not None:
            os.close(fd)

    def remove(self, ino: int, ver: int) -> None:
        self.close_fd(ino, ver)
        try:
            self.path(ino, ver).unlink()
        except FileNotFoundError:
            pass
        self._indexed(ino, ver, False)

    def abandon(self, ino: int, ver: int) -> Path | None:
        """Move a staging file aside (kept for ``ckptfs gc``) and forget it."""
        self.close_fd(ino, ver)
        src = self.path(ino, ver)
        dst: Path | None = None
        if src.exists():
            dst = self.abandoned / f"{time.time_ns()}-{src.name}"
            os.replace(src, dst)        # a failure leaves it staged, and indexed
            try:
                os.utime(dst)           # gc's grace counts from now, not a time a user set
            except OSError:
                pass
        self._indexed(ino, ver, False)
        return dst

    def close_all(self) -> None:
        """At stop: every cached descriptor closed, the spares not taken removed."""
        for key in list(self._fds):
            self.close_fd(*key)
        if self.spares is not None:
            self.spares.clear()


def sweep_abandoned(directory: Path, cutoff: float, dry_run: bool) -> list[str]:
    """Staged bytes of killed writers older than ``cutoff`` (blocking: run in a thread)."""
    out = []
    for path in sorted(directory.iterdir()):
        if path.stat().st_mtime < cutoff:
            out.append(path.name)
            if not dry_run:
                path.unlink()
    return out


def _data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """(start, end) of each run of data in a file; the whole file where the file system
    cannot say (no ``SEEK_DATA``)."""
    extents = []
    offset = 0
    try:
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:       # only a hole from here to the end
                    break
                raise
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            extents.append((start, end))
            offset = end
    except OSError:
        return [(0, size)] if size else []
    return extents
