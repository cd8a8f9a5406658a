"""The store as the core sees it: every entry PUT passes the gc/dedup guard
(``ChunkLiveness.guard_entry``, decision 0003); nothing is published while the store has
lost its format marker (a bucket deleted or emptied under the mount, decision 0016); and
an entry's absence is an answer only when it is sure.

An absence decides things that cannot be undone: the metadata log finishes a rename,
seal or removal whose entry is not where this node left it ("another node moved or
removed it first"), and a listing forgets names the store no longer has.  So such a
read of an entry (``get_confirmed``) asks again after a 404 -- a store or a proxy in
front of it may answer one 404 for an object it holds -- and then looks for the store's
marker: gone, the 404 is an outage, not an answer; and while the marker is known to be
gone no entry read or listing counts as an answer at all: an emptied bucket says
nothing about what another node did, and the records wait for the operator's restore.

Blocking; runs in worker threads.  Knows nothing of inodes, FUSE or LMDB."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from ..format.remote import FORMAT_KEY
from ..store import BucketMissing, ListedObject, NotFound, ObjectStore
from .liveness import ChunkLiveness, entry_chunks

log = logging.getLogger(__name__)

ENTRY_PREFIXES = ("dirs/", "inodes/")


class GuardedStore:
    """An ``ObjectStore`` with the rules above.  ``marker_lost``: whether the store is
    known to have lost its marker; ``marker_watched``: whether it had one (a mount
    always has; the core's tests over a bare store have none, and their 404s are
    answers)."""

    def __init__(self, inner: ObjectStore, liveness: ChunkLiveness,
                 marker_lost: Callable[[], bool] = lambda: False,
                 marker_watched: Callable[[], bool] = lambda: False) -> None:
        self.inner = inner
        self.liveness = liveness
        self.marker_lost = marker_lost
        self.marker_watched = marker_watched
        self.url = inner.url

    def _refuse_without_marker(self, key: str) -> None:
        """A store that lost its format marker (a bucket deleted under the mount, and
        re-created empty by the next PUT) gets no entry, and its entries' absence means
        nothing: publishing stops, loudly (decision 0016)."""
        if key.startswith(ENTRY_PREFIXES) and self.marker_lost():
            raise BucketMissing(f"not publishing or reading {key}: the store lost its "
                                f"marker {FORMAT_KEY} (the bucket deleted or emptied?)")

    def _guard(self, key: str, data: bytes) -> None:
        self._refuse_without_marker(key)
        if key.startswith(ENTRY_PREFIXES):   # entries and inode objects (0008)
            chunks = entry_chunks(data)
            if chunks:
                self.liveness.guard_entry(chunks)

    def check(self) -> None:
        self.inner.check()

    def put(self, key: str, data: bytes, sha256: str | None = None, **conditions) -> str:
        self._guard(key, data)
        return self.inner.put(key, data, sha256, **conditions)

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        self._guard(key, data)
        return self.inner.put_if_absent(key, data)

    def get(self, key: str) -> tuple[bytes, str]:
        try:
            return self.inner.get(key)
        except NotFound:
            if key.startswith(ENTRY_PREFIXES):
                self._refuse_without_marker(key)
            raise

    def get_confirmed(self, key: str) -> tuple[bytes, str]:
        """``get`` for a read whose 404 finishes something for good (a record of the
        metadata log taken as "another node moved or removed it"): a 404 is asked
        again.  (Not for listings: there a 404 between a LIST and its GETs is a fact of
        that moment, and a second look would mix two moments.)"""
        try:
            return self.get(key)
        except NotFound:
            pass
        try:
            found = self.get(key)
        except NotFound:
            self._marker_or_raise(key)
            raise
        log.warning("the store answered 404 for %s, then had it: the first answer is "
                    "not taken", key)
        return found

    def _marker_or_raise(self, key: str) -> None:
        """After a 404 of an entry: an outage, not an answer, if the store has lost its
        marker (it answers for an emptied bucket, not for what another node did)."""
        self._refuse_without_marker(key)
        if self.marker_watched() and not self.inner.exists(FORMAT_KEY):
            raise BucketMissing(f"{key} not found, and neither is the store's marker "
                                f"{FORMAT_KEY} (the bucket deleted or emptied?)")

    def get_into(self, key: str, buffer) -> tuple[int, str]:
        return self.inner.get_into(key, buffer)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str) -> Iterator[ListedObject]:
        self._refuse_without_marker(prefix)
        return self.inner.list(prefix)

    def delete(self, key: str, *args, **conditions) -> None:
        self._refuse_without_marker(key)
        self.inner.delete(key, *args, **conditions)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
