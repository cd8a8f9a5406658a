"""Directory ids in a listing: they must form a tree, and one this node holds under
another name is a directory another node moved here.  Part of the refresh's apply phase
(no ``await``); knows nothing of the store or of how a listing is taken."""

from __future__ import annotations

import logging

from ..format.remote import dir_prefix, entry_key
from ..meta.namespace import ROOT_INO, Inode
from .conflicts import keep_under_own_name, records_follow
from .critical import no_await
from .state import CoreState, dir_id_of

log = logging.getLogger(__name__)

_LATER = "later"    # ``_held_elsewhere``: not taken from this listing


class ListedDirIds:
    """Checks a listing's directory entries against the ids this node holds, and moves
    this node's inode of a directory another node renamed or moved to its new name (so
    what this node holds in it -- a file still open, names not yet in the store -- is
    there at once)."""

    def __init__(self, st: CoreState) -> None:
        self.st = st

    @no_await
    def check(self, dir_inode: Inode, fetched: dict, remote: dict, local: dict,
              corrupt: set[bytes]) -> list[tuple[Inode, bytes]]:
        """Directory ids must form a tree: an entry naming the id of this directory or
        of one of its ancestors (an endless tree), or an id another name of this
        listing already has (one directory twice), answers EIO for that name.  An id
        this node knows under a name elsewhere (or under no name, kept for its work) is a
        directory another node moved here: this node's inode moves to the new name.
        Returns the inodes such a move took a name from (the caller forgets that name
        as vanished).  A directory under two names because another node's rename of it
        is under way (the old entry carries the claim naming the new key) is listed
        under the new name only.  (Part of the apply phase: no await.)"""
        ancestors = set()
        cur = dir_inode
        while True:
            ancestors.add(cur.dir_id)
            if cur.ino == ROOT_INO or not cur.parent:
                break
            cur = self.st.ns.get(cur.parent)
        claimed: dict[str, bytes] = {}
        displaced: list[tuple[Inode, bytes]] = []
        # The source of a rename under way (its claim names the new key) after the
        # other names: its id is then claimed by the new name it is moving to.
        for name in sorted(fetched, key=lambda n: (fetched[n][0].moving_to is not None, n)):
            entry, _ = fetched[name]
            if entry.type != "dir":
                continue
            reason = None
            if entry.id in ancestors:
                reason = "names its own ancestor (a directory loop)"
            elif entry.id in claimed and entry.moving_to == \
                    entry_key(dir_id_of(dir_inode), claimed[entry.id]):
                # Under both names for a moment (decision 0006: the old one goes next):
                # the new name only, as if the rename were done.
                del fetched[name]
                continue
            elif entry.id in claimed:
                reason = f"has the same directory id as {claimed[entry.id]!r}"
            else:
                claimed[entry.id] = name
                holder = self.st.ns.ino_of_dir_id(entry.id)
                holder_inode = self.st.ns.maybe_get(holder) if holder is not None else None
                if holder_inode is not None and holder != local.get(name) and \
                        (holder_inode.parent or self.st.ns.has_children(holder_inode.ino)):
                    reason = self._held_elsewhere(holder_inode, dir_inode, name, fetched,
                                                  remote, local, displaced)
                    if reason == _LATER:
                        del fetched[name]
                        continue
            if reason is not None:
                log.error("corrupt entry %r in %s: %s (EIO for that name)", name,
                          dir_prefix(dir_id_of(dir_inode)), reason)
                corrupt.add(name)
                del fetched[name]
        return displaced

    @no_await
    def _held_elsewhere(self, holder: Inode, dir_inode: Inode, name: bytes, fetched: dict,
                        remote: dict, local: dict,
                        displaced: list[tuple[Inode, bytes]]) -> str | None:
        """A listed directory id this node holds under another name: why the entry is
        corrupt, ``_LATER`` (the next listing takes it), or None (moved here, or fine)."""
        entry, _ = fetched[name]
        if holder.parent == dir_inode.ino and holder.name in remote:
            # Both names listed: an alias, unless the other one is the claimed source
            # of a rename to this name (decision 0006), or the other name now holds
            # another object (the directory was renamed here and its old name made
            # again by another node).
            other = fetched.get(holder.name)
            reused = other is not None and (other[0].type != "dir" or
                                            other[0].id != entry.id)
            # Listed changed (a claim) and gone when read: a rename that finished.
            gone = other is None and remote[holder.name][1] != holder.remote_etag
            if not reused and not gone and (other is None or other[0].moving_to !=
                                            entry_key(dir_id_of(dir_inode), name)):
                return f"has the same directory id as {holder.name!r}"
            # (the claimed source of a rename to this name, or a finished one: moved
            # here, as below)
        if not self._movable(holder):
            # A rename of this node is under way there: the next listing, once it
            # is done, moves the directory.
            if holder.parent == dir_inode.ino and holder.name not in remote:
                local.pop(holder.name, None)
            return _LATER
        # Moved here by another node (its old name perhaps made again): the inode moves
        # with its name now, before the old name's new directory replaces it, so what
        # this node holds in it (a file still open, names not yet in the store) is
        # under the new name at once.
        self._move_here(holder, dir_inode, name, local, displaced)
        return None

    @no_await
    def _movable(self, holder: Inode) -> bool:
        """May a listing move this node's directory ``holder`` to where another node
        renamed it?  Not while a rename of this node is under way in it or in its
        directory, nor while its directory has records of this node pending: that
        directory's next listing sees it gone then (no await)."""
        return not (self.st.dir_marks.is_busy(holder.ino)
                    or self.st.dir_marks.is_busy(holder.parent)
                    or self.st.oplog.is_busy(holder.parent))

    @no_await
    def _has_work(self, inode: Inode) -> bool:
        """Whether this node owes the store something of ``inode`` (no await)."""
        ino = inode.ino
        return inode.dirty or not inode.published or ino in self.st.queue.queued or \
            self.st._locked(ino) or bool(self.st._writers(ino))

    @no_await
    def _move_here(self, holder: Inode, dir_inode: Inode, name: bytes,
                   local: dict[bytes, int], displaced: list[tuple[Inode, bytes]]) -> None:
        """Give ``holder`` the name ``name`` in ``dir_inode`` (the apply phase's view
        ``local`` follows); the kernel forgets its old name.  What this node held under
        ``name`` loses it now and goes to ``displaced``: it must not keep thinking the
        name is its own, or its own move later (another node moved it on, into a
        directory listed after this one) takes the name from ``holder`` (soak seed
        1215343).  (No await.)"""
        old_parent, old_name = holder.parent, holder.name
        there = local.get(name)
        if there is not None and there != holder.ino:
            before = self.st.ns.get(there)
            if self._has_work(before):
                # Made or saved here and not in the store yet: kept beside the directory
                # (no serial order has both under one name; decision 0016).
                kept = keep_under_own_name(
                    self.st, before, f"another node moved a directory to {name!r}",
                    before.type if before.type != "dir" else "directory")
                records_follow(self.st, before.ino, dir_id_of(dir_inode), name, kept)
                local[kept] = before.ino
            else:
                self.st.ns.unlink(before, dir_inode.ino, name)
                displaced.append((before, name))
        if old_parent == dir_inode.ino:
            local.pop(old_name, None)
        elif old_parent:
            self.st.dir_marks.touch(old_parent)   # a listing of it under way is older
        self.st.ns.move(holder, dir_inode.ino, name)   # from no name: a vanished one
        local[name] = holder.ino
        if self.st.invalidate_entry is not None and old_parent and old_name is not None:
            self.st.nursery.start_soon(self.st.invalidate_entry, old_parent, old_name)
        self.st.invalidate(holder.ino)
