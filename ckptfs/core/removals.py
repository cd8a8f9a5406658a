"""Directories removed while other nodes write into them (decision 0028).

Another node's rmdir sees a directory empty when this node's name in it has not reached
the store yet (a file still open, a create in async mode's log, a rename on its way).
Without more, that name then lands under a directory id no entry names: no node shows it.

* ``remove_dir`` is rmdir's store step: it leaves a removal mark, ``removed/<dir-id>``
  (the key and the entry), deletes the entry if it is still that directory, then lists
  below it once more; a name found there brings the directory back.
* ``landed`` is what every write of a new name into a directory does after its PUT: it
  reads that directory's mark and, if there is one, brings the directory back -- with
  every removed parent, from their marks -- so no saved name is ever under no directory.
  The mark is written before the listing and read after the PUT, so of an rmdir and a
  write that cross, one always sees the other.  A directory another node *renamed*
  leaves no mark, and is never put back under its old name.
* ``was_removed`` is the same read for a rename, which takes its entry back instead.

Checks of one directory are shared: a read that started after a PUT finished answers for
it, so a burst of closes in one directory costs about one GET.  gc deletes marks older
than its grace period.

Knows the store, the remote format and ``EntryIO``'s store calls; the namespace only to
tell this node a directory came back.  Nothing of FUSE, handles, the publish queue or
the metadata log."""

from __future__ import annotations

import dataclasses
import errno
import functools
import itertools
import logging
import time
from dataclasses import dataclass, field

import trio

from ..errors import FsError
from ..format.remote import (MAX_CHUNK_SIZE, ROOT_DIR_ID, BadEntry, Entry, KeyTooLong,
                             RemovalMark, check_key_fits, decode_name, dir_id_of_key,
                             dir_prefix, entry_key, removed_key)
from ..store import NotFound, PreconditionFailed
from .entries import EntryIO, entry_identity
from .sentclaims import SentClaims
from .state import CoreState

log = logging.getLogger(__name__)

ATTEMPTS = 8
# Names a removed directory may come back under when its own is taken: beyond them
# something is making names on purpose, and its entries wait under no name for fsck.
RESTORED_NAMES = 32


@dataclass
class _Check:
    """One read of a directory's removal mark, shared by every landing it covers."""

    started: int | None = None      # the clock when its GET was about to go out
    done: trio.Event = field(default_factory=trio.Event)
    removed: bool = False
    failed: bool = False


@dataclass
class _Slot:
    running: _Check | None = None
    queued: _Check | None = None


