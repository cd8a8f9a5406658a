"""What the node's background work knows of the store's health: an outage, its cause and
since when (decision 0016, the fault model).

Background work (the publish queue, the metadata log) reports each failed and each
successful store step here.  A failure is classified once:

* an *outage* — the store unreachable (refused, reset, timeouts, 5xx, throttling), access
  denied (401/403: credentials rotated or revoked, an expired token) or the bucket gone
  (``NoSuchBucket``): nothing the node sent is wrong; it keeps everything and retries with
  back-off until the store answers again;
* a *refusal* — a 4xx about the request itself (an invalid argument, a key too long):
  retrying the same request cannot help soon; the item is kept, retried slowly, and
  waits for an operator.

Neither ever drops anything.  ``describe`` is the one line ``status``, ``wait`` and the log
show.  Knows nothing of files, records or FUSE: only store errors and a clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from .base import AccessDenied, BucketMissing, StoreError, TransientStoreError, store_cause

log = logging.getLogger(__name__)

# The outage causes, as the one-line status names them.
UNREACHABLE = "unreachable"
ACCESS_DENIED = "access denied"
BUCKET_MISSING = "bucket missing"
MARKER_LOST = "store marker ckptfs.json missing (the bucket deleted or emptied?)"


def outage_cause(exc: BaseException) -> str | None:
    """The outage ``exc`` shows (``UNREACHABLE``, ``ACCESS_DENIED``,
    ``BUCKET_MISSING``), or None when it is a refusal of one request or no store error
    at all."""
    cause = store_cause(exc)
    if cause is None:
        return None
    if isinstance(cause, TransientStoreError):
        return UNREACHABLE
    if isinstance(cause, AccessDenied):
        return ACCESS_DENIED
    if isinstance(cause, BucketMissing):
        return BUCKET_MISSING
    return None


def is_refusal(exc: BaseException) -> bool:
    """A store error about the request itself, which the same request will meet again."""
    cause = store_cause(exc)
    return isinstance(cause, StoreError) and outage_cause(cause) is None and \
        type(cause) is StoreError


class StoreHealth:
    """The current outage, if any: its cause, since when, and the last error's text."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.cause: str | None = None
        self.since: float | None = None
        self.last_error = ""
        # The store lost its format marker under the mount: nothing is published until
        # it is back (an operator restores the bucket), whatever else answers.
        self.marker_lost_since: float | None = None
        self.marker_watched = False     # the store had its marker at the first look
        self.check_marker = trio.Event()    # set: look for the marker now

    def failed(self, exc: BaseException) -> str | None:
        """A background store step failed with ``exc``: the outage it shows, if any.
        Logged once per outage (and once more when its cause changes)."""
        cause = outage_cause(exc)
        if cause is None:
            return None
        self.last_error = str(store_cause(exc) or exc)
        if cause == BUCKET_MISSING:
            self.check_marker.set()
        if cause != self.cause:
            if self.cause is None:
                self.since = self._clock()
            self.cause = cause
            log.warning("store unavailable (%s): %s; everything stays on this node and is "
                        "retried until the store answers", cause, self.last_error)
        return cause

    def succeeded(self) -> None:
        """A background store step succeeded: the outage, if there was one, is over."""
        if self.cause is not None:
            log.warning("store available again after %.0f s (%s)",
                        self._clock() - (self.since or self._clock()), self.cause)
        self.cause = self.since = None
        self.last_error = ""

    def marker_checked(self, present: bool) -> None:
        """The result of a look for the store's format marker."""
        self.check_marker = trio.Event()
        if not present and self.marker_lost_since is None:
            self.marker_lost_since = self._clock()
            log.error("the store lost its marker ckptfs.json (the bucket was deleted or "
                      "emptied?): nothing more is published, everything stays on this node; "
                      "restore the bucket (with ckptfs.json) to resume")
        elif present and self.marker_lost_since is not None:
            self.marker_lost_since = None
            log.warning("the store's marker ckptfs.json is back: publishing resumes")

    @property
    def marker_lost(self) -> bool:
        return self.marker_lost_since is not None

    @property
    def unavailable(self) -> bool:
        return self.cause is not None or self.marker_lost

    def describe(self, records: int, uploads: int) -> str | None:
        """``store unavailable: access denied since 2026-12-01 21:40:03 UTC, 3 records
        and 2 uploads waiting``, or None while the store answers."""
        if self.marker_lost_since is not None:
            cause, since = MARKER_LOST, self.marker_lost_since
        elif self.cause is not None and self.since is not None:
            cause, since = self.cause, self.since
        else:
            return None
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since))
        detail = f" ({self.last_error})" if self.last_error and cause == self.cause else ""
        return (f"store unavailable: {cause} since {when}, {records} record(s) and "
                f"{uploads} upload(s) waiting{detail}")
