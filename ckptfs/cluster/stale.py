"""Staged checkpoint directories that nobody seals (issue 14): a staged directory is
hidden from every listing until something seals it (DESIGN.md promise 4), so one that a
framework without a profile wrote would stay hidden forever, silently.  This module
finds them in the node's namespace, reports each one once in the log with the way out
(``ckptfs commit PATH``, or a profile), and lists them for ``ckptfs status``.

"Nobody is writing" means: no open writer and no pending upload below the directory
*on this node*, and nothing below it changed (created, written, removed) for
``stale_staged_after`` seconds.  It never seals anything: a crashed job's directory is
idle too (promise 4: no idle-timeout seal).

Knows the namespace and a ``busy(ino)`` question the filesystem answers; nothing of
FUSE, the store or the control socket.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import trio

from ..errors import FsError
from ..meta.namespace import Inode, Namespace

log = logging.getLogger(__name__)


@dataclass
class StagedDir:
    path: str          # absolute, under the mount point
    idle_s: float      # seconds since anything below it last changed
    state: str         # "writing" (open writer or pending upload below it), "idle", "stale"

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["idle_s"] = round(self.idle_s, 1)
        return doc


class StaleStagedWatch:
    def __init__(self, ns: Namespace, busy: Callable[[int], bool], mountpoint: Path,
                 after: float, clock: Callable[[], float] = time.time) -> None:
        self.ns = ns
        self.busy = busy
        self.mountpoint = mountpoint
        self.after = after
        self.clock = clock
        self._reported: set[int] = set()

    @property
    def interval(self) -> float:
        return max(0.1, min(self.after / 4, 60.0))

    def _activity(self, top: Inode) -> tuple[int, bool]:
        """Newest mtime (ns) below ``top`` and whether anything below it is busy."""
        newest, stack = top.mtime_ns, [top.ino]
        while stack:
            ino = stack.pop()
            if self.busy(ino):
                return newest, True
            for _, child in self.ns.children(ino):
                inode = self.ns.maybe_get(child)
                if inode is None:
                    continue
                newest = max(newest, inode.mtime_ns)
                if inode.type == "dir":
                    stack.append(child)
                elif self.busy(child):
                    return newest, True
        return newest, False

    def scan(self) -> list[tuple[int, StagedDir]]:
        now = self.clock()
        out = []
        for inode in self.ns.staged_dirs():
            try:
                relative = self.ns.path_of(inode.ino).decode("utf-8", "replace")
            except FsError:
                continue
            newest, busy = self._activity(inode)
            idle = max(0.0, now - newest / 1e9)
            state = "writing" if busy else ("stale" if idle >= self.after else "idle")
            out.append((inode.ino, StagedDir(str(self.mountpoint) + relative, idle, state)))
        return out

    def stale(self) -> list[StagedDir]:
        return [d for _, d in self.scan() if d.state == "stale"]

    def check(self) -> list[StagedDir]:
        """Scan, and log each newly stale directory once; returns the stale ones."""
        found = self.scan()
        self._reported &= {ino for ino, _ in found}     # sealed or gone: forget it
        stale = []
        for ino, d in found:
            if d.state != "stale":
                continue
            stale.append(d)
            if ino in self._reported:
                continue
            self._reported.add(ino)
            log.warning(
                "staged checkpoint directory %s has not been sealed and nothing on this "
                "node has written below it for %.0f s: it stays hidden from listings, and "
                "`ckptfs gc` removes it after gc_grace. If it is complete, seal it with "
                "`ckptfs commit %s`, or add a profile for the framework that wrote it "
                "([[extra_profiles]] in the config file, see the README)",
                d.path, d.idle_s, d.path)
        return stale

    async def run(self) -> None:
        while True:
            try:
                self.check()
            except Exception:  # a background task must never take the daemon down
                log.exception("checking for stale staged directories failed")
            await trio.sleep(self.interval)