class DirRemovals:
    """rmdir's marks and the writers' checks of them; no state but the checks in
    flight."""

    def __init__(self, st: CoreState, entries: EntryIO) -> None:
        self.st = st
        self.entries = entries
        self._clock = itertools.count()
        self._slots: dict[str, _Slot] = {}
        self._sent_claims = SentClaims()     # (one whose reply was lost is ours)

    # ------------------------------------------------------------------ writers

    async def landed(self, key: str) -> None:
        """After a new name's entry was written under ``key``: if its directory was
        removed meanwhile, bring it back (with its removed parents)."""
        dir_id = dir_id_of_key(key)
        if dir_id is None or dir_id == ROOT_DIR_ID:
            return
        if await self._checked(dir_id, next(self._clock)):
            log.warning("%s landed in a directory another node removed meanwhile: the "
                        "directory is back", key)

    async def was_removed(self, key: str) -> bool:
        """After a rename wrote ``key``: whether its directory was removed meanwhile
        (the rename then takes its entry back and answers ENOENT)."""
        dir_id = dir_id_of_key(key)
        if dir_id is None or dir_id == ROOT_DIR_ID:
            return False
        try:
            body, _ = await self.entries._store(self.st.store.get, removed_key(dir_id))
        except NotFound:
            return False
        try:
            mark = RemovalMark.from_json(body, dir_id)
        except BadEntry:
            return True
        # Its entry still (or again) there: an rmdir before its delete, or one that
        # found a name below and is putting it back.  Its last listing comes after this
        # PUT, so it sees the moved name: the move stays (the rmdir answers ENOTEMPTY).
        return not await self._is_there(mark.key, dir_id)

    async def came_back(self, key: str, wait: float = 0.5) -> bool:
        """After a rename took its entry under ``key`` back from a removed directory:
        whether that directory comes back within ``wait`` seconds (an rmdir whose last
        listing saw the entry before it was taken back puts it back; the rename then
        goes again, so that one of the two succeeds, never neither)."""
        dir_id = dir_id_of_key(key)
        if dir_id is None or dir_id == ROOT_DIR_ID:
            return False
        deadline = trio.current_time() + wait
        while True:
            await trio.sleep(wait / 10)     # ``was_removed`` has just looked
            try:
                body, _ = await self.entries._store(self.st.store.get, removed_key(dir_id))
                mark = RemovalMark.from_json(body, dir_id)
            except NotFound:
                return True         # put back, mark and all
            except BadEntry:
                return False
            if await self._is_there(mark.key, dir_id):
                return True
            if trio.current_time() >= deadline:
                return False

    async def _is_there(self, key: str, dir_id: str) -> bool:
        """Whether ``key`` holds directory ``dir_id``'s entry."""
        try:
            body, _ = await self.entries._store(self.st.store.get, key)
            there = Entry.from_json(body, MAX_CHUNK_SIZE)
        except (NotFound, BadEntry):
            return False
        return there.type == "dir" and there.id == dir_id

    async def _checked(self, dir_id: str, ticket: int) -> bool:
        """Whether a check of ``dir_id`` that started after ``ticket`` found it removed
        (and brought it back): one in flight that started later answers, else the next
        one, run by the first landing that needs it."""
        while True:
            slot = self._slots.setdefault(dir_id, _Slot())
            running = slot.running
            if running is not None and running.started is not None and \
                    running.started > ticket:
                check = running
            elif slot.queued is not None:
                check = slot.queued
            else:
                return await self._run_next(dir_id, slot)
            await check.done.wait()
            if not check.failed:
                return check.removed
            # Its runner failed or was cancelled: this landing checks again itself.

    async def _run_next(self, dir_id: str, slot: _Slot) -> bool:
        check = slot.queued = _Check()
        try:
            while slot.running is not None:
                await slot.running.done.wait()
            slot.queued, slot.running = None, check
            check.started = next(self._clock)
            check.removed = await self.bring_back(dir_id)
            return check.removed
        except BaseException:
            check.failed = True
            raise
        finally:
            if slot.queued is check:
                slot.queued = None
            if slot.running is check:
                slot.running = None
            check.done.set()
            if slot.running is None and slot.queued is None and \
                    self._slots.get(dir_id) is slot:
                del self._slots[dir_id]

    async def bring_back(self, dir_id: str) -> bool:
        """Put back directory ``dir_id`` from its removal mark, then its parents from
        theirs, up to one that has none.  True when a directory came back."""
        brought, seen = False, set()
        while dir_id != ROOT_DIR_ID and dir_id not in seen:
            seen.add(dir_id)
            mark_key = removed_key(dir_id)
            try:
                body, etag = await self.entries._store(self.st.store.get, mark_key)
            except NotFound:
                return brought
            try:
                mark = RemovalMark.from_json(body, dir_id)
            except BadEntry as exc:
                log.error("unreadable removal mark %s (%s): left as it is", mark_key, exc)
                return brought
            if not await self._restore(mark, dir_id, etag):
                # Its entry is still there: an rmdir between its mark and its delete
                # (whose last listing comes after this node's PUT, so it sees it), or
                # one that died there (gc ends that mark).  Nothing to do, and the
                # mark stays: deleting it would leave that rmdir without one.
                return brought
            brought = True
            dir_id = dir_id_of_key(mark.key) or ROOT_DIR_ID
        return brought

    async def _restore(self, mark: RemovalMark, dir_id: str, mark_etag: str | None) -> bool:
        """The directory's entry back from ``mark``, then the mark deleted (If-Match
        ``mark_etag``: a newer rmdir's mark stays).  False when its entry was still
        there and nothing was done."""
        if not await self._put_back(mark, dir_id):
            return False
        if mark_etag is not None:
            try:
                await self.entries._store(functools.partial(
                    self.st.store.delete, removed_key(dir_id), if_match=mark_etag))
            except PreconditionFailed:
                pass
        return True

    async def _put_back(self, mark: RemovalMark, dir_id: str) -> bool:
        """The directory's entry under the key it had; under a name of its own beside
        it when another object took that name meanwhile (``<name>.restored-<id8>``,
        then ``-2``, ``-3``, … while those are taken too).  False when it is there
        already (an rmdir not past its delete, or put back by another writer)."""
        keys = [mark.key] + [self._beside(mark.key, dir_id, n)
                             for n in range(1, RESTORED_NAMES + 1)]
        for key in keys:
            for _ in range(ATTEMPTS):
                if await self.entries.put_new(key, mark.entry.to_json()):
                    log.warning("directory %s was removed by another node while this "
                                "node wrote into it: it is back at %s", dir_id, key)
                    self._touch(key)
                    return True
                try:
                    body, _ = await self.entries._store(self.st.store.get, key)
                except NotFound:
                    continue        # deleted between the two calls: try again
                try:
                    there = Entry.from_json(body, MAX_CHUNK_SIZE)
                except BadEntry:
                    break
                if there.type == "dir" and there.id == dir_id:
                    return False
                break               # another object has that name
        log.error("directory %s was removed while this node wrote into it, and none of "
                  "%s … %s is free: its entries stay in the store under no name "
                  "(ckptfs fsck lists them)", dir_id, keys[0], keys[-1])
        return True     # nothing more this node can do: the mark goes, the log says it

    @staticmethod
    def _beside(key: str, dir_id: str, number: int = 1) -> str:
        """``<name>.restored-<id8>`` (``-<number>`` after it from 2 on) in the same
        directory, the name cut to fit a key."""
        parent = dir_id_of_key(key) or ROOT_DIR_ID
        name = decode_name(key[len(dir_prefix(parent)):])
        suffix = f".restored-{dir_id[:8]}{f'-{number}' if number > 1 else ''}".encode()
        for cut in (len(name), 200, 100):
            try:
                check_key_fits(parent, name[:cut] + suffix)
                return entry_key(parent, name[:cut] + suffix)
            except KeyTooLong:
                continue
        return entry_key(parent, suffix)

    def _touch(self, key: str) -> None:
        parent = dir_id_of_key(key)
        ino = self.st.ns.ino_of_dir_id(parent) if parent else None
        if ino is not None:
            self.st._touch_dir(ino)

    # ------------------------------------------------------------------ rmdir

    async def remove_dir(self, key: str, ident: str | None, journaled: bool = False) -> bool:
        """rmdir's store step: claim the entry under ``key`` if it still holds the
        directory ``ident`` names (as a rename claims its source: a rename meanwhile
        finds the claim and answers ENOENT), mark the directory removed, delete the
        entry, then look below it once more: a name another node wrote there meanwhile
        brings it back.  False when it came back (a name arrived); ENOENT when another
        node's rename or rmdir holds it.

        ``journaled``: an rmdir already answered (async mode's metadata log).  One that
        finds an *rmdir's* live claim on the entry waits for that rmdir to end or its
        claim to expire, then goes on: the claim may be this node's own, left by a
        daemon killed between its claim and its delete, and the replayed record must
        still remove the directory (soak seed 1215043: it was dropped, and the
        directory came back).

        The claim this node sent is remembered until the call ends other than by a
        store error (EIO): tried again after a reply was lost, the rmdir finds that
        claim as its own instead of waiting for it (soak seed 1215537)."""
        try:
            done = await self._remove_dir(key, ident, journaled)
        except FsError as exc:
            if exc.errno != errno.EIO:
                self._sent_claims.forget(key)
            raise
        self._sent_claims.forget(key)
        return done

    async def _remove_dir(self, key: str, ident: str | None, journaled: bool) -> bool:
        """The store steps of ``remove_dir``."""
        if not ident:
            return True
        marked: tuple[str, str] | None = None      # the mark this call wrote, its ETag
        attempts, waited = 0, False
        while attempts < ATTEMPTS:
            attempts += 1
            try:
                body, etag = await self.entries._store(self.st.store.get, key)
            except NotFound:
                return True         # removed already (its remover's mark stays)
            try:
                entry = Entry.from_json(body, MAX_CHUNK_SIZE)
            except BadEntry:
                return True         # not ours to judge: left for gc and the log
            if entry_identity(entry) != ident or entry.id is None:
                log.info("%s holds another object now: left as it is", key)
                await self._unmark(marked)
                return True
            own = self._sent_claims.own(key, entry) and \
                entry.moving_to == removed_key(entry.id)
            if entry.claim_is_live(time.time(), self.st.config.rename_claim_ttl) and not own:
                if journaled and entry.moving_to == removed_key(entry.id):
                    await self._until_claim_may_end(key, entry, said=waited)
                    waited, attempts = True, attempts - 1
                    continue
                # Another node is renaming (or removing) it: that comes first.  Deleting
                # a rename's claimed entry and putting it back would leave its id under
                # two names.
                await self._unmark(marked)
                raise FsError.enoent(f"{key} is being renamed or removed by another node")
            entry.moving_to, entry.moving_at = None, 0.0
            mark_key = removed_key(entry.id)
            if not own:     # (this node's claim, its reply lost: ``etag`` is the claim's)
                claim = dataclasses.replace(entry, moving_to=mark_key, moving_at=time.time())
                self._sent_claims.sent(key, claim.moving_at)
                try:
                    etag = await self.entries._store(functools.partial(
                        self.st.store.put, key, claim.to_json(), if_match=etag))
                except PreconditionFailed:
                    continue
            marked = mark_key, await self.entries._store(
                self.st.store.put, mark_key, RemovalMark(key, entry).to_json())
            try:
                await self.entries._store(functools.partial(self.st.store.delete, key,
                                                            if_match=etag))
            except PreconditionFailed:
                continue            # our claim outlived its TTL and was taken
            return await self._look_below(key, entry, marked[1])
        raise FsError(errno.EIO, f"{key} keeps changing; not removed")

    async def _until_claim_may_end(self, key: str, entry: Entry, said: bool) -> None:
        """A pause while an rmdir's claim on ``key`` is live: at most a second, so an
        rmdir that ends is seen soon, and no longer than until the claim expires."""
        left = entry.moving_at + self.st.config.rename_claim_ttl - time.time()
        if not said:
            log.info("%s is claimed by an rmdir (another node's, or this node's own from "
                     "before a restart): this journaled rmdir waits up to %.0f s for it",
                     key, max(left, 0.0))
        await trio.sleep(min(1.0, max(left, 0.0) + 0.05))

    async def _look_below(self, key: str, entry: Entry, mark_etag: str) -> bool:
        """After the delete: a name found below brings the directory back (its own
        entry, which a writer may have put back already, then any parent another rmdir
        removed meanwhile).  False when it came back."""
        assert entry.id is not None
        prefix = dir_prefix(entry.id)
        child = await self.entries._store(
            lambda: next(iter(self.st.store.list(prefix)), None))
        if child is None:
            return True
        log.info("%s not removed: another node wrote %s into it meanwhile", key, child.key)
        await self._restore(RemovalMark(key, entry), entry.id, mark_etag)
        await self.bring_back(dir_id_of_key(key) or ROOT_DIR_ID)
        return False

    async def _unmark(self, marked: tuple[str, str] | None) -> None:
        if marked is None:
            return
        try:
            await self.entries._store(functools.partial(self.st.store.delete, marked[0],
                                                        if_match=marked[1]))
        except PreconditionFailed:
            pass
