"""Which path new files' bytes take: kernel FUSE passthrough or the daemon.

Passthrough (the kernel reads and writes an open file's staging file itself, no write
request reaches the daemon) needs four things: the setting (``passthrough = auto``),
writeback cache off (the kernel refuses both at once), a pyfuse3 built with passthrough
(tools/setup.sh patches it; a stock build lacks ``PASSTHROUGH_SUPPORTED``), async
durability (sync mode keeps its writes on the daemon, README "The data path") and
CAP_SYS_ADMIN (the kernel's check when a backing file is registered), then the kernel's
grant at FUSE_INIT.  ``DataPath`` decides what can be known before mounting, then what the
kernel granted, and says it in one line.  Knows nothing of the core's open decisions
(core/opening.py) nor of the store.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CAP_SYS_ADMIN = 21
PASSTHROUGH = "kernel passthrough"
DAEMON = "daemon"


def has_cap_sys_admin(status: Path = Path("/proc/self/status")) -> bool:
    """Whether this process's effective capabilities include CAP_SYS_ADMIN."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


class DataPath:
    """The data path of one mount.  ``library`` is the pyfuse3 module (a fake in tests)."""

    def __init__(self, library: ModuleType, setting: str, writeback_cache: bool,
                 capable: bool, sync: bool = False) -> None:
        self.library = library
        if setting == "off":
            self._not = "passthrough = off"
        elif sync:
            self._not = ("sync mode (its close and fsync upload the chunks the daemon "
                         "pipelined as the bytes came in)")
        elif writeback_cache:
            self._not = "writeback_cache is on (the kernel allows no passthrough with it)"
        elif not getattr(library, "PASSTHROUGH_SUPPORTED", False):
            self._not = "pyfuse3 was built without passthrough (tools/setup.sh builds it)"
        elif not capable:
            self._not = "the daemon lacks CAP_SYS_ADMIN (the kernel requires it)"
        else:
            self._not = ""
        self._said = False

    @property
    def wanted(self) -> bool:
        """Ask the kernel for passthrough at FUSE_INIT."""
        return not self._not

    def available(self) -> bool:
        """May an open hand the kernel a backing file now?  After FUSE_INIT: the kernel
        granted passthrough and no registration of a backing file has failed."""
        return self.wanted and bool(self.library.passthrough_enabled()) and \
            self.library.passthrough_error() is None

    def reason(self) -> str:
        """Why the path is the daemon's ("" when it is the kernel's)."""
        if self._not:
            return self._not
        if not self.library.passthrough_enabled():
            return "the kernel did not offer FUSE passthrough at FUSE_INIT"
        error = self.library.passthrough_error()
        if error is not None:
            return f"registering a backing file failed: {error}"
        return ""

    def describe(self) -> dict:
        """``{"path": "kernel passthrough" | "daemon", "reason": ...}`` for status."""
        reason = self.reason()
        return {"path": DAEMON if reason else PASSTHROUGH, "reason": reason or None}

    def say_once(self) -> None:
        """One log line, once FUSE_INIT is done."""
        if self._said:
            return
        self._said = True
        doc = self.describe()
        if doc["reason"]:
            log.info("data path: daemon (%s)", doc["reason"])
        else:
            log.info("data path: kernel passthrough")
