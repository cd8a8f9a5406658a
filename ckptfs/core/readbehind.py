"""Reading behind a writer the daemon does not see (kernel passthrough, issue 23): while
a passthrough writer's session is open, one background task per session watches its
staging file's size and hands each newly complete chunk to the write path's pipelined
upload (``WritePath.send_ahead``), as a daemon-path write that completes a chunk does.
The upload gate (decision 0015) and the upload limiter apply as to every upload.

The kernel writes the staging file anywhere, any time (a zip header patched in place, an
mmap store): a chunk sent early may change after it was sent.  So the session's tracker
is marked ``verify``, and publishing hashes every early chunk again from the closed
version and sends it again if it changed (``data/upload.py`` ``chunk_list``): an entry
names only ids computed from the bytes it publishes.  The last partial chunk goes at
publish, as on the daemon path.

Knows nothing of FUSE, the store or publishing; the open decision is ``opening.py``'s."""

from __future__ import annotations

import logging
import os

import trio

from ..errors import FsError
from .state import CoreState, Session
from .write import WritePath

log = logging.getLogger(__name__)

# How often the staging file's size is looked at: at once again while it grows, backing
# off to the slowest while nothing does.
POLL_FASTEST = 0.05
POLL_SLOWEST = 0.5


class ReadBehind:
    """Starts and runs the read-behind task of passthrough sessions (in ``st.nursery``)."""

    def __init__(self, st: CoreState, *, writes: WritePath) -> None:
        self.st = st
        self.writes = writes

    def follow(self, ino: int, session: Session) -> None:
        """Read behind ``session``'s writers from now until its passthrough handles are
        all closed or the session ends (its close commits it, or it is abandoned)."""
        session.tracker.verify = True
        self.st.nursery.start_soon(self._run, ino, session)

    def _following(self, ino: int, session: Session) -> bool:
        rt = self.st.runtime.get(ino)
        return rt is not None and rt.session is session and rt.passthrough > 0 \
            and rt.passthrough_ver == session.ver

    async def _run(self, ino: int, session: Session) -> None:
        interval = POLL_FASTEST
        while self._following(ino, session):
            # No await between the check above and these (the shared descriptor stays
            # this version's; the uploads open the file themselves).
            try:
                size = os.fstat(self.st.staging.fd(ino, session.ver)).st_size
            except (OSError, FsError) as exc:
                log.debug("read-behind of inode %d stops: %s", ino, exc)
                return
            if self.feed(ino, session, size):
                interval = POLL_FASTEST
            else:
                interval = min(interval * 2, POLL_SLOWEST)
            await trio.sleep(interval)

    def feed(self, ino: int, session: Session, size: int) -> int:
        """Send every chunk complete within ``size`` bytes and not yet sent; how many."""
        tracker = session.tracker
        chunk = tracker.chunk_size
        sent = 0
        while (tracker.next_index + 1) * chunk <= size:
            index = tracker.next_index
            tracker.next_index += 1
            if index not in tracker.pending:
                self.writes.send_ahead(ino, session, index)
                sent += 1
        return sent
