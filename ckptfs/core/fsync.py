"""fsync of a file open for writing: the bytes written so far made durable, never a
publish (the name changes at the close).  Knows the staging files, the journal and the
uploader; nothing of the close decision or of entries."""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable

import trio

from ..data.upload import chunk_list
from ..errors import FsError
from ..store import StoreError
from .state import CoreState


async def side_by_side(*steps: Callable[[], Awaitable[None]]) -> None:
    """Run ``steps`` at once; once all have ended, raise the first one's failure (itself,
    not an exception group: the errno boundary maps it)."""
    failures: list[Exception] = []

    async def run(step: Callable[[], Awaitable[None]]) -> None:
        try:
            await step()
        except Exception as exc:  # raised below, once every step ended
            failures.append(exc)

    async with trio.open_nursery() as nursery:
        for step in steps:
            nursery.start_soon(run, step)
    if failures:
        raise failures[0]


class Fsync:
    """fsync for handles open for writing (sync mode: the chunks reach the store too)."""

    def __init__(self, st: CoreState) -> None:
        self.st = st

    async def fsync(self, fh: int, datasync: bool) -> None:
        """Durability of the bytes written so far, never a publish: the name changes at
        the close (sync: the chunks are in the store; async: staged on local disk)."""
        handle = self.st._handle(fh)
        if not handle.writable:
            return
        session = handle.session
        rt = self.st._rt(handle.ino)
        if session is None or rt.session is not session:
            return
        if session.failed:
            raise FsError(session.failed, "an earlier write failed")
        if self.st.config.durability != "sync":
            with self.st.upload_gate.busy():   # uploads wait for the writer (decision 0015)
                # The staging file and the journal reach the disk side by side.
                await side_by_side(lambda: self._fsync_staged(handle.ino, session.ver),
                                   self.st._sync_journal)
            return
        # Sync mode: the staging file reaches the disk while the chunks reach the store
        # (both must be done before fsync returns; neither waits for the other).
        size = self.st.staging.size(handle.ino, session.ver)

        async def to_disk() -> None:
            await self._fsync_staged(handle.ino, session.ver)
            await self.st._sync_journal()

        async def to_store() -> None:
            try:
                await chunk_list(self.st.uploader, session.tracker,
                                 self.st.staging.path(handle.ino, session.ver), size,
                                 self.st.config.chunk_size)
            except StoreError as exc:
                raise FsError(errno.EIO, f"upload failed: {exc}") from None

        self.st._ref(rt, session.ver)
        try:
            await side_by_side(to_disk, to_store)
        finally:
            self.st._unref(handle.ino, rt, session.ver)

    async def _fsync_staged(self, ino: int, ver: int) -> None:
        """fsync a staging version in a worker thread, through a descriptor of its own
        (the shared one may be evicted and its number reused meanwhile)."""
        with self.st.staging.owned_fd(ino, ver) as fd:
            await trio.to_thread.run_sync(os.fsync, fd)
