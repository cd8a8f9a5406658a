"""pyfuse3's line for a reply the kernel no longer waits for, told for what it is.

pyfuse3 logs ``fuse_<op>(): fuse_reply_* failed with No such file or directory`` at ERROR
whenever writing a reply to ``/dev/fuse`` fails with ENOENT: the kernel has no request
of that id any more (it was interrupted, or the mount is going away and the kernel
ended what was pending).  For the requests that end a use (release, releasedir, flush,
fsync, fsyncdir) the daemon had done the work before replying, and nothing waits for
the answer: the line says so at INFO.  Any other request's failed reply stays an ERROR
(an open or create whose answer was lost leaves a handle the kernel never learned of).
That happens only when the connection is ending: once a request has reached the daemon,
the kernel waits for its answer even if the caller is killed (``request_wait_answer``,
fs/fuse/dev.c), so a lost answer means an aborted connection or an unmount, and the
daemon's shutdown (recovery at the next mount) deals with what is still open.
Knows nothing of ckptfs beyond the FUSE request names.
"""

from __future__ import annotations

import logging
import re

_LATE = re.compile(r"^fuse_(release|releasedir|flush|fsync|fsyncdir)\(\): "
                   r"fuse_reply_\* failed with No such file or directory$")


class LateReplies(logging.Filter):
    """On the ``pyfuse3`` logger: rewrites the lines above, lets every other through."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            m = _LATE.match(record.getMessage())
            if m:
                record.levelno, record.levelname = logging.INFO, "INFO"
                record.msg = ("fuse_%s(): the kernel no longer waited for this reply (the "
                              "request was interrupted, or the mount is going away); the "
                              "request itself was done")
                record.args = (m.group(1),)
        return True


def install() -> None:
    """Once per daemon, before the FUSE loop starts."""
    logger = logging.getLogger("pyfuse3")
    if not any(isinstance(f, LateReplies) for f in logger.filters):
        logger.addFilter(LateReplies())
