"""Moving one published entry between two keys of the store, safe against other nodes:
decision 0006's claim, copy and conditional delete, with the target written as a
compare-and-swap too (decision 0006, addendum "crossing renames"), and the replay of a
move a crash cut short.

Two nodes renaming two names onto each other at once (A: f0 -> f1, B: f1 -> f0) each
claim their own source; a move whose target carries another rename's live claim gives
its own claim back and starts again after a random pause, and a target that changed
between reading it and writing it does the same.  So one of the two moves finishes
first and the other then moves what the first left: one serial order's result.

Knows the store, entries (``EntryIO``), the journal and the settings; nothing of FUSE,
the namespace's tree, the metadata log's order or held names."""

from __future__ import annotations

import errno
import functools
import logging
import random
import time

import trio

from ..errors import FsError
from ..format.remote import MAX_CHUNK_SIZE, BadEntry, Entry
from ..meta.namespace import Inode
from ..store import NotFound, PreconditionFailed
from .conflicts import NameTaken
from .entries import EntryIO, entry_identity, same_object
from .removals import DirRemovals
from .sentclaims import SentClaims
from .state import CoreState

log = logging.getLogger(__name__)

# A move that keeps meeting a crossing rename gives way this many times less one (pauses
# of up to 10 ms, 20 ms, ... doubling: about 1.3 s in all); the last attempt writes the
# target whatever it holds (last writer wins, as before): a chain of renames is safe that
# way, only a cycle is not, and the other side of a cycle gives way too.
MOVE_ATTEMPTS = 8
FIRST_PAUSE = 0.01

ABSENT = ""     # the target's ETag when it has no entry


class CrossingRename(Exception):
    """The target is being renamed by another rename, or changed while this one wrote
    it; this move's claim was given back and nothing else changed."""


