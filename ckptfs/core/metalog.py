"""Applying async mode's metadata log records to the store, in order (decision 0012): mkdir
(and joining another node's directory), move, delete, seal."""

from __future__ import annotations

import errno
import logging
import time
import uuid

from ..errors import FsError
from ..meta.namespace import Inode
from ..meta.oplog import Blocked, OpDropped
from ..format.remote import MAX_CHUNK_SIZE, BadEntry, Entry, entry_key
from ..store import NotFound

from . import unsure
from .conflicts import CONFLICT_NAMES, NameTaken, keep_under_own_name, records_follow
from .entries import content_entry, entry_identity
from .joined import join_dir
from .linkcount import count_out_link
from .state import CoreState, dir_id_of
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .entries import EntryIO
    from .seal import Seal
    from .moves import EntryMoves
    from .removals import DirRemovals


log = logging.getLogger(__name__)


class MetaLogApply:
    """Applies async mode's metadata log to the store; no state of its own."""

    def __init__(self, st: CoreState, *, entries: EntryIO, removals: DirRemovals,
                 seals: Seal, moves: EntryMoves,
                 through_link: Callable[[Inode, str], Awaitable[bool]]) -> None:
        self.st = st
        self.through_link = through_link    # Publish._save_through_link
        self.entries = entries
        self.removals = removals
        self.seals = seals
        self.moves = moves

    # ------------------------------------------------------------------ the metadata log

    async def _execute_meta(self, seq: int, record: dict) -> None:
        """Apply one record of the metadata log to the store (oplog.py)."""
        await self.st._recovered.wait()
        kind = record.get("kind")
        if kind == "mkdir":
            await self._exec_mkdir(seq, record)
        elif kind == "move":
            await self._exec_move(seq, record)
        elif kind == "delete" and str(_dir_ident(record)).startswith("dir:"):
            # An rmdir (of a directory the store has, or may have: its mkdir's answer
            # was lost): undone in the store if another node wrote into it meanwhile
            # (the next listing here shows it again).
            try:
                await self.removals.remove_dir(self._logged_key(record), _dir_ident(record),
                                               journaled=True)
            except FsError as exc:
                if exc.errno != errno.ENOENT:
                    raise
                log.info("rmdir not applied: %s (its rename comes first)", exc)
        elif kind == "delete":
            await self.entries._delete_if_same(self._logged_key(record), record.get("ident"),
                                               *record.get("unsure", ()))
        elif kind == "seal":
            await self._exec_seal(seq, record)
        elif kind == "put":
            await self._exec_put(record)
        elif kind == "attrs":
            await self._exec_attrs(record)
        else:
            raise Blocked(f"unknown record kind {kind!r} (written by a newer ckptfs?)")

    def _logged_key(self, record: dict, dir_field: str = "parent_id",
                    name_field: str = "name") -> str:
        return entry_key(self.st.oplog.resolve(record[dir_field]),
                         bytes.fromhex(record[name_field]))

    async def _exec_mkdir(self, seq: int, record: dict) -> None:
        ino = record["ino"]
        key = self._logged_key(record)
        async with self.st._rt(ino).lock:      # an rmdir meanwhile waits, then sees it
            inode = self.st.ns.maybe_get(ino)
            if inode is None or inode.type != "dir" or inode.published or not inode.parent:
                return   # removed here before it reached the store: nothing to create
            # The name was free in this node's listing when the mkdir was journaled
            # (``Names._check_absent``): an empty object there is a torn write.  Noted
            # before it goes: an answer lost, an rmdir meanwhile takes what landed.
            unsure.note(self.st.ns, inode, key, self.entries._identity(inode)["ident"])
            created = await self.entries.put_new(key,
                                                 content_entry(inode).to_json(),
                                                 empty_is_free=True)
            unsure.answered(inode, key)
            if created is not None:
                inode.published, inode.remote_etag = True, created
                inode.listed_at, inode.attrs_unsent = time.time(), []     # sent with it
                self.st.ns.save(inode)
                await self.entries.landed(key)
            else:
                try:
                    await join_dir(self.st, self.entries, inode, key)
                except NameTaken as exc:
                    # Kept under a name of its own; the log tries that name next.
                    self._rename_to_conflict(seq, record, inode, str(exc))
                    raise Blocked(f"renamed after a conflict: {exc}") from None
        self.st._drop_rt(ino)

    def _rename_to_conflict(self, seq: int, record: dict, inode: Inode, why: str) -> None:
        """Another node's object holds the name this directory was made under: the
        directory keeps everything under a visible name of its own,
        ``NAME.ckptfs-conflict-<node>`` (said once), and its record is retried under it
        (decision 0016: a conflict never deletes)."""
        with self.st.ns.batch():     # the name here and the record: one commit
            name, tried = self._next_conflict_name(record, "name", inode, why, "directory")
            self.st.oplog.update(seq, {**record, "name": name.hex(), **tried,
                                       "retry_now": True})

    def _next_conflict_name(self, record: dict, field: str, inode: Inode | None, why: str,
                            what: str) -> tuple[bytes, dict]:
        """The next conflict name for a record whose name (``field``) was refused, and
        the record's count of them: ``inode`` moves there on this node (None: it is
        elsewhere here, and the name only says where the store keeps it meanwhile).
        Refused ``CONFLICT_NAMES`` times: Blocked, kept and retried (status says so)."""
        wanted, tried = record.get("conflict", (record[field], 0))
        if tried >= CONFLICT_NAMES:
            raise Blocked(f"{why}; no free conflict name")
        if inode is not None:
            name = keep_under_own_name(self.st, inode, why, what,
                                       name_of=bytes.fromhex(wanted), first=tried + 1)
        else:
            name = bytes.fromhex(wanted) + b".ckptfs-conflict-" + \
                self.st.leases.node_id.encode()[:12] + b"-" + \
                str(record.get("ino", 0)).encode() + b"-" + str(tried + 1).encode()
            log.warning("%s; this node's %s, renamed on since, goes on from %s", why, what,
                        name.decode(errors="replace"))
        return name, {"conflict": [wanted, tried + 1]}

    async def _wait_publishes_before(self, seq: int, dir_ino: int) -> None:
        """Until the uploads below a directory closed before record ``seq`` are in the
        store (failed-for-good ones excepted: they never will be)."""
        while True:
            older = [ino for ino in self.st.queue.active()
                     if self.st._publish_epoch.get(ino, 0) < seq]
            if not self.seals._pending_under(dir_ino, older):
                return
            await self.st.queue.wait_change()

    async def _exec_move(self, seq: int, record: dict) -> None:
        if record.get("count_out"):     # moved over a link already (_move_over_link)
            await count_out_link(self.entries, record["count_out"],
                                 record.get("count_id"))
            return
        ino = record["ino"]
        old_key = self._logged_key(record)
        new_key = self._logged_key(record, "to_id", "to_name")
        replaced = (record.get("replaced") or {}).get("ident")
        if record.get("type") == "dir":
            await self._wait_publishes_before(seq, ino)
        inode = self.st.ns.maybe_get(ino)
        if inode is None or self._removed_since(inode):
            await self._move_of_removed(record, old_key, new_key, replaced)
            return
        seals = bool(record.get("seals")) and inode.staged and \
            not self.seals._pending_under(ino, list(self.st.queue.failed))
        if seals and not await self.st.leases.may_seal(ino):
            seals = False    # other nodes still write below it: pending (leases.py)
        async with self.st._rt(ino).lock:
            now = self.st.ns.maybe_get(ino)
            if now is None or self._removed_since(now):   # while this waited for the lock
                seals = False
                await self._move_of_removed(record, old_key, new_key, replaced)
            else:
                inode = now
                # A file moves only over what it replaced here, or what this node sent
                # there since (its own later save): never over another node's newer save.
                expect = None if inode.type == "dir" else \
                    {i for i in (replaced, *record.get("target_unsure", ()),
                                 *record.get("target_held", ()),
                                 *unsure.under(inode, new_key)) if i}
                try:
                    seals, _ = await self._move_locked(inode, old_key, new_key, seals,
                                                       replaced, expect)
                except NameTaken as exc:
                    # (a conflict name taken too: the next one, never "saved over")
                    if exc.found is None or exc.found[0].type not in ("file", "link") \
                            or self._moved_on_since(seq, ino) \
                            or record.get("conflict"):
                        self._move_to_conflict(seq, record, inode, str(exc))
                        raise Blocked(f"renamed after a conflict: {exc}") from None
                    if exc.found[0].type == "link":
                        assert expect is not None     # (a file's move)
                        seals, record = await self._move_over_link(
                            seq, record, inode, (old_key, new_key), seals, replaced,
                            expect, exc.found[0])
                    else:
                        await self._saved_over_after_the_rename(record, inode, old_key,
                                                                *exc.found)
        self.st._drop_rt(ino)
        if record.get("count_out"):
            await count_out_link(self.entries, record["count_out"],
                                 record.get("count_id"))
        if seals:
            self.seals._sealed(inode)

    async def _move_over_link(self, seq: int, record: dict, inode: Inode,
                              keys: tuple[str, str], seals: bool, replaced: str | None,
                              expect: set[str], link: Entry) -> tuple[bool, dict]:
        """Another node renamed a hard-linked file's name onto the name this file was
        renamed to, after the rename was made here (soak seed 1215583).  The serial order
        is that rename, then this one: this file replaces the link (as a rename over a
        linked name does), and the link is counted out of its shared object -- after the
        move, by this node, whose write replaced it (``linkcount.py``).  The count is
        noted in the record before it is made, so that a retry counts it out once and
        moves nothing; a crash between the move and that note leaves the count one too
        high (the object outlives its names: nothing is lost)."""
        seals, gone = await self._move_locked(inode, *keys, seals, replaced,
                                              expect | {entry_identity(link)})
        if gone is not None and gone.type == "link" and gone.link == link.link:
            record = {**record, "count_out": link.link, "count_id": uuid.uuid4().hex}
            self.st.oplog.update(seq, record)
            log.info("%s: another node renamed a hard-linked name there after this node's "
                     "rename to it; this file replaces it", self.st._path_for_log(inode))
        return seals, record

    async def _move_locked(self, inode: Inode, old_key: str, new_key: str, seals: bool,
                           replaced: str | None, expect: set[str] | None
                           ) -> tuple[bool, Entry | None]:
        """The store steps of a move, under the inode's lock: whether it sealed, and
        the entry it replaced under the new key (None: none)."""
        ino = inode.ino
        gone: Entry | None = None
        try:
            gone = await self.moves.move_entry(inode, old_key, new_key, seals, expect)
        except FsError as exc:
            if exc.errno == errno.ENOTEMPTY:
                # Over a directory another node wrote into meanwhile (decision 0028):
                # as if this rename had come first and failed; both stay as they are.
                log.warning("rename to %s lost a race: another node wrote into that "
                            "directory first; %s stays", new_key, old_key)
                self.st._touch_dir(inode.parent)
                self.st.ns.save(inode)
                return False, None
            if exc.errno != errno.ENOENT:
                raise
            # Not in the store under its old name.  Never published there: its own
            # publish writes the new name (a file with no entry of its own yet holds
            # the entry it replaced instead: ``replaced`` is None, rename.py).
            # Published, so another node moved or removed it first: this rename lost
            # the race (as if it had come second), and the entry it would have
            # replaced stays.
            seals = False
            if inode.dirty or ino in self.st.queue.queued or not inode.published:
                log.debug("move %s -> %s: %s", old_key, new_key, exc.reason)
                await self.entries._delete_if_same(new_key, replaced)
            else:
                log.warning("rename to %s lost a race: another node moved or removed "
                            "%s first; what the store has stays", new_key, old_key)
        if seals:
            inode.staged = False
        self.st.ns.save(inode)
        return seals, gone

    async def _saved_over_after_the_rename(self, record: dict, inode: Inode, old_key: str,
                                           entry: Entry, etag: str) -> None:
        """Another node saved the name this file was renamed to after the rename was
        made here: the serial order is this rename, then that save over the name (its
        writer was told it is saved after this rename was).  So the name keeps that
        save, the old name goes, and this node's inode is the file the save wrote (its
        newer version: a version closed here since stays the newer one, decision 0005).
        As a late removal leaves a newer save (stop 41), a late rename never writes over
        one."""
        await self.entries._delete_if_same(old_key, record.get("ident"),
                                           *record.get("unsure", ()))
        self.entries._adopt_newer(inode, entry, etag)
        self.st.ns.save(inode)
        log.info("%s: another node saved it after this node's rename to it; that save "
                 "stays, as a save after the rename", self.st._path_for_log(inode))

    def _move_to_conflict(self, seq: int, record: dict, inode: Inode, why: str) -> None:
        """Another node made the name this file was renamed to something else after the
        rename (a directory, a symlink, a link: no serial order has both): that stays,
        and the moved file goes to ``NAME.ckptfs-conflict-<node>`` instead (decision
        0016: a conflict never deletes) -- on this node too.  Renamed on here since
        (also past another node's save there), the conflict name is only where the store
        keeps it until the later records move it on from there: they are changed to
        move it from that name."""
        to_id, to_name = self.st.oplog.resolve(record["to_id"]), record["to_name"]
        parent = self.st.ns.maybe_get(inode.parent) if inode.parent else None
        here = parent is not None and dir_id_of(parent) == to_id and \
            inode.name == bytes.fromhex(to_name) and not self._moved_on_since(seq, inode.ino)
        with self.st.ns.batch():     # the name here and the records: one commit
            name, tried = self._next_conflict_name(record, "to_name",
                                                   inode if here else None, why, "file")
            # (a chmod's record, a rename's on)
            records_follow(self.st, inode.ino, to_id, bytes.fromhex(to_name), name, seq)
            self.st.oplog.update(seq, {**record, "to_name": name.hex(), "replaced": None,
                                       "target_unsure": [], **tried, "retry_now": True})

    def _moved_on_since(self, seq: int, ino: int) -> bool:
        """A later record of the log, not done yet, moves this inode on."""
        return any(r.get("kind") == "move" and r.get("ino") == ino
                   for s, r in self.st.oplog.pending.items() if s > seq)

    @staticmethod
    def _removed_since(inode: Inode | None) -> bool:
        return inode is None or not inode.parent or bool(inode.link_id)

    async def _move_of_removed(self, record: dict, old_key: str, new_key: str,
                               replaced: str | None) -> None:
        """The moved name was removed here since (or hard-linked: its names are then
        written by its publish): what the store has under the old name goes (its
        delete, later in the log, looks under the name it had then)."""
        await self.entries._delete_if_same(old_key, record.get("ident"),
                                           *record.get("unsure", ()))
        await self.entries._delete_if_same(new_key, replaced)

    async def _exec_put(self, record: dict) -> None:
        """The entry of a name made here with no data (symlink, special file), under the
        name it had when it was made: later records of the log move it from there."""
        ino = record["ino"]
        key = self._logged_key(record)
        async with self.st._rt(ino).lock:
            inode = self.st.ns.maybe_get(ino)
            if inode is None or not inode.parent or inode.published:
                pass    # removed here before it reached the store: nothing to write
            elif inode.link_id:
                await self.entries._put_entry(inode)    # its shared object and every name
            else:
                entry = self.entries._entry_of(inode)
                # Noted before it goes (decision 0016): a removal meanwhile takes it.
                unsure.note(self.st.ns, inode, key, self.entries._identity(inode)["ident"])
                etag = await self.entries._store(self.st.store.put, key, entry.to_json())
                unsure.answered(inode, key)
                inode.published, inode.remote_etag, inode.attrs_unsent = True, etag, []
                self.st.ns.save(inode)
                await self.entries.landed(key)
        self.st._drop_rt(ino)

    async def _exec_attrs(self, record: dict) -> None:
        """A published entry's attributes (chmod, chown, utimens, xattrs), rewritten
        under the name the store has for it at this point of the log."""
        ino = record["ino"]
        key = self._logged_key(record)
        async with self.st._rt(ino).lock:
            inode = self.st.ns.maybe_get(ino)
            if inode is not None and inode.names and inode.published:
                try:
                    if inode.link_id:   # its shared object, whatever its names
                        await self.entries._rewrite_entry(inode)
                    else:
                        await rewrite_moving_on(self.st, self.entries, inode, key)
                except FsError as exc:
                    if exc.errno != errno.ENOENT:
                        raise
                    # Another node made the name a hard link meanwhile (soak seed
                    # 1215629: a utime racing a link was lost): the change is the
                    # linked file's, as on that node.  Renamed or removed first: the
                    # attributes go with the next publish of this node's version.
                    link = None if inode.link_id else await self._link_at(key)
                    if link is None or not await self.through_link(inode, link):
                        log.info("attributes of %s not rewritten: %s", key, exc.reason)
        self.st._drop_rt(ino)

    async def _link_at(self, key: str) -> str | None:
        """The shared object a link entry under ``key`` names, if that is what is there."""
        try:
            body, _ = await self.entries._store(self.st.store.get, key)
            entry = Entry.from_json(body, MAX_CHUNK_SIZE)
        except (NotFound, BadEntry):
            return None
        return entry.link if entry.type == "link" else None

    async def _exec_seal(self, seq: int, record: dict) -> None:
        started = time.monotonic()
        ino = record["ino"]
        await self._wait_publishes_before(seq, ino)
        inode = self.st.ns.maybe_get(ino)
        if inode is None or not inode.parent or not inode.staged or inode.type != "dir":
            self.st.sealed_here.discard(ino)
            return
        if self.seals._pending_under(ino, list(self.st.queue.failed)):
            raise Blocked("a file below is refused by the store: the seal waits for it")
        if not await self.st.leases.may_seal(ino):
            # Other nodes still write below it: pending (leases.py), and hidden here
            # again (it showed when they seemed done: one came back).
            if ino in self.st.sealed_here:
                self.st.sealed_here.discard(ino)
                self.st._touch_dir(inode.parent)
                self.st.invalidate(inode.parent)
            return
        key = self._logged_key(record)
        async with self.st._rt(ino).lock:
            inode = self.st.ns.maybe_get(ino)
            if inode is None or not inode.staged or not inode.parent:
                return      # removed (or sealed) here while this waited
            inode.staged, inode.sealed_at = False, time.time()
            try:
                await self.entries._rewrite_entry(inode, key)
            except BaseException as exc:
                inode.staged = True
                self.st.ns.save(inode)
                if isinstance(exc, FsError) and exc.errno == errno.ENOENT:
                    self.st.sealed_here.discard(ino)
                    raise OpDropped(exc.reason) from None
                raise
        self.st._drop_rt(ino)
        self.st.sealed_here.discard(ino)
        self.seals._sealed(inode)
        self.st.observe("seal", time.monotonic() - started)


def _dir_ident(record: dict) -> str | None:
    """The directory a ``delete`` record removes: its own, or one its mkdir sent
    unanswered (``unsure``)."""
    return record.get("ident") or next(iter(record.get("unsure") or ()), None)


async def rewrite_moving_on(st: CoreState, entries: EntryIO, inode: Inode, key: str) -> None:
    """The rewrite of ``_exec_attrs``; when another node's save came in while readers
    here hold the version before, the name went to a fresh inode (theirs stays:
    ``moved_from_its_readers``), and the attributes go on with it."""
    parent, name = inode.parent, inode.name
    try:
        await entries._rewrite_entry(inode, key, moves=True)
    except FsError as exc:
        fresh = st.ns.lookup(parent, name)
        if exc.errno != errno.ESTALE or fresh is None or fresh == inode.ino:
            raise
        moved = st.ns.get(fresh)
        moved.attrs_unsent = list(inode.attrs_unsent)
        async with st._rt(fresh).lock:
            await entries._rewrite_entry(moved, key)
        st._drop_rt(fresh)
