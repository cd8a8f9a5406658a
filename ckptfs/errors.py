"""Errors of the filesystem core and their errno: the one place where a failure gets
its number.  Knows nothing of FUSE (the adapter turns ``FsError`` into ``FUSEError``)."""

from __future__ import annotations

import errno


# Out of a local resource (descriptors, disk space): the caller gets the errno and the
# log one line, not a traceback; the daemon serves on.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.EDQUOT})


class FsError(Exception):
    """A filesystem operation failed with ``errno``; ``reason`` is for the log."""

    def __init__(self, err: int, reason: str = "") -> None:
        super().__init__(f"{errno.errorcode.get(err, err)}: {reason}")
        self.errno = err
        self.reason = reason

    @classmethod
    def enoent(cls, reason: str = "") -> "FsError":
        return cls(errno.ENOENT, reason)


def errno_of(exc: BaseException) -> int:
    """The errno a FUSE caller should see for an exception raised below the FUSE layer."""
    from .format.remote import BadEntry
    from .store import StoreError

    if isinstance(exc, FsError):
        return exc.errno
    if isinstance(exc, BadEntry):
        return errno.EIO
    if isinstance(exc, StoreError):
        return errno.EIO
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    return errno.EIO


class MountError(Exception):
    """The mount cannot proceed; the message is the one-line reason for the user, with
    what to do about it."""


def first_cause(exc: BaseException) -> BaseException:
    """The first real exception inside (nested) exception groups — a trio nursery wraps
    what its tasks raised — so that no user sees "Exceptions from Trio nursery".
    Cancellations are skipped when anything else is there."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        real = [e for e in exc.exceptions if type(e).__name__ != "Cancelled"]
        exc = (real or list(exc.exceptions))[0]
    return exc