class EntryMoves:
    """The store steps of a rename; no state of its own but a random source for the
    pauses."""

    def __init__(self, st: CoreState, entries: EntryIO, removals: DirRemovals,
                 rng: random.Random | None = None) -> None:
        self.st = st
        self.entries = entries
        self.removals = removals
        self.rng = rng or random.Random()
        self._sent_claims = SentClaims()     # (one whose reply was lost is ours)

    async def move_entry(self, inode: Inode, old_key: str, new_key: str,
                         seals: bool = True, expect: set[str] | None = None
                         ) -> Entry | None:
        """Move ``inode``'s entry from ``old_key`` to ``new_key``: claim it (of two nodes
        renaming it, one wins; the other gets ENOENT), write it under the new key if the
        target is still what was read, then delete the old key only if it is still our
        claim (a newer version another node wrote there meanwhile stays).

        ``expect``: a rename made earlier and applied now (async mode's log) moves a
        file only over what it replaced when it was made (these identities; none: the
        name was free) or this node's own later save there.  Anything else under the
        new key was saved by another node since: ``NameTaken``, nothing changed.

        Returns the entry the move replaced under the new key (None: the name was free
        in the store, or the last attempt wrote over whatever was there), as read before
        the conditional write that replaced it."""
        for attempt in range(MOVE_ATTEMPTS):
            try:
                return await self._move_once(inode, old_key, new_key, seals,
                                             give_way=attempt < MOVE_ATTEMPTS - 1,
                                             expect=expect)
            except CrossingRename:
                pause = self.rng.uniform(0, FIRST_PAUSE * 2 ** attempt)
                log.debug("rename %s -> %s crosses another rename; again in %.3f s",
                          old_key, new_key, pause)
                await trio.sleep(pause)
        raise FsError(errno.EIO, f"{new_key} keeps changing; rename not done")

    async def _move_once(self, inode: Inode, old_key: str, new_key: str, seals: bool,
                         give_way: bool, expect: set[str] | None = None) -> Entry | None:
        claim_etag, found = await self.claim(inode, old_key, new_key, found_ok=True,
                                             give_way=give_way)
        found.moving_to, found.moving_at = None, 0.0
        # Another file where this one's name was (one of them hard-linked): moved as is.
        foreign = found if bool(inode.link_id) != (found.type == "link") else None
        try:
            target, replaced = await self._target_etag(inode, new_key, old_key, give_way,
                                                       expect)
        except (FsError, NameTaken):  # a directory another node wrote into; a newer save
            await self._give_back(inode, old_key, claim_etag, foreign)
            raise
        if target is None:
            await self._give_back(inode, old_key, claim_etag, foreign)
            raise CrossingRename()
        if not give_way and target != ABSENT:
            # The last attempt writes whatever is there: what it replaced is not known
            # then (a link counted out on a guess could be counted out twice, and its
            # object go while another name links it; uncounted, it outlives its names).
            target, replaced = None, None
        if seals and inode.staged and inode.type == "dir":
            inode.sealed_at = time.time()       # retention orders by seal time
        moved = foreign or self.entries._entry_of(inode)
        moved.staged = moved.staged and not seals
        body = moved.to_json()
        # Journal the rest: a crash from here on is finished on restart, so a reader may
        # briefly see both names, never neither.
        seq = self.st.ns.journal_add({"op": "rename", "put": new_key, "body": body.decode(),
                                      "delete": old_key, "claim": claim_etag,
                                      "target": target})
        await self.st._sync_journal()
        try:
            new_etag = await self._put_target(new_key, body, target)
        except BaseException:
            self.st.ns.journal_done(seq)  # the claim expires; the old name stays valid
            raise
        if new_etag is None:
            self.st.ns.journal_done(seq)
            await self._give_back(inode, old_key, claim_etag, foreign)
            raise CrossingRename()
        if await self.removals.was_removed(new_key):
            await self._take_back(new_key, new_etag)
            self.st.ns.journal_done(seq)
            await self._give_back(inode, old_key, claim_etag, foreign)
            if await self.removals.came_back(new_key):
                raise CrossingRename()      # the rmdir saw this entry first: again
            raise FsError.enoent(f"the directory of {new_key} was removed by another node")
        await self.delete_claimed(old_key, claim_etag)
        self.st.ns.journal_done(seq)
        if foreign is not None:
            # It moved another kind of entry than this inode's (a link another node
            # made of its name): its ETag is not this inode's, which the next listing
            # reads again instead -- taken for its own, it hid every later save of the
            # linked file from this node (soak seed 1215586).
            inode.remote_etag = None
        elif not inode.link_id:   # a linked inode's ETag is its inode object's
            inode.remote_etag = new_etag
        return replaced

    async def claim(self, inode: Inode, old_key: str, new_key: str,
                    found_ok: bool = False, give_way: bool = False) -> tuple[str, Entry]:
        """Steps 1-2 of decision 0006: read the entry at ``old_key``, adopt a newer
        version, and mark it as moving to ``new_key`` (compare-and-swap).  Returns the
        claim's ETag and the entry to move: the inode's own -- or, where another node's
        rename filled the name with a hard-linked file's name (or, for a name of a
        hard-linked file here, with a plain file), what it holds now, moved as it is, as
        a plain rename moves whatever file entry it finds (``found_ok``; otherwise
        ENOENT: never this inode's entry written over another file)."""
        for _ in range(8):
            entry, etag = await self.entries._current_entry(inode, old_key,
                                                            allow_link=found_ok)
            own = self._sent_claims.own(old_key, entry)
            if entry.claim_is_live(time.time(), self.st.config.rename_claim_ttl) and not own:
                if entry.moving_to != new_key:
                    raise FsError.enoent(f"{old_key} is being renamed by another node")
                # A live claim to the same new key: another node's identical rename, or
                # this one's own, cut short by a crash and replayed from the log.  The
                # other rename goes first (``give_way``: a pause, then again -- it is
                # gone then, and this one lost the race); only the last attempt takes
                # the claim over.  Taken over at once, the other rename's delete of the
                # old name failed on the new claim, and when this one then gave way
                # further on, both names stayed in the store for one directory.
                if give_way:
                    raise CrossingRename()
            found = bool(inode.link_id) != (entry.type == "link")   # another file's
            if found and not found_ok:
                raise FsError.enoent(f"{old_key} now names another file")
            if not inode.link_id and not found:
                self.entries._adopt_newer(inode, entry, etag)
            claim = entry if found else self.entries._entry_of(inode)
            claim.moving_to, claim.moving_at = new_key, time.time()
            self._sent_claims.sent(old_key, claim.moving_at)
            try:
                return await self.entries._store(
                    functools.partial(self.st.store.put, old_key, claim.to_json(),
                                      if_match=etag)), claim
            except PreconditionFailed:
                continue  # changed under us: read it again
        raise FsError(errno.EIO, f"{old_key} keeps changing; rename not done")

    async def _target_etag(self, inode: Inode, new_key: str, old_key: str,
                           give_way: bool, expect: set[str] | None = None
                           ) -> tuple[str | None, Entry | None]:
        """The target's ETag as the store has it now (``ABSENT`` for none), or None when
        another rename's live claim is on it and this move gives way; with the entry
        read there (None: none, or one that does not parse).  A directory there
        (a rename over an empty directory) is removed first, the way rmdir does
        (decision 0028): its mark tells a node whose name lands in it later to bring it
        back, instead of that name ending under no directory.  ``ENOTEMPTY`` when a name
        is found in it; ``NameTaken`` when ``expect`` does not know what is there
        (``move_entry``)."""
        try:
            body, etag = await self.entries._store(self.st.store.get, new_key)
        except NotFound:
            return ABSENT, None
        try:
            entry = Entry.from_json(body, MAX_CHUNK_SIZE)
        except BadEntry:
            return etag, None   # not an entry anyone renames: replaced like any target
        if give_way and entry.claim_is_live(time.time(), self.st.config.rename_claim_ttl):
            log.debug("%s is being renamed to %s by another rename: %s gives way",
                      new_key, entry.moving_to, old_key)
            return None, None
        if expect is not None and inode.type != "dir":
            own = self.entries._identity(inode)["ident"]
            if not same_object(entry, expect | {own}):
                raise NameTaken(f"another node saved {new_key} after this node's rename "
                                f"to it", found=(entry, etag))
        if entry.type == "dir" and entry.id and entry.id != inode.dir_id:
            if not await self.removals.remove_dir(new_key, entry_identity(entry)):
                raise FsError(errno.ENOTEMPTY, f"{new_key}: another node wrote into it")
            return ABSENT, None
        return etag, entry

    async def _put_target(self, key: str, body: bytes, target: str | None) -> str | None:
        """Write the moved entry under ``key`` if it still holds what was read (``target``:
        its ETag, ``ABSENT``; None for unconditionally, journals of older releases).  The
        new ETag, or None when the target changed."""
        if target is None:
            return await self.entries._store(self.st.store.put, key, body)
        if target == ABSENT:
            return await self.entries.put_new(key, body)
        try:
            return await self.entries._store(
                functools.partial(self.st.store.put, key, body, if_match=target))
        except PreconditionFailed:
            return None

    async def _take_back(self, key: str, etag: str) -> None:
        try:
            await self.entries._store(functools.partial(self.st.store.delete, key,
                                                        if_match=etag))
        except PreconditionFailed:
            pass     # written again since: that stays

    async def _give_back(self, inode: Inode, key: str, claim_etag: str,
                         found: Entry | None = None) -> None:
        """Take this move's claim off ``key`` again (compare-and-swap: whatever another
        node wrote there since stays); ``found``: the other file it claimed there."""
        await self.put_quietly(key, found or self.entries._entry_of(inode), claim_etag)

    async def put_quietly(self, key: str, entry: Entry, if_match: str) -> None:
        try:
            await self.entries._store(functools.partial(self.st.store.put, key, entry.to_json(),
                                                        if_match=if_match))
        except (FsError, PreconditionFailed) as exc:
            log.warning("could not release the claim on %s (%s): it expires", key, exc)

    async def delete_claimed(self, old_key: str, claim_etag: str) -> None:
        try:
            await self.entries._store(functools.partial(self.st.store.delete, old_key,
                                                        if_match=claim_etag))
        except PreconditionFailed:
            log.info("%s was written again by another node during a rename: that newer "
                     "version stays under the old name", old_key)

    async def replay(self, record: dict) -> None:
        """Finish a journaled move a crash cut short (recovery): the target written as
        the move read it -- or already written by the move itself -- then the old key
        deleted if still our claim.  A target another node changed since: the move is
        not done, and its claim expires (the old name stays valid)."""
        body = record["body"].encode()
        target = record.get("target")     # absent in journals of older releases
        if await self._put_target(record["put"], body, target) is None and \
                not await self._holds(record["put"], body):
            log.warning("an interrupted rename to %s was not finished: the target "
                        "changed since; %s stays", record["put"], record["delete"])
            if record.get("claim"):
                await self._release_logged_claim(record["delete"], record["claim"])
            return
        # Its directory removed meanwhile (or the move was taking its entry back when the
        # crash came): the directory comes back, the moved name is never under none.
        await self.entries.landed(record["put"])
        if record.get("claim"):
            await self.delete_claimed(record["delete"], record["claim"])
        else:
            await self.entries._store(self.st.store.delete, record["delete"])
        log.info("finished an interrupted rename to %s", record["put"])

    async def _holds(self, key: str, body: bytes) -> bool:
        try:
            current, _ = await self.entries._store(self.st.store.get, key)
        except NotFound:
            return False
        return bytes(current) == body

    async def _release_logged_claim(self, key: str, claim_etag: str) -> None:
        """Take a replayed move's claim off ``key`` if it is still there (the entry
        without its claim, compare-and-swap), so other nodes may rename it at once."""
        try:
            body, etag = await self.entries._store(self.st.store.get, key)
            if etag != claim_etag:
                return
            entry = Entry.from_json(body, MAX_CHUNK_SIZE)
        except (NotFound, BadEntry):
            return
        entry.moving_to, entry.moving_at = None, 0.0
        await self.put_quietly(key, entry, claim_etag)
