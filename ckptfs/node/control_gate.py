"""The bounds of the control socket (DESIGN.md §1, promise 9): how many connections each
ordinary user, all ordinary users together and root may hold; how long and how large one
request may be; and how often an offender is named in the log.

Every local user may connect to the control socket, so what it costs the daemon is
capped here, well below the daemon's descriptor limit, and root keeps room of its own:
``ckptfs status`` and ``ckptfs umount`` are answered while an ordinary user holds all it
may.  An offender (a connection over a cap, a request too large or too slow) is counted
per uid, shown in ``ckptfs status``, and named in the log at most once a minute per
uid — never a line, let alone a traceback, per connection.

Knows uids, counts and a clock; nothing of sockets, requests or the filesystem.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAX_REQUEST = 8 << 10       # bytes: a request is one JSON line of a few hundred bytes
REQUEST_DEADLINE = 5.0      # s from accept until the request's newline has arrived
PER_UID = 16                # connections one ordinary user may hold at once
ALL_USERS = 64              # connections all ordinary users together may hold
ROOT_RESERVE = 16           # root's own connections, never taken by anyone else
FD_SHARE = 8                # all caps together take at most 1/FD_SHARE of the fd limit
COMPLAIN_EVERY = 60.0       # s between two log lines about one uid (or one accept error)


@dataclass(frozen=True)
class Limits:
    per_uid: int = PER_UID
    all_users: int = ALL_USERS
    root: int = ROOT_RESERVE
    max_request: int = MAX_REQUEST
    deadline: float = REQUEST_DEADLINE

    @classmethod
    def for_fd_limit(cls, nofile: int) -> "Limits":
        """The default caps, shrunk in proportion when together they would hold more
        than 1/``FD_SHARE`` of ``nofile`` descriptors (the rest is the filesystem's)."""
        budget = max(2, nofile // FD_SHARE)
        if ALL_USERS + ROOT_RESERVE <= budget:
            return cls()
        root = max(1, budget * ROOT_RESERVE // (ALL_USERS + ROOT_RESERVE))
        all_users = max(1, budget - root)
        return cls(per_uid=min(PER_UID, all_users), all_users=all_users, root=root)


class Every:
    """Says yes to a key at most once per ``period`` seconds."""

    def __init__(self, period: float = COMPLAIN_EVERY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.period = period
        self.clock = clock
        self._last: dict[object, float] = {}

    def due(self, key: object) -> bool:
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.period:
            return False
        if len(self._last) > 1024:          # forget keys quiet for a whole period
            self._last = {k: t for k, t in self._last.items() if now - t < self.period}
        self._last[key] = now
        return True


class Gate:
    """Admits or refuses each connection by its peer's uid, and counts offences."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.held: Counter[int] = Counter()     # uid -> connections held
        self.users = 0                          # held by ordinary users, all together
        self.offences: dict[int, Counter[str]] = {}     # uid -> kind -> count, ever
        self._unsaid: dict[int, Counter[str]] = {}      # since the uid's last log line
        self._every = Every(clock=clock)

    def admit(self, uid: int) -> str | None:
        """None (and the connection counts as held) or why it is refused."""
        limits = self.limits
        if uid == 0:
            if self.held[0] >= limits.root:
                return f"root holds {limits.root} control connections already"
        elif self.held[uid] >= limits.per_uid:
            return (f"uid {uid} holds {limits.per_uid} control connections already "
                    f"(the most one user may hold)")
        elif self.users >= limits.all_users:
            return (f"ordinary users hold {limits.all_users} control connections already "
                    f"(the most they may hold together)")
        self.held[uid] += 1
        if uid != 0:
            self.users += 1
        return None

    def release(self, uid: int) -> None:
        self.held[uid] -= 1
        if self.held[uid] <= 0:
            del self.held[uid]
        if uid != 0:
            self.users -= 1

    def offence(self, uid: int, kind: str) -> None:
        """Count one offence of ``uid``; name the uid in the log if it was not named
        within the last minute (with what it did since)."""
        self.offences.setdefault(uid, Counter())[kind] += 1
        unsaid = self._unsaid.setdefault(uid, Counter())
        unsaid[kind] += 1
        if self._every.due(uid):
            what = ", ".join(f"{n} × {k}" for k, n in unsaid.most_common())
            log.warning("control socket: uid %d: %s; refused (more from uid %d are counted "
                        "in `ckptfs status` and logged at most once a minute)",
                        uid, what, uid)
            unsaid.clear()

    def accept_failed(self, exc: OSError) -> None:
        """accept(2) failed (EMFILE, ENFILE, ENOBUFS…): one line a minute, no traceback."""
        if self._every.due(("accept", exc.errno)):
            log.warning("control socket: accept failed: %s; new connections wait in the "
                        "backlog, retrying (logged at most once a minute)",
                        exc.strerror or exc)

    def report(self) -> dict:
        return {"connections": {str(uid): n for uid, n in self.held.items()},
                "limits": {"per_uid": self.limits.per_uid,
                           "all_users": self.limits.all_users,
                           "root": self.limits.root,
                           "max_request": self.limits.max_request,
                           "deadline_s": self.limits.deadline},
                "refused": {str(uid): dict(kinds) for uid, kinds in self.offences.items()}}
