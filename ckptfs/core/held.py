"""Held entries: DESIGN.md promise 2 (a name changes in the store only when a closed
version lands there) for files renamed before their first publish landed.  A file with
no entry of its own in the store (never closed, or its first publish still queued)
renamed over a published name leaves that name's entry in the store -- other
nodes go on seeing the last closed version -- and remembers it (``Inode.held``: parent
dir id, name, the entry's identity).  Its own closed version landing there replaces the
entry (``Publish._land`` forgets the holds); moved away or unlinked first, it deletes the
entry (sync: at once; async: a ``delete`` record in log order); renamed over by another
file, the hold goes with the name: to that file if it has no entry of its own yet,
otherwise its own entry's move replaces the held one.

The removal of a published name (async: its ``delete`` record) is here too, and every
removal also takes the entries of the inode's own that a publish sent under the name
and never had answered (``Inode.unsure``: they may have landed).

Knows the namespace, the metadata log and entry identities; nothing of FUSE, chunks or
renames' store protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..format.remote import MAX_CHUNK_SIZE, BadEntry, Entry, entry_key
from ..meta.namespace import ROOT_INO, Inode
from . import unsure
from .critical import no_await
from .state import CoreState, dir_id_of

if TYPE_CHECKING:
    from .entries import EntryIO


class HeldEntries:
    """The holds of files renamed before their first close; no state of its own (the
    holds live on the inodes, journaled with them)."""

    def __init__(self, st: CoreState, entries: EntryIO) -> None:
        self.st = st
        self.entries = entries

    def never_closed(self, inode: Inode) -> bool:
        """A file being written that has no closed version anywhere yet."""
        return inode.type == "file" and not inode.published and not inode.dirty \
            and inode.ino not in self.st.queue.queued

    def has_no_entry(self, inode: Inode) -> bool:
        """A file with no entry of its own in the store yet: never closed, or closed
        with its first publish still to land (async mode's queue; a publish the store
        refused, kept and retried).  Renamed over a published name, it holds that
        name's entry: deleted before the publish landed, the name was in no listing in
        between (``os.replace`` of a just-saved temporary file, async mode)."""
        return inode.type == "file" and not inode.published and \
            (not inode.link_id or self.never_closed(inode))

    def hold(self, inode: Inode, new_dir: Inode, new_name: bytes, replaced: Inode) -> str:
        """``inode``, with no entry of its own in the store yet, was renamed over the
        published ``replaced``: the store keeps that entry under the name until
        ``inode``'s closed version lands there.  The entry is kept with the hold too, to
        show it again here if ``inode`` never gets a closed version (``show_again``).
        Returns the held entry's identity."""
        ident = self.entries._identity(replaced)["ident"]
        self._add(inode, new_dir, new_name, ident,
                  self.entries._entry_of(replaced).to_json().decode())
        return ident

    def hand_over(self, inode: Inode, replaced: Inode, new_dir: Inode,
                  new_name: bytes) -> str | None:
        """``inode`` was renamed over ``replaced``, which held the entry under the name:
        the hold goes with the name.  An ``inode`` with no entry of its own keeps it (it
        releases it when it moves away or goes, as ``replaced`` would have); a published
        one's entry is about to replace it.  Returns the held entry's identity, or
        None when ``replaced`` held nothing there."""
        held = self._take(replaced, new_dir, new_name)
        if held is not None and not inode.published:
            self._add(inode, new_dir, new_name, *held[2:])
        return held[2] if held is not None else None

    def take(self, inode: Inode, parent: Inode, name: bytes) -> str | None:
        """The identity of the entry ``inode`` holds under ``parent/name`` (forgotten
        here), or None."""
        held = self._take(inode, parent, name)
        return held[2] if held is not None else None

    def _take(self, inode: Inode, parent: Inode, name: bytes) -> list[str] | None:
        for held in inode.held:
            if self.st.oplog.resolve(held[0]) == parent.dir_id and held[1] == name.hex():
                inode.held.remove(held)
                self.st.ns.save(inode)
                return held
        return None

    @no_await
    def show_again(self, inode: Inode) -> None:
        """``inode`` leaves without a closed version (its writer was killed, it failed):
        each name it held shows the entry it held again, here and now, from the copy
        kept with the hold -- not from the next listing, which a store that is away
        cannot give.  (The store still has the entry: nothing is written there.)  A name
        taken since, or a hold recorded before copies were kept, is left to the next
        listing.  Called before the inode loses its names."""
        for held in inode.held:
            if len(held) < 4:
                continue
            dir_id = self.st.oplog.resolve(held[0])
            parent = ROOT_INO if dir_id == dir_id_of(self.st.ns.get(ROOT_INO)) \
                else self.st.ns.ino_of_dir_id(dir_id)
            name = bytes.fromhex(held[1])
            if parent is None or self.st.ns.lookup(parent, name) not in (None, inode.ino):
                continue
            try:
                entry = Entry.from_json(held[3].encode(), MAX_CHUNK_SIZE)
            except BadEntry:
                continue
            self.st.ns.unlink(inode, parent, name)
            self.entries.adopt(parent, name, entry, None)

    def release(self, inode: Inode, parent: Inode, name: bytes) -> None:
        """Async: the name moves away or goes before a closed version landed: the entry
        it held goes too, in log order -- and so does any entry of its own that a
        publish sent there unanswered (``Inode.unsure``: it may have landed)."""
        ident = self.take(inode, parent, name)
        maybe = unsure.take(inode, entry_key(dir_id_of(parent), name))
        if ident is not None or maybe:
            self.st.oplog.add({"kind": "delete", "ino": inode.ino, "parent_id": parent.dir_id,
                               "name": name.hex(), "ident": ident, "unsure": maybe},
                              dirs=[parent.ino])
            self.st.ns.save(inode)

    def log_delete(self, inode: Inode, parent: Inode, name: bytes) -> None:
        """Async: a published name removed here goes from the store in log order, if it
        still holds the object this node removed (``_exec_delete``) -- or an entry of
        its own that a publish sent there unanswered."""
        maybe = unsure.take(inode, entry_key(dir_id_of(parent), name))
        self.st.oplog.add({"kind": "delete", "ino": inode.ino, "parent_id": parent.dir_id,
                           "name": name.hex(), **self.entries._identity(inode),
                           "unsure": maybe}, dirs=[parent.ino])

    async def delete(self, inode: Inode, parent: Inode, name: bytes) -> None:
        """Sync: as ``release``, at once (an unanswered entry is forgotten only once
        the store has answered its deletion)."""
        key = entry_key(dir_id_of(parent), name)
        maybe = unsure.under(inode, key)
        ident = self.take(inode, parent, name)
        if ident is not None or maybe:
            await self.entries._delete_if_same(key, ident, *maybe)
        if maybe:
            unsure.take(inode, key)
            self.st.ns.save(inode)

    def _add(self, inode: Inode, new_dir: Inode, new_name: bytes, ident: str,
             body: str | None = None) -> None:
        key = [dir_id_of(new_dir), new_name.hex()]
        inode.held = [h for h in inode.held if h[:2] != key]
        inode.held.append([*key, ident] + ([body] if body is not None else []))
        self.st.ns.save(inode)
