"""Retention (issue 12 part 1): keep the newest ``keep_last`` sealed checkpoints of a
pattern in each directory, remove the older ones.  Configured as TOML tables::

    [[retention]]
    pattern = "checkpoint-*"     # names matched in any directory, like profiles
    keep_last = 3                # newest sealed checkpoints, by seal time

Runs after a seal (``Filesystem.after_seal``), on the node that sealed, and only when
the checkpoint it sealed is the newest sealed sibling (the node that sealed the newest
one prunes).  It reads the siblings' entries from the store, orders the sealed ones by
their seal time (``sealed_at``; an entry from before that field by its mtime), and
removes those past ``keep_last`` — never a staged one, never one a pointer file of the
directory (``latest``, a Ray snapshot, ...; see profiles.py) names, never one with a
file open on this node.  A removal is one conditional DELETE of the checkpoint's entry
(``If-Match`` the ETag read): an entry another node changed or removed meanwhile is left
alone, so several nodes pruning the same directory is safe.  The tree below a removed
entry is unreachable; ``ckptfs gc`` reclaims its chunks (decision 0003).

Knows the store, the remote format and the profiles; of the filesystem only the few
calls it is handed (``Hooks``).  Nothing of FUSE.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from ..format.profiles import Profiles
from ..format.remote import BadEntry, Entry, chunk_key, decode_name, dir_prefix, entry_key
from ..store import NotFound, ObjectStore, PreconditionFailed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rule:
    pattern: str
    keep_last: int

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.pattern)


@dataclass
class Sibling:
    name: str
    entry: Entry
    etag: str

    @property
    def seal_time(self) -> float:
        if self.entry.sealed_at is not None:
            return self.entry.sealed_at
        return self.entry.mtime_ns / 1e9


@dataclass
class Hooks:
    """What retention needs of the filesystem."""

    open_below: Callable[[int, str], bool]      # (parent ino, name): a file open there?
    forget: Callable[[int, str], Awaitable[None]]   # drop a removed name locally
    path_of: Callable[[int], str]                   # a directory's path, for the log


def plan(siblings: list[Sibling], rule: Rule, sealed_now: str,
         protected: set[str]) -> list[Sibling] | None:
    """The siblings to remove, oldest first; None when ``sealed_now`` is not the newest
    sealed one (the node that sealed the newest prunes)."""
    sealed = sorted((s for s in siblings if s.entry.type == "dir" and not s.entry.staged
                     and rule.matches(s.name)),
                    key=lambda s: (s.seal_time, s.name), reverse=True)
    if not sealed or sealed[0].name != sealed_now:
        return None
    return [s for s in reversed(sealed[rule.keep_last:]) if s.name not in protected]


class Retention:
    def __init__(self, rules: tuple[Rule, ...], store: ObjectStore, profiles: Profiles,
                 hooks: Hooks, keep_report: int = 20) -> None:
        self.rules = rules
        self.store = store
        self.profiles = profiles
        self.hooks = hooks
        self.removed: deque[str] = deque(maxlen=keep_report)   # paths, for status
        self.removed_total = 0
        self.on_removed: Callable[[int], None] = lambda n: None  # metrics

    def rule_for(self, name: str) -> Rule | None:
        for rule in self.rules:
            if rule.matches(name):
                return rule
        return None

    async def after_seal(self, parent_ino: int, parent_dir_id: str, name: str) -> None:
        """Prune the siblings of ``name`` (just sealed in ``parent``).  Never raises:
        a failure is logged and the next seal tries again."""
        rule = self.rule_for(name)
        if rule is None:
            return
        try:
            await self._prune(rule, parent_ino, parent_dir_id, name)
        except Exception as exc:  # noqa: BLE001 - a background task never takes the daemon down
            log.warning("retention after sealing %s: %s (the next seal tries again)",
                        name, exc)

    async def _prune(self, rule: Rule, parent_ino: int, dir_id: str, name: str) -> None:
        siblings, pointers = await trio.to_thread.run_sync(self._read, dir_id, rule)
        protected = set(pointers)
        protected |= {s.name for s in siblings if self.hooks.open_below(parent_ino, s.name)}
        doomed = plan(siblings, rule, name, protected)
        if not doomed:
            return
        where = self.hooks.path_of(parent_ino).rstrip("/")
        for victim in doomed:
            key = entry_key(dir_id, victim.name.encode("utf-8", "surrogateescape"))
            try:
                await trio.to_thread.run_sync(
                    lambda: self.store.delete(key, if_match=victim.etag))
            except (PreconditionFailed, NotFound):
                log.info("retention: %s/%s changed or went meanwhile (another node); left "
                         "alone", where, victim.name)
                continue
            path = f"{where}/{victim.name}"
            self.removed.append(path)
            self.removed_total += 1
            self.on_removed(1)
            log.info("retention: removed %s (sealed %s; %s keeps the newest %d; its chunks "
                     "go with the next `ckptfs gc`)", path,
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(victim.seal_time)),
                     rule.pattern, rule.keep_last)
            await self.hooks.forget(parent_ino, victim.name)

    def _read(self, dir_id: str, rule: Rule) -> tuple[list[Sibling], list[str]]:
        """(blocking) The directory's entries that match ``rule``, and the names its
        pointer files name."""
        prefix = dir_prefix(dir_id)
        siblings: list[Sibling] = []
        pointed: list[str] = []
        for obj in self.store.list(prefix):
            try:
                raw = decode_name(obj.key[len(prefix):])
            except BadEntry:
                continue
            name = raw.decode("utf-8", "surrogateescape")
            is_pointer = self.profiles.is_pointer(raw)
            if not is_pointer and not rule.matches(name):
                continue
            try:
                body, etag = self.store.get(obj.key)
                entry = Entry.from_json(body)
            except (NotFound, BadEntry):
                continue
            if rule.matches(name):
                siblings.append(Sibling(name, entry, etag))
            if is_pointer and entry.type == "file":
                content = self._content(entry, self.profiles.pointer_size_limit(raw))
                pointed += [n.decode("utf-8", "surrogateescape")
                            for n in self.profiles.pointed_names(raw, content)]
        return siblings, pointed

    def _content(self, entry: Entry, limit: int) -> bytes:
        """A pointer file's bytes (a store error aborts this pruning: nothing removed)."""
        if entry.size > limit:
            return b""
        return b"".join(self.store.get(chunk_key(sha))[0] for sha, _ in entry.chunks)
