"""Async durability's ordered log of metadata operations (decision 0012).

With ``durability = "async"``, ``mkdir``, ``rename``, ``unlink``/``rmdir`` and seals
change this node's namespace at once and append a record here (in the namespace's
journal, so a restart resumes them); one worker replays the records against the store
strictly in journal order, whatever the store is doing meanwhile.  A record whose store
step fails is tried again (backoff) and holds back the records after it, whatever the
failure: the store away, access denied, the bucket gone, a request refused (decision
0016).  A record is never dropped: it leaves the journal only once the store has it (or
once there is nothing left to apply, e.g. a directory removed here before it reached the
store).  The store's health (``store_health.py``) hears of every failure and success.

Ordering with the data publishes of the publish queue uses *epochs*: a publish carries
the sequence number of the newest record pending when its file was closed, and is not
started before every record up to that number is in the store (a name unlinked, then
created again, is deleted before the new file lands).  A record that publishes a tree
(a directory rename, a seal) waits for the publishes below it that are older than
itself (``wait_for``), so other nodes see the tree complete, never half.

While a record touching a directory is pending, the store's listing of that directory
is stale by design: the directory is *busy* and refresh leaves it alone.

Knows nothing of entries, keys or the store: executing a record is the caller's
callback; directory-id aliases (a ``mkdir`` that met another node's directory of the
same name and joined it) are kept here because records name directories by id.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable

import trio

from .namespace import Namespace
from ..store.retrypolicy import RetryPolicy
from ..store import store_cause
from ..store.health import StoreHealth, is_refusal

log = logging.getLogger(__name__)

ALIASES_KEY = "dir_aliases"


# A record the store refuses for now is retried without end (it is journaled and later
# records wait on it): 1 s after the first failure, doubling up to 30 s.
METALOG_RETRY = RetryPolicy(attempts=None, base_delay=1.0, max_delay=30.0)


class OpDropped(Exception):
    """The record has nothing left to apply (what it would change is gone for a reason
    that loses nothing, e.g. an entry removed by this node's own later step)."""


class Blocked(Exception):
    """The record cannot be applied yet (a file below it still failing to upload, a
    record this version cannot read): kept, retried, shown in ``status``."""


class MetaLog:
    def __init__(self, ns: Namespace, policy: RetryPolicy = METALOG_RETRY,
                 on_done: Callable[[], None] = lambda: None,
                 health: StoreHealth | None = None) -> None:
        self.ns = ns
        self.health = health if health is not None else StoreHealth()
        self.policy = policy            # its backoff only: a record is never given up
        self.on_done = on_done          # told after each record (the publish queue's gate)
        self.pending: dict[int, dict] = {}
        self.busy: Counter[int] = Counter()
        self.failing: dict[int, str] = {}     # seq -> last error, while retried
        # seq -> what the store (or this node) refuses about it: no retry will change
        # that, an operator must (``ckptfs wait`` answers at once, later records wait)
        self.refused: dict[int, str] = {}
        self.tries = 0                       # failed attempts so far (any record)
        self._try_now = trio.Event()         # set: end the back-off of a refused record
        self.dropped = 0
        raw = ns.meta_get(ALIASES_KEY)
        self.aliases: dict[str, str] = json.loads(raw) if raw else {}
        self._changed = trio.Event()
        # The newest record added in the open namespace batch, not in ``pending`` until
        # that commits: a publish journaled after it in the same batch follows it.
        self._added_uncommitted = 0
        for seq, record in ns.journal():
            if record.get("op") == "meta":
                self.pending[seq] = record
                self.busy.update(record.get("dirs", ()))

    # ------------------------------------------------------------------ adding

    def add(self, record: dict, dirs: Iterable[int]) -> int:
        record = {**record, "op": "meta", "dirs": sorted(set(dirs))}
        seq = self.ns.journal_add(record)

        def pending() -> None:      # once on disk (a namespace batch may still fail)
            self._added_uncommitted = 0
            self.pending[seq] = record
            self.busy.update(record["dirs"])
            self._wake()

        def rolled_back() -> None:
            self._added_uncommitted = 0
        self._added_uncommitted = seq
        self.ns.on_rollback(rolled_back)
        self.ns.after_commit(pending)
        return seq

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # ------------------------------------------------------------------ questions

    def epoch(self) -> int:
        """The epoch of a publish closed now: the newest pending record -- one added
        in the open batch too (a rename's record, then the publish of the version the
        renamed file took: in log order) -- or 0."""
        if self._added_uncommitted:
            return self._added_uncommitted
        return next(reversed(self.pending)) if self.pending else 0

    def done_through(self, epoch: int) -> bool:
        return not self.pending or self._oldest() > epoch

    def _oldest(self) -> int:
        """``pending`` is kept in journal order (records are added with growing sequence
        numbers and loaded in key order): the oldest is its first key, the newest its
        last, with no scan (the publish queue asks this for every inode it hands out)."""
        return next(iter(self.pending))

    def is_busy(self, dir_ino: int) -> bool:
        return self.busy.get(dir_ino, 0) > 0

    def pending_of(self, kind: str, ino: int) -> bool:
        return any(r.get("kind") == kind and r.get("ino") == ino
                   for r in self.pending.values())

    async def wait_through(self, epoch: int) -> None:
        """Until every record up to ``epoch`` is applied."""
        while not self.done_through(epoch):
            await self._changed.wait()

    async def wait_idle(self) -> None:
        while self.pending:
            await self._changed.wait()

    # ------------------------------------------------------------------ directory ids

    def resolve(self, dir_id: str) -> str:
        seen = 0
        while dir_id in self.aliases and seen < 64:
            dir_id = self.aliases[dir_id]
            seen += 1
        return dir_id

    def alias(self, old: str, new: str) -> None:
        self.aliases[old] = new
        self.ns.meta_put(ALIASES_KEY, json.dumps(self.aliases))

    # ------------------------------------------------------------------ the worker

    async def run(self, execute: Callable[[int, dict], Awaitable[None]],
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            if not self.pending:
                await self._changed.wait()
                continue
            seq = self._oldest()
            attempt = 0
            while True:
                record = self.pending[seq]     # ``update`` may have changed it
                try:
                    await execute(seq, record)
                    self.health.succeeded()
                    break
                except OpDropped as exc:
                    self.dropped += 1
                    log.info("%s: nothing left to apply (%s)", describe(record), exc)
                    break
                except Exception as exc:  # noqa: BLE001 - kept journaled, retried
                    attempt += 1
                    await self._failed(seq, record, exc, attempt)
            self._finish(seq)

    async def _failed(self, seq: int, record: dict, exc: Exception, attempt: int) -> None:
        """A failed attempt: kept, said once, retried after the policy's back-off
        (never dropped: the rule of decision 0016)."""
        if self.pending.get(seq, {}).pop("retry_now", False):
            return      # changed to be tried again at once (a conflict renamed it)
        self.tries += 1
        outage = self.health.failed(exc)
        delay = self.policy.delay(attempt)
        stuck = outage is None and (is_refusal(exc) or store_cause(exc) is None)
        # (for ``wait``: what only an operator changes -- the store refusing the request,
        # or a record blocked behind a refused upload; not a race another try may win)
        if outage is None and (is_refusal(exc) or isinstance(exc, Blocked)):
            self.refused[seq] = f"{describe(record)}: {exc}"
        else:
            self.refused.pop(seq, None)
        if seq not in self.failing:
            if stuck:
                log.error("%s cannot be applied (%s); kept journaled and retried every "
                          "%.0f s at most, later records wait: needs an operator",
                          describe(record), exc, self.policy.max_delay)
            else:
                log.warning("%s waits for the store (%s); retrying every %.0f s at most",
                            describe(record), exc, self.policy.max_delay)
        self.failing[seq] = f"needs an operator (retried every {self.policy.max_delay:.0f} s " \
            f"at most): {exc}" if stuck else str(exc)
        with trio.move_on_after(delay):
            await self._try_now.wait()
        self._try_now = trio.Event()

    async def try_refused_again(self, timeout: float = 15.0) -> None:
        """The record the store refused is tried again now, not at the end of its
        back-off (an operator may have fixed the store: ``ckptfs wait`` asks before it
        says so); returns once that attempt ended, or after ``timeout``."""
        if not self.refused:
            return
        seq, tries = next(iter(self.refused)), self.tries
        self._try_now.set()
        with trio.move_on_after(timeout):
            while self.tries == tries and seq in self.pending:
                await trio.sleep(0.02)

    def update(self, seq: int, record: dict) -> None:
        """Change a pending record (a conflict renamed what it creates), in the journal
        too, before it is tried again."""
        self.ns.journal_put(seq, record)
        before = self.pending.get(seq)
        self.pending[seq] = record
        if before is not None:      # (in a batch that fails, the journal keeps it too)
            self.ns.on_rollback(lambda: self.pending.__setitem__(seq, before))

    def _finish(self, seq: int) -> None:
        record = self.pending.pop(seq)
        self.failing.pop(seq, None)
        self.refused.pop(seq, None)
        self.ns.journal_done(seq)
        self.busy.subtract(record.get("dirs", ()))
        self.busy = +self.busy
        self._wake()
        self.on_done()


def describe(record: dict) -> str:
    """``move of 'tmp-1' to 'ckpt-1' (inode 2)``: a record as the log says it."""
    def name(field: str) -> str:
        try:
            return repr(bytes.fromhex(str(record.get(field, ""))).decode(errors="replace"))
        except ValueError:
            return repr(str(record.get(field)))
    to = f" to {name('to_name')}" if "to_name" in record else ""
    return f"{record.get('kind', '?')} of {name('name')}{to} (inode {record.get('ino')})"

