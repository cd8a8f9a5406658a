"""The object-store protocol and its errors: the contract of the bottom layer.

Every other layer talks to an ``ObjectStore``; every implementation (``local``, ``s3``,
``memory``) and wrapper (``retry``, ``faults``) speaks it.  Methods are blocking; callers
run them in worker threads.  Knows nothing about files, inodes or FUSE: it moves opaque
bytes under opaque keys.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol


class StoreError(Exception):
    """A store operation failed for good (bad credentials, missing bucket, ...)."""


class TransientStoreError(StoreError):
    """A store operation failed in a way worth retrying (5xx, throttling, resets)."""


class AccessDenied(StoreError):
    """The store refuses this node's credentials (401/403: rotated, revoked, an expired
    token).  An outage, not a verdict on the request: background work retries it."""


class BucketMissing(StoreError):
    """The bucket (or the local store's directory) does not exist.  An outage too."""


class NotFound(StoreError):
    """The key does not exist."""


class PreconditionFailed(StoreError):
    """A conditional write or delete found the key in another state (HTTP 412)."""


class StoreTimeout(TransientStoreError):
    """A store call did not finish within its overall deadline (``store_timeout``),
    all attempts together.  Transient: a later call may well succeed."""


class StoreClosed(TransientStoreError):
    """The store was closed (the daemon is stopping) while the call was in flight."""


def is_permanent(exc: BaseException) -> bool:
    """A store failure that retrying cannot cure (a 4xx other than 408/429: a key too
    long, an invalid argument, access denied).  Not-found and precondition failures are
    answers, not failures, and are not permanent in this sense."""
    return isinstance(exc, StoreError) and not isinstance(
        exc, (TransientStoreError, NotFound, PreconditionFailed))


@dataclass(frozen=True)
class ListedObject:
    key: str
    size: int
    etag: str
    mtime: float = 0.0     # last modified, seconds since the epoch


class ObjectStore(Protocol):
    """What ckptfs needs from an object store.  Keys are relative to the store's root."""

    url: str

    def check(self) -> None:
        """Raise StoreError with a one-line reason if the store cannot be used."""

    def put(self, key: str, data: bytes, sha256: str | None = None, *,
            if_match: str | None = None) -> str:
        """Store ``data`` under ``key`` atomically; return the new ETag.  ``sha256``, if
        given, is the hex digest of ``data`` (lets S3 verify it, and saves re-hashing).
        With ``if_match`` only if the key exists with that ETag, else
        ``PreconditionFailed``."""

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        """Store ``data`` only if ``key`` does not exist: the new ETag (a non-empty
        string), or None if the key existed."""

    def get(self, key: str) -> tuple[bytes, str]:
        """Return (body, etag); raise NotFound."""

    def get_into(self, key: str, buffer) -> tuple[int, str]:
        """Receive the object into ``buffer`` (writable, bytes-like): (its length, its
        ETag); raise NotFound.  An object longer than the buffer leaves the buffer
        undefined and returns its length (the caller sees the mismatch).  Lets a caller
        reuse its buffers instead of a fresh object per GET (``copy_into`` is the
        fallback of stores that cannot do better)."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> Iterator[ListedObject]:
        """Every object whose key starts with ``prefix``, in key order."""

    def delete(self, key: str, if_match: str | None = None) -> None:
        """Remove ``key``; deleting a missing key is not an error.  With ``if_match``
        only if the key exists with that ETag, else ``PreconditionFailed``."""


def copy_into(got: tuple[bytes, str], buffer) -> tuple[int, str]:
    """``get_into`` for a store that only has ``get``: copy ``(body, etag)`` in."""
    body, etag = got
    if len(body) <= len(buffer):
        memoryview(buffer)[:len(body)] = body
    return len(body), etag


def store_cause(exc: BaseException) -> BaseException | None:
    """The store error behind ``exc``: the filesystem turns store errors into ``EIO``
    (``raise FsError(...) from None`` keeps the original as ``__context__``)."""
    seen = 0
    link: BaseException | None = exc
    while link is not None and seen < 16:
        if isinstance(link, StoreError):
            return link
        link = link.__cause__ or link.__context__
        seen += 1
    return None
