"""Did the process that opened a file finish, or was it killed?  (DESIGN.md promise 2.)

The kernel closes a killed process's descriptors for it, and a FUSE filesystem receives
an ordinary FLUSH.  We record the opener at open/create and, at flush, read
``/proc/<tid>/stat``: a task that is exiting (``PF_EXITING``) with a signal or a non-zero
status in ``exit_code`` did not mean to close.  Knows nothing of files or FUSE.
"""

from __future__ import annotations

from dataclasses import dataclass

PF_EXITING = 0x4


@dataclass(frozen=True)
class Opener:
    tid: int
    tgid: int

    @classmethod
    def from_tid(cls, tid: int) -> "Opener":
        return cls(tid=tid, tgid=_tgid_of(tid) or tid)


def _tgid_of(tid: int) -> int | None:
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields 3.. of /proc/<pid>/stat (after the command name), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2:].split()


def exit_state(pid: int) -> tuple[bool, int] | None:
    """(exiting, exit_code) of a task, or None if it no longer exists."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 50:
        return None
    flags = int(fields[9 - 3])
    exit_code = int(fields[52 - 3])
    return bool(flags & PF_EXITING), exit_code


def died_unclean(opener: Opener) -> bool:
    """True if the opener is exiting because of a signal or with a non-zero status."""
    for pid in (opener.tid, opener.tgid):
        state = exit_state(pid)
        if state is None:
            continue  # thread gone: ask its thread group
        exiting, code = state
        if not exiting:
            return False
        return (code & 0x7F) != 0 or (code >> 8) != 0
    return False  # nobody left to ask: someone who inherited the descriptor closed it
