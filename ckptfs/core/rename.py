"""Rename and exchange (the store steps of a move are `moves.py`, decision 0006), and
async mode's local rename (decision 0012)."""

from __future__ import annotations

import errno
import functools
import logging
from contextlib import AsyncExitStack

import trio

from ..errors import FsError
from ..meta.namespace import ROOT_INO, Inode
from ..format.remote import Entry, entry_key
from ..store import PreconditionFailed
from . import unsure
from .critical import no_await
from .state import ALL_ATTRIBUTES, RENAME_EXCHANGE, RENAME_NOREPLACE, CoreState, dir_id_of
from .names import check_name_or_raise
from .entries import entry_identity
from .linger import linger_then_delete
from .linkcount import count_out_replaced
from .taken import holds_taken_version, leave_taken_version, take_closed_version
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .entries import EntryIO
    from .held import HeldEntries
    from .moves import EntryMoves
    from .names import Names
    from .refresh import Refresh
    from .seal import Seal
    from .publish import Publish


log = logging.getLogger(__name__)


RENAME_ATTEMPTS = 5


class TargetChanged(FsError):
    """The target name changed while a rename waited; nothing was changed yet."""

    def __init__(self) -> None:
        super().__init__(errno.EAGAIN, "the target changed while renaming")


class Rename:
    """Renames and exchanges; no state of its own."""

    def __init__(self, st: CoreState, *, entries: EntryIO, names: Names, refresher: Refresh,
                 seals: Seal, publisher: Publish, held: HeldEntries, moves: EntryMoves) -> None:
        self.st = st
        self.moves = moves
        self.held = held
        self.entries = entries
        self.names = names
        self.refresher = refresher
        self.seals = seals
        self.publisher = publisher

    # ------------------------------------------------------------------ rename

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int,
                     new_name: bytes,
                     flags: int) -> None:
        if flags & RENAME_EXCHANGE:
            if flags & RENAME_NOREPLACE:
                raise FsError(errno.EINVAL, "RENAME_EXCHANGE with RENAME_NOREPLACE")
            await self._exchange(old_parent, old_name, new_parent, new_name)
            return
        check_name_or_raise(new_name)
        # The kernel keeps other requests out of both directories, but this node's own
        # background work (a killed writer's file going, a listing) may change the
        # target while the rename waits: it is decided again, as if it came a moment
        # later, instead of failing with an errno no program expects from rename(2).
        for attempt in range(RENAME_ATTEMPTS):
            try:
                await self._rename(old_parent, old_name, new_parent, new_name, flags)
                return
            except TargetChanged:
                if attempt == RENAME_ATTEMPTS - 1:
                    raise
                log.debug("rename %r -> %r: the target changed meanwhile; again",
                          old_name, new_name)

    async def _rename(self, old_parent: int, old_name: bytes, new_parent: int,
                      new_name: bytes, flags: int) -> None:
        inode = await self.names.lookup(old_parent, old_name)
        new_dir = self.st._dir(new_parent)
        await self.refresher.refresh_dir(new_parent)
        self._refuse_move_into_itself(inode, new_parent)
        target_ino = self.st.ns.lookup(new_parent, new_name)
        target = self.st.ns.get(target_ino) if target_ino is not None else None
        if target is not None:
            if target.ino == inode.ino or (inode.link_id and target.link_id == inode.link_id):
                return      # two names of one file: rename(2) does nothing
            if await self.st.until_decided_at_release(target.ino):
                # Its close was being decided (a last release's): that save is the name's
                # until this rename, so the rename comes after it (take_closed_version).
                raise TargetChanged()
            if flags & RENAME_NOREPLACE:
                raise FsError(errno.EEXIST)
            if inode.type == "dir" and target.type != "dir":
                raise FsError(errno.ENOTDIR)
            if inode.type != "dir" and target.type == "dir":
                raise FsError(errno.EISDIR)
            if target.type == "dir":
                await self.refresher.refresh_dir(target.ino, force=not self.st._deferred())
                if self.st.ns.has_children(target.ino):
                    raise FsError(errno.ENOTEMPTY)
        if self.st._deferred() and not inode.link_id and \
                not (target is not None and target.link_id):
            await self._rename_local(inode, old_parent, old_name, new_parent, new_name)
            return
        if self.st._deferred():
            # The store steps below act at once: after the records pending now.
            await self.st.follow_the_log("rename")
            if self.st.ns.lookup(new_parent, new_name) != (target.ino if target else None):
                raise TargetChanged()
            target = self.st.ns.get(target.ino) if target is not None else None
        if inode.type == "dir":
            # The renamed tree must appear complete: let its pending uploads land first.
            await self.seals._wait_uploads_under(inode.ino)
        # Renaming a staged directory seals it, unless other nodes still write below it
        # (leases): then it moves, stays staged, and its seal is pending (0004).
        seals = inode.type != "dir" or not inode.staged or await self.st.leases.may_seal(inode.ino)
        # A listing of either directory applied while the two store steps are under way
        # would see the old name gone and forget it: mark both busy until the move.
        with self.st.dir_marks.busy({old_parent, new_parent}):
            await self._rename_locked(inode, new_dir, new_parent, new_name, target, seals,
                                      old=(old_parent, old_name))
        self.st._drop_rt(inode.ino)
        # A completion mark written as a temp file and renamed into place (DCP's
        # .metadata) seals like a mark closed in place.
        if inode.type == "file" and not inode.dirty:
            await self.seals._seals_after_close(inode, wait=True)
        elif inode.type == "file" and not self.st._writers(inode.ino):
            self.seals._seals_after_close(inode, wait=False)

    async def _rename_local(self, inode: Inode, old_parent: int, old_name: bytes,
                            new_parent: int, new_name: bytes) -> None:
        """Async mode: the rename happens here at once and never waits for uploads; the
        store follows in log order (``_exec_move``), after the uploads below a renamed
        directory, so other nodes see the tree complete under its new name.  Renaming a
        staged directory seals it there, when the cluster allows (leases)."""
        target_ino = self.st.ns.lookup(new_parent, new_name)
        # The moved inode needs no lock: its record is applied after whatever store step
        # of it is in flight, and looks at the store then.  The replaced one's publish
        # in flight lands first, so the record knows to delete it.
        inos = [target_ino] if target_ino is not None and target_ino != inode.ino else []
        if holds_taken_version(inode):
            inos.append(inode.ino)    # (no entry PUT of the save it took in flight)
        async with AsyncExitStack() as locks:
            for ino in sorted(inos):
                await locks.enter_async_context(self.st._rt(ino).lock)
            inode = self.st.ns.get(inode.ino)
            if not inode.parent or self.st.ns.lookup(old_parent, old_name) != inode.ino:
                raise self.st.gone(inode.ino, "removed while renaming")
            if self.st.ns.lookup(new_parent, new_name) != target_ino:
                raise TargetChanged()
            old_dir, new_dir = self.st.ns.get(old_parent), self.st._dir(new_parent)
            # One commit: the local rename and its log record (two let an ENOSPC between
            # them move the name here while the store was never told).
            with self.st.ns.batch():
                if holds_taken_version(inode):
                    if inode.published:     # the save it took landed: it goes with the name
                        self.held.log_delete(inode, old_dir, old_name)
                    leave_taken_version(self.st, inode, self.publisher._journal_done_publish)
                record = {"kind": "move", "ino": inode.ino, "parent_id": old_dir.dir_id,
                          "name": old_name.hex(), "to_id": new_dir.dir_id,
                          "to_name": new_name.hex(), "type": inode.type,
                          "seals": inode.type == "dir" and inode.staged,
                          **self.entries._identity(inode), "replaced": None}
                replaced = self._move_and_log(inode, record, old_dir, old_name, new_dir,
                                              new_name)
            if replaced is not None and not replaced.parent:
                # (open too: its readers' last release must not cut the linger short)
                linger_then_delete(self.st, replaced, self.publisher._delete_inode)
        for ino in inos + [inode.ino]:
            self.st._drop_rt(ino)
        self.st._sync_journal_soon()
        if inode.type == "file" and not self.st._writers(inode.ino):
            self.seals._seals_after_close(inode, wait=False)

    @no_await
    def _move_and_log(self, inode: Inode, record: dict, old_dir: Inode, old_name: bytes,
                      new_dir: Inode, new_name: bytes) -> Inode | None:
        """The local half of an async rename and its log record, inside the caller's
        batch (no await); the inode it replaced, or None."""
        old_parent, new_parent = old_dir.ino, new_dir.ino
        # An entry of its own sent unanswered under the old name: a move finds and moves
        # whatever is there; the record deletes it if the inode is removed first.
        record["unsure"] = unsure.take(inode, entry_key(dir_id_of(old_dir), old_name))
        self.held.release(inode, old_dir, old_name)
        replaced, took, never_closed = None, False, self.held.never_closed(inode)
        target_ino = self.st.ns.lookup(new_parent, new_name)
        if target_ino is not None and target_ino != inode.ino:
            replaced = self.st.ns.get(target_ino)
            new_key = entry_key(dir_id_of(new_dir), new_name)
            unsure.hand_over(replaced, inode, new_key)
            # What this node sent there unanswered is not another node's save when the
            # move lands (a later rename of the file on takes these notes from it).
            record["target_unsure"] = unsure.under(inode, new_key)
            if replaced.published and not replaced.link_id and \
                    self.held.has_no_entry(inode):
                # (the move record then finds what it holds there: no other node's save)
                record["target_held"] = [self.held.hold(inode, new_dir, new_name, replaced)]
            elif replaced.published:
                record["replaced"] = self.entries._identity(replaced)
            else:
                ident = self.held.hand_over(inode, replaced, new_dir, new_name)
                if ident is not None and inode.published:
                    record["replaced"] = {"ident": ident}
                elif ident is not None:
                    # The hold passes to it: what the move finds there is this node's
                    # (its first publish in flight lands under the old name, and the
                    # move then meets the held entry: hostile run G).
                    record["target_held"] = [ident]
            took = never_closed and take_closed_version(self.st, inode, replaced)
            self.st.ns.unlink(replaced, new_parent, new_name)
        self.st._touch_dir(old_parent)
        self.st._touch_dir(new_parent)
        _own_attributes_where_it_lands(inode)
        self.st.ns.move(inode, new_parent, new_name, old=(old_parent, old_name))
        self.names._mark_parent_changed(old_dir)
        if new_parent != old_parent:
            self.names._mark_parent_changed(new_dir)
        seq = self.st.oplog.add(record, dirs=[old_parent, new_parent])
        if took:
            self.publisher._journal_publish(inode)      # (after the move, in log order)
        elif inode.ino in self.st.queue.queued:
            # Its pending publish writes the entry under the name it has then: not
            # before the store has moved it there (a publish under the new name first
            # would leave the move no source, or move an older version over the newer).
            self.st.ns.publish_pending_add(inode.ino, seq)

            def epoch() -> None:
                self.st._publish_epoch[inode.ino] = seq
                self.st.queue.changed()   # records waiting for its older epoch look again
            self.st.ns.after_commit(epoch)
        return replaced

    def _refuse_move_into_itself(self, moving: Inode, dest: int) -> None:
        if moving.type != "dir":
            return
        ancestor = dest
        while ancestor != ROOT_INO:
            if ancestor == moving.ino:
                raise FsError(errno.EINVAL, "cannot move a directory into itself")
            ancestor = self.st.ns.get(ancestor).parent

    async def _exchange(self, a_parent: int, a_name: bytes, b_parent: int,
                        b_name: bytes) -> None:
        """RENAME_EXCHANGE: two existing names trade their objects.  Both entries are
        claimed as in a rename (decision 0006), the swap is journaled, then each key
        gets the other's entry (If-Match its claim)."""
        await self.st.follow_the_log("exchange")   # async: acts on the store at once
        a = await self.names.lookup(a_parent, a_name)
        b = await self.names.lookup(b_parent, b_name)
        self.st._dir(a_parent)
        self.st._dir(b_parent)
        if a.ino == b.ino:
            return
        self._refuse_move_into_itself(a, b_parent)
        self._refuse_move_into_itself(b, a_parent)
        for inode in (a, b):
            if inode.type == "dir":
                await self.seals._wait_uploads_under(inode.ino)
        with self.st.dir_marks.busy({a_parent, b_parent}):
            async with AsyncExitStack() as locks:
                for ino in sorted((a.ino, b.ino)):
                    await locks.enter_async_context(self.st._rt(ino).lock)
                a, b = self.st.ns.get(a.ino), self.st.ns.get(b.ino)
                if self.st.ns.lookup(a_parent, a_name) != a.ino or \
                        self.st.ns.lookup(b_parent, b_name) != b.ino:
                    raise FsError.enoent("changed while exchanging")
                key_a = entry_key(dir_id_of(self.st.ns.get(a_parent)), a_name)
                key_b = entry_key(dir_id_of(self.st.ns.get(b_parent)), b_name)
                a_remote = a.published and not a.links_pending
                b_remote = b.published and not b.links_pending
                # What each name holds is swapped -- another node's file of the other
                # kind (hard-linked or not) that filled it meanwhile included, as a
                # rename moves it (``EntryMoves.claim``).
                claim_a, moved_a = await self._claim_for_exchange(a, key_a, key_b, a_remote)
                try:
                    claim_b, moved_b = await self._claim_for_exchange(b, key_b, key_a,
                                                                      b_remote)
                except BaseException:
                    if claim_a is not None:   # give the first name back its entry
                        with trio.CancelScope(shield=True):
                            await self.moves.put_quietly(key_a, moved_a, claim_a)
                    raise
                steps = [(key_b, moved_a.to_json().decode() if a_remote else None, claim_b),
                         (key_a, moved_b.to_json().decode() if b_remote else None, claim_a)]
                seq = self.st.ns.journal_add({"op": "exchange", "steps": steps})
                await self.st._sync_journal()
                await self._finish_exchange(steps)
                # What the store has swapped, here must follow (one commit).
                self.st.record_store_change(
                    functools.partial(self._exchange_locally, seq, a, (a_parent, a_name), b,
                                      (b_parent, b_name)),
                    [a_parent, b_parent], f"exchange of {a_name!r}", a_remote or b_remote)
        self.st._drop_rt(a.ino)
        self.st._drop_rt(b.ino)

    async def _claim_for_exchange(self, inode: Inode, key: str, other_key: str,
                                  remote: bool) -> tuple[str | None, Entry]:
        """The claim on one name of an exchange and the entry that name then hands over
        (nothing to claim for a name the store has not got yet)."""
        if not remote:
            return None, self.entries._entry_of(inode)
        etag, found = await self.moves.claim(inode, key, other_key, found_ok=True)
        found.moving_to, found.moving_at = None, 0.0
        if bool(inode.link_id) != (found.type == "link"):
            return etag, found
        return etag, self.entries._entry_of(inode)

    @no_await
    def _exchange_locally(self, seq: int, a: Inode, a_at: tuple[int, bytes], b: Inode,
                          b_at: tuple[int, bytes]) -> bool:
        self.st.ns.journal_done(seq)
        key_a = entry_key(dir_id_of(self.st.ns.get(a_at[0])), a_at[1])
        key_b = entry_key(dir_id_of(self.st.ns.get(b_at[0])), b_at[1])
        unsure.hand_over(a, b, key_a)   # notes follow their names (saved by the exchange)
        unsure.hand_over(b, a, key_b)
        self.st.ns.exchange(a, a_at, b, b_at)
        for ino in (a.ino, b.ino):
            inode = self.st.ns.get(ino)
            if inode.published and not inode.link_id:
                inode.remote_etag = None   # read again before the next rewrite
                self.st.ns.save(inode)
        self.names._mark_parent_changed(self.st.ns.get(a_at[0]))
        if b_at[0] != a_at[0]:
            self.names._mark_parent_changed(self.st.ns.get(b_at[0]))
        return True

    async def _finish_exchange(self, steps: list) -> None:
        """Write each key's new entry (or delete it when its new object was never
        published), conditional on our claim; also the journal replay."""
        for key, body, claim in steps:
            try:
                if body is not None:
                    await self.entries._store(functools.partial(self.st.store.put, key, body.encode(),
                                                        if_match=claim))
                elif claim is not None:
                    await self.entries._store(functools.partial(self.st.store.delete, key,
                                                        if_match=claim))
            except PreconditionFailed:
                log.warning("%s was written again by another node during an exchange: "
                            "that newer version stays", key)

    async def _rename_locked(self, inode: Inode, new_dir: Inode, new_parent: int,
                             new_name: bytes, target: Inode | None, seals: bool = True,
                             old: tuple[int, bytes] | None = None) -> None:
        """The store steps and the namespace move, under the locks of the renamed inode
        and of the one it replaces (a publish of either finishes first), taken in inode
        order so two crossing renames cannot deadlock."""
        inos = sorted({inode.ino} | ({target.ino} if target is not None else set()))
        async with AsyncExitStack() as locks:
            for ino in inos:
                await locks.enter_async_context(self.st._rt(ino).lock)
            inode = self.st.ns.get(inode.ino)
            old = old or (inode.parent, inode.name)
            if not inode.parent or self.st.ns.lookup(*old) != inode.ino:
                raise self.st.gone(inode.ino, "removed while renaming")
            old_dir = self.st.ns.get(old[0])
            old_key = entry_key(dir_id_of(old_dir), old[1])
            new_key = entry_key(dir_id_of(new_dir), new_name)
            if holds_taken_version(inode):
                await self._leave_taken_version(inode, old_key)
            remote = target if target is not None and target.published and \
                not target.links_pending else None     # a replaced name the store has
            stored = bool(inode.published and not inode.links_pending or inode.held or
                          remote is not None)       # the store steps change something
            replaced: Entry | None = None     # what the store had under the name
            if inode.published and not inode.links_pending:
                replaced = await self.moves.move_entry(inode, old_key, new_key, seals)
            else:
                await self.held.delete(inode, old_dir, old[1])
                if remote is not None and self.held.has_no_entry(inode) and \
                        not remote.link_id:
                    # No entry of its own yet: the name keeps its entry until one lands.
                    self.held.hold(inode, new_dir, new_name, remote)
                elif remote is not None:
                    # Only what this node knows there: another node's save, or the link
                    # it renamed away meanwhile, is not this rename's to remove.
                    known = self.entries._entry_of(remote)     # (a link entry if linked)
                    ident = entry_identity(known) if remote.link_id else \
                        self.entries._identity(remote)["ident"]
                    if await self.entries._delete_if_same(new_key, ident):
                        replaced = known
            if remote is None and target is not None:
                self.held.hand_over(inode, target, new_dir, new_name)
            # (a link it replaced: counted out, by this node, whose write replaced it)
            await count_out_replaced(self.entries, replaced, self.st.ns.maybe_get(
                remote.ino) if remote is not None else None)
            # What the store has moved, here must follow (one commit).
            never_closed = self.held.never_closed(inode)
            sealed_here = self.st.record_store_change(
                lambda: self._move_locally(inode, old_dir, old, new_parent, new_name, seals,
                                           never_closed),
                [old_dir.ino, new_parent], f"rename of {old[1]!r}", stored)
        if target is not None:
            self.st._drop_rt(target.ino)
        if sealed_here:
            self.seals._sealed(inode)       # pointers waiting for it, retention

    async def _leave_taken_version(self, inode: Inode, old_key: str) -> None:
        """Sync: ``inode`` moves on from the name whose save it took (``taken.py``): the
        entry its publish left there goes first, then the version is left here.  (A
        store failure after this fails the rename, the save already left.)"""
        if inode.published and not inode.links_pending:
            await self.entries._delete_if_same(old_key, self.entries._identity(inode)["ident"])
        with self.st.ns.batch():
            leave_taken_version(self.st, inode, self.publisher._journal_done_publish)

    @no_await
    def _move_locally(self, inode: Inode, old_dir: Inode, old: tuple[int, bytes],
                      new_parent: int, new_name: bytes, seals: bool,
                      never_closed: bool = False) -> bool:
        """After the store steps, under the locks: the namespace move (replacing the
        target; ``never_closed``: ``inode`` takes its closed version if it has not
        landed), in one step.  True when it sealed a staged directory."""
        sealed_here = inode.staged and seals and inode.type == "dir"
        inode.staged = inode.staged and not seals  # a rename seals a staged directory
        target_ino = self.st.ns.lookup(new_parent, new_name)
        if target_ino is not None and target_ino != inode.ino:
            replaced = self.st.ns.get(target_ino)
            unsure.hand_over(replaced, inode,
                             entry_key(dir_id_of(self.st.ns.get(new_parent)), new_name))
            if never_closed and take_closed_version(self.st, inode, replaced):
                self.publisher._journal_publish(inode)
            self.st.ns.unlink(replaced, new_parent, new_name)
            if not replaced.parent:
                # Its staging files go only once the move is committed (a failed
                # commit shows it again, named).
                self.st.ns.after_commit(lambda: linger_then_delete(
                    self.st, replaced, self.publisher._delete_inode))
        _own_attributes_where_it_lands(inode)
        self.st.ns.move(inode, new_parent, new_name, old=old)
        self.names._mark_parent_changed(old_dir)
        if new_parent != old_dir.ino:
            self.names._mark_parent_changed(self.st.ns.get(new_parent))
        return sealed_here


def _own_attributes_where_it_lands(inode: Inode) -> None:
    """A file not in the store yet, renamed: it replaces whatever its first publish
    finds under the new name, mode and owner included -- it takes none of that entry's
    (``EntryIO._keep_attributes``), as a file created at the name would."""
    if not inode.published:
        inode.attrs_unsent = list(ALL_ATTRIBUTES)
