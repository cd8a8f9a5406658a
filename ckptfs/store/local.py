"""``LocalStore``: a directory standing in for a bucket (the embedded default).

Knows nothing above the store protocol.
"""

from __future__ import annotations

import errno
import fcntl
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .base import (AccessDenied, BucketMissing, ListedObject, NotFound, PreconditionFailed,
                   StoreError, TransientStoreError)


class LocalStore:
    """A directory used as an object store.  Writes are atomic (temp file + rename);
    ``put_if_absent`` uses ``link(2)``, which fails if the target exists.  Conditional
    writes and deletes (``if_match``) compare and swap under an exclusive ``flock`` on
    ``.ckptfs-lock`` in the root, which every daemon on the machine takes for entry
    writes (chunk bodies are immutable and skip it).  Temp files live in ``.ckptfs-tmp/``
    at the root (same filesystem, so rename and link stay atomic); no key maps there or
    to the lock file, so every legal entry name is a possible key and listings never
    show the store's own files."""

    LOCK_NAME = ".ckptfs-lock"
    TMP_DIR = ".ckptfs-tmp"
    _RESERVED = (LOCK_NAME, TMP_DIR)

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file://{root}"

    @contextmanager
    def _locked(self, key: str):
        if key.startswith("chunks/"):
            yield
            return
        fd = os.open(self.root / self.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _etag_now(self, path: Path) -> str | None:
        try:
            return _local_etag(path)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if key.startswith("/") or ".." in parts or parts[0] in self._RESERVED:
            raise StoreError(f"invalid key {key!r}")
        return self.root / key

    def check(self) -> None:
        if not self.root.is_dir():
            raise BucketMissing(f"store directory {self.root} does not exist")
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StoreError(f"store directory {self.root} is not writable")

    def _write_temp(self, path: Path, data: bytes) -> Path:
        """``data`` in a new temp file, on disk.  A full or failing store directory is
        a store error like any store's (an outage: retried, named in status), and
        leaves no temp file behind."""
        tmp = self.root / self.TMP_DIR / uuid.uuid4().hex
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            _discard(tmp)
            raise self._write_error(exc) from None
        return tmp

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Around a write's steps after its temp file (linking, replacing, deleting,
        the lock file): an ``OSError`` is a store error like ``_write_temp``'s -- a
        store directory remounted read-only failed every ``mkdir`` with a raw EROFS,
        unclassified, unretried and not shown in status (hostile run E)."""
        try:
            yield
        except OSError as exc:
            raise self._write_error(exc) from None

    def _write_error(self, exc: OSError) -> StoreError:
        if isinstance(exc, (NotADirectoryError, FileExistsError)):
            return StoreError(f"cannot write the store directory {self.root}: {exc}")
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return TransientStoreError(f"store directory full: {exc.strerror} ({self.root})")
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return AccessDenied(f"cannot write the store directory {self.root}: "
                                f"{exc.strerror}")
        return TransientStoreError(f"cannot write the store directory {self.root}: "
                                   f"{exc.strerror or exc}")

    def put(self, key: str, data: bytes, sha256: str | None = None, *,
            if_match: str | None = None) -> str:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            with self._writing(), self._locked(key):
                if if_match is not None and self._etag_now(path) != if_match:
                    raise PreconditionFailed(key)
                os.replace(tmp, path)
                return _local_etag(path)
        finally:
            _discard(tmp)

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            with self._writing(), self._locked(key):
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    return None
                return _local_etag(path)
        finally:
            _discard(tmp)

    def get(self, key: str) -> tuple[bytes, str]:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                etag = _local_etag_fd(f.fileno())
                return f.read(), etag
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound(key) from None

    def get_into(self, key: str, buffer) -> tuple[int, str]:
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                etag = _local_etag_fd(f.fileno())
                size = os.fstat(f.fileno()).st_size
                if size > len(buffer):
                    return size, etag
                with memoryview(buffer) as view:
                    got = 0
                    while got < size:
                        n = f.readinto(view[got:size])
                        if not n:
                            break
                        got += n
                return got, etag
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound(key) from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> Iterator[ListedObject]:
        # Walk only the directory the prefix lives in when it ends with '/'.
        base_dir, _, _ = prefix.rpartition("/")
        start = self.root / base_dir if base_dir else self.root
        if not start.is_dir():
            return
        results: list[ListedObject] = []
        for dirpath, dirnames, filenames in os.walk(start):
            if dirpath == str(self.root):
                # The store's own files live at the root, where no key can point.
                dirnames[:] = [d for d in dirnames if d not in self._RESERVED]
                filenames = [n for n in filenames if n not in self._RESERVED]
            for name in filenames:
                full = Path(dirpath) / name
                key = str(full.relative_to(self.root))
                if key.startswith(prefix):
                    try:
                        st = full.stat()
                    except FileNotFoundError:
                        continue
                    results.append(ListedObject(key, st.st_size, _etag_of_stat(st),
                                                st.st_mtime))
        results.sort(key=lambda o: o.key)
        yield from results

    def delete(self, key: str, if_match: str | None = None) -> None:
        path = self._path(key)
        with self._writing(), self._locked(key):
            if if_match is not None and self._etag_now(path) != if_match:
                raise PreconditionFailed(key)
            try:
                path.unlink()
            except FileNotFoundError:
                pass


def _discard(tmp: Path) -> None:
    """A temp file gone or left (a read-only store directory refuses even that: the
    store error said already is what the caller hears, not this one)."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


def _etag_of_stat(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def _local_etag(path: Path) -> str:
    return _etag_of_stat(path.stat())


def _local_etag_fd(fd: int) -> str:
    return _etag_of_stat(os.fstat(fd))


