"""Directory refresh: merging the store's listing of a directory into the namespace (TTL,
stale-is-better-than-hung, hostile directory ids).  The apply phase has no ``await``."""

from __future__ import annotations

import errno
import logging
import time

import trio

from ..errors import FsError
from ..meta.namespace import ROOT_INO, Inode
from ..format.remote import MAX_CHUNK_SIZE, BadEntry, Entry, decode_name, dir_prefix, inode_key
from ..store import NotFound

from .entries import read_save_id

from .critical import no_await
from .state import CoreState, dir_id_of
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..store.base import ObjectStore
    from .entries import EntryIO
    from .listed_dirs import ListedDirIds


log = logging.getLogger(__name__)


class Refresh:
    """Merging store listings into the namespace.  Owns the refreshes under way, their
    failures and start times, whether answers come from stale metadata, and the names
    whose store entry is corrupt."""

    def __init__(self, st: CoreState, *, entries: EntryIO, dir_ids: ListedDirIds,
                 delete_inode: Callable[[Inode], None]) -> None:
        self.st = st
        self.entries = entries
        self.dir_ids = dir_ids
        self.delete_inode = delete_inode
        self._refreshing: dict[int, trio.Event] = {}
        self._refresh_failed: dict[int, FsError] = {}
        self._refresh_started: dict[int, float] = {}
        # Directories answered from this node's metadata while their listing is slow:
        # said when the first one starts, not again until none is left (one outage).
        self._serving_stale: set[int] = set()
        self._corrupt: dict[int, set[bytes]] = {}   # names whose store entry is corrupt

    # ------------------------------------------------------------------ remote listing

    async def refresh_dir(self, ino: int, force: bool = False) -> None:
        """Merge the store's listing of a directory into the namespace (TTL-limited).

        Stale is better than hung: when this node has listed the directory before and
        the store does not answer within ``stale_wait``, the caller goes on with what
        the node knows (said once in the log) while the refresh finishes in the
        background.  A directory never listed, or a ``force`` refresh (rmdir, rename
        over a directory), waits for the store and fails with its error."""
        inode = self.st._dir(ino)
        if not force and time.time() - inode.listed_at < self.st.config.metadata_ttl:
            return
        if self.st.oplog.is_busy(ino) or (not inode.published and ino != ROOT_INO):
            # Changes of this node are on their way to the store (oplog.py), or the
            # directory is not there yet: this node's view is the newer one.
            return
        event = self._refreshing.get(ino)
        if event is None:
            event = self._refreshing[ino] = trio.Event()
            self._refresh_started[ino] = trio.current_time()
            self.st.nursery.start_soon(self._refresh_in_background, ino, event)
        if not force and inode.listed_at and self.st._deferred() and \
                self.st.dir_marks.changed_within(ino, self.st.config.metadata_ttl):
            # Async mode, a directory this node is filling (a copy, an unpacked tree):
            # its own names are newer here than in any listing, and other nodes' come
            # with the listing just started -- a lookup or create does not wait for it
            # (it did once per TTL: most of a small file's time in `cp -a`, issue 25).
            return
        if force or not inode.listed_at:
            await event.wait()
            error = self._refresh_failed.get(ino)
            if error is not None:
                raise FsError(error.errno, error.reason)
            return
        # One wait per slow store, not one per request or per directory: once a refresh
        # has been pending for ``stale_wait``, later requests answer at once -- in every
        # directory while any listing is that slow (a hang: no answer will come soon).
        waited = trio.current_time() - self._refresh_started.get(ino, trio.current_time())
        wait = 0.0 if self.store_slow() else self.st.config.stale_wait - waited
        with trio.move_on_after(max(0.0, wait)):
            await event.wait()
            return
        if not self._serving_stale:
            log.warning("the store is slow to list %s: answering from this node's metadata "
                        "(said once)", self.st._path_for_log(inode))
        self._serving_stale.add(ino)

    def store_slow(self) -> bool:
        """A listing has waited past ``stale_wait`` and not answered yet: the store is
        slow right now (a request that would wait for it goes on without)."""
        return bool(self._serving_stale)

    async def _refresh_in_background(self, ino: int, event: trio.Event) -> None:
        try:
            inode = self.st.ns.maybe_get(ino)
            if inode is not None and inode.type == "dir":
                await self._refresh_dir(inode)
            self._refresh_failed.pop(ino, None)
            self._serving_stale.discard(ino)
        except FsError as exc:
            if ino not in self._refresh_failed:   # once per outage, not every TTL
                log.warning("listing directory inode %d failed: %s", ino, exc)
            self._refresh_failed[ino] = exc
        except Exception as exc:  # a background task must never take the daemon down
            self._refresh_failed[ino] = FsError(errno.EIO, str(exc))
            log.exception("listing inode %d failed", ino)
        finally:
            del self._refreshing[ino]
            self._refresh_started.pop(ino, None)
            event.set()

    async def _refresh_dir(self, dir_inode: Inode) -> None:
        """List, fetch what is new or changed, then apply with no ``await``.

        This task begins at trio's next checkpoint, not when ``refresh_dir`` started
        it: the unlink or rename that started it may have journaled its record and
        counted its change meanwhile.  Its change count would then match at the apply,
        and the store, listed before the record ran, would bring the removed name
        back.  So a directory with records of this node pending is not listed here
        (as in ``refresh_dir``), and one that gains records during the listing applies
        nothing."""
        if self.st.oplog.is_busy(dir_inode.ino):
            return
        started = time.time()
        mutations = self.st.dir_marks.changes(dir_inode.ino)
        # What the store had of each name here before the listing: an entry this node
        # rewrote meanwhile (a hard-linked inode's chown goes to the store at once,
        # without a record) is newer here than what the listing fetched.
        etags_before = {ino: self.st.ns.get(ino).remote_etag
                        for _, ino in self.st.ns.children(dir_inode.ino)}
        remote = await self._list_names(dir_inode)
        fetched, corrupt = await self._fetch_changed(dir_inode, remote)
        # Apply: no await from here on.
        dir_inode = self.st.ns.get(dir_inode.ino)
        if not dir_inode.parent and dir_inode.ino != ROOT_INO:
            return
        changed_locally = (self.st.dir_marks.changes(dir_inode.ino) != mutations
                           or self.st.dir_marks.is_busy(dir_inode.ino)
                           or self.st.oplog.is_busy(dir_inode.ino))
        self._apply_listing(dir_inode, remote, fetched, corrupt, changed_locally, etags_before)
        self._corrupt[dir_inode.ino] = corrupt
        dir_inode.listed_at = started
        self.st.ns.save(dir_inode)

    async def _list_names(self, dir_inode: Inode) -> dict[bytes, tuple[str, str]]:
        """The store's names in a directory: name -> (key, ETag)."""
        prefix = dir_prefix(dir_id_of(dir_inode))
        listing = await self.entries._store(lambda: list(self.st.store.list(prefix)))
        remote: dict[bytes, tuple[str, str]] = {}
        for obj in listing:
            rest = obj.key[len(prefix):]
            if "/" in rest:
                continue
            try:
                remote[decode_name(rest)] = (obj.key, obj.etag)
            except BadEntry as exc:
                log.error("ignoring bad name %r in %s: %s", rest, prefix, exc)
        return remote

    async def _fetch_changed(self, dir_inode: Inode, remote: dict[bytes, tuple[str, str]]
                             ) -> tuple[dict[bytes, tuple[Entry, str]], set[bytes]]:
        """GET the entries that are new or changed (ETag), links resolved; names whose
        entry is corrupt go to the second set (EIO for them)."""
        local = dict(self.st.ns.children(dir_inode.ino))
        to_fetch = []
        for name, (key, etag) in remote.items():
            ino = local.get(name)
            if ino is not None and self.st.ns.get(ino).remote_etag == etag and etag:
                continue
            to_fetch.append((name, key))
        fetched: dict[bytes, tuple[Entry, str]] = {}
        corrupt: set[bytes] = set()

        async def fetch(name: bytes, key: str) -> None:
            try:
                body, etag = await self.entries._store(self.st.store.get, key)
            except NotFound:
                return
            except FsError:
                return
            try:
                fetched[name] = (Entry.from_json(body, MAX_CHUNK_SIZE), etag)
            except BadEntry as exc:
                log.error("corrupt entry %s: %s (EIO for that name)", key, exc)
                corrupt.add(name)

        async with trio.open_nursery() as nursery:
            for name, key in to_fetch:
                nursery.start_soon(fetch, name, key)
        await self._resolve_links(fetched, corrupt, remote)
        return fetched, corrupt

    @no_await
    def _apply_listing(self, dir_inode: Inode, remote: dict, fetched: dict, corrupt: set,
                       changed_locally: bool, etags_before: dict[int, str | None]) -> None:
        """The apply phase (plain ``def``: no await between related changes).  A
        directory this node changed meanwhile only gains nothing and loses nothing; an
        inode whose entry this node rewrote since the listing began keeps its own."""
        local = dict(self.st.ns.children(dir_inode.ino))
        # (before this apply takes entries: a linked inode's object fetched now has a new
        # ETag when another node counted a name out of it -- not a publish of this node)
        # (only for names the store no longer lists: the only ones ``_forget_vanished``
        # asks about; a listing of a large directory read every child twice before)
        etags_now = {ino: self.st.ns.get(ino).remote_etag
                     for name, ino in local.items() if name not in remote}
        # Rewritten by this node while the listing ran, taken before this apply's own
        # changes: a linked inode's first name taken here gives it the object's new
        # ETag, and its other names here must not take that for a rewrite of this node.
        rewritten = {ino for ino, etag in etags_before.items()
                     if (now := self.st.ns.maybe_get(ino)) is not None
                     and now.remote_etag != etag}
        if not changed_locally:
            displaced = self.dir_ids.check(dir_inode, fetched, remote, local, corrupt)
            for inode, name in displaced:   # its name went to a directory moved here
                self._forget_subtree(inode, dir_inode.ino, name)
        for name, (entry, etag) in fetched.items():
            ino = local.get(name)
            if ino is None:
                if changed_locally:
                    continue
                holder = self._holder_of(entry)
                if holder is None:
                    self.entries.adopt(dir_inode.ino, name, entry, etag)
                    continue
                # Another name of a hard-linked inode this node knows already.
                self.st.ns.add_name(holder, dir_inode.ino, name)
                ino = holder.ino
            inode = self.st.ns.get(ino)
            if inode.dirty or self.st._writers(ino) or changed_locally or not inode.published \
                    or self.st._locked(ino) or ino in rewritten:
                continue
            if inode.type != entry.type or (entry.type == "dir" and inode.dir_id != entry.id) \
                    or (inode.link_id != entry.link and
                        (inode.link_id is not None or self._holder_of(entry) is not None)):
                self._forget_subtree(inode, dir_inode.ino, name)
                holder = self._holder_of(entry)
                if holder is None:
                    self.entries.adopt(dir_inode.ino, name, entry, etag)
                    continue
                self.st.ns.add_name(holder, dir_inode.ino, name)
                inode = holder
                ino = holder.ino
            if inode.chunks != entry.chunks and self.st._is_open(ino) and \
                    self.st.fresh_inode_for_name(ino):
                # Readers here hold the version before: theirs stays on the old inode
                # (the kernel's size of it stays theirs); the name takes the new one
                # (every name of a linked file: the ones still to come here too).
                inode = self.st.ns.get(self.st.ns.lookup(dir_inode.ino, name) or ino)
                local.update({n: inode.ino for p, n in inode.names
                              if p == dir_inode.ino and n in fetched})
            self._take_entry(inode, entry, etag)
        if not changed_locally:
            self._forget_vanished(dir_inode, remote, local, etags_before, etags_now)

    @no_await
    def _take_entry(self, inode: Inode, entry: Entry, etag: str) -> None:
        """Another node's version of a name this node knows (no await)."""
        ino = inode.ino
        if entry.link and inode.link_id is None:   # another node linked it
            self.st.ns.set_link_id(inode, entry.link)
        inode.remote_nlink = entry.nlink if entry.link else 0
        inode.link_counted = list(entry.counted)    # (every rewrite of it keeps them)
        content_changed = inode.chunks != entry.chunks
        inode.mode, inode.uid, inode.gid = entry.mode, entry.uid, entry.gid
        inode.mtime_ns, inode.chunks, inode.size = entry.mtime_ns, entry.chunks, entry.size
        inode.save_id = read_save_id(entry)
        inode.target, inode.remote_etag = entry.target, etag
        inode.rdev, inode.xattrs = entry.rdev, dict(entry.xattrs)
        inode.staged = entry.staged and entry.type == "dir"
        if inode.type == "symlink" and entry.target is not None:
            inode.size = len(entry.target)
        if content_changed and inode.local_copy:
            inode.local_copy = False
            self.st.cache.untrack_local(ino)
            self.st._drop_version_if_unused(ino, inode.ver)
        self.st.ns.save(inode)
        if content_changed:
            self.st.taken_behind_the_kernel(ino)

    @no_await
    def _forget_vanished(self, dir_inode: Inode, remote: dict, local: dict,
                         etags_before: dict[int, str | None],
                         etags_now: dict[int, str | None]) -> None:
        """Names gone from the store that this node has no work for (no await).  An
        inode this node published since the listing began (its ETag changed) is not
        gone: its entry landed after the LIST (a first publish writes a hard-linked
        inode's names one by one, under its lock, and the listing may apply after).
        A reader is no work: the name goes, the reader keeps its version on the
        nameless inode, which goes with its close (an unlinked open file)."""
        for name, ino in local.items():
            if name in remote:
                continue
            inode = self.st.ns.get(ino)
            if inode.published and not inode.dirty and not self.st._writers(ino) \
                    and ino not in self.st.queue.queued and not self.st._locked(ino) \
                    and etags_now[ino] == etags_before.get(ino, etags_now[ino]):
                self._forget_subtree(inode, dir_inode.ino, name)

    async def _resolve_links(self, fetched: dict[bytes, tuple[Entry, str]],
                             corrupt: set[bytes],
                             remote: dict[bytes, tuple[str, str]]) -> None:
        """Replace each fetched "link" entry by its shared inode object (one GET per
        object, decision 0008), with the object's ETag.  A link whose object is
        missing or malformed answers EIO for that name -- unless its entry has gone
        or changed since it was read: a file's last name goes (its entry, then its
        object) between the two GETs, and the name is then gone from ``remote``, not
        corrupt."""
        ids = {entry.link for entry, _ in fetched.values()
               if entry.type == "link" and entry.link is not None}   # always set (remote.py)
        objects: dict[str, tuple[Entry, str]] = {}

        async def fetch(link_id: str) -> None:
            key = inode_key(link_id)
            try:
                body, etag = await self.entries._store(self.st.store.get, key)
            except (NotFound, FsError):
                return
            try:
                obj = Entry.from_json(body, MAX_CHUNK_SIZE)
                if obj.type in ("dir", "link"):
                    raise BadEntry(f"an inode object of type {obj.type}")
            except BadEntry as exc:
                log.error("corrupt inode object %s: %s", key, exc)
                return
            obj.link = link_id
            objects[link_id] = (obj, etag)

        async with trio.open_nursery() as nursery:
            for link_id in ids:
                nursery.start_soon(fetch, link_id)
        missing = {name: entry.link for name, (entry, _) in fetched.items()
                   if entry.type == "link" and entry.link not in objects}
        still = await still_linked(self.entries, self.st.store, missing, remote) \
            if missing else {}
        for name, (entry, _) in list(fetched.items()):
            if entry.type != "link":
                continue
            if entry.link in objects:
                fetched[name] = objects[entry.link]
                continue
            del fetched[name]
            if still.get(name) is None:
                remote.pop(name, None)     # removed meanwhile: gone, not corrupt
            elif still[name]:
                log.error("link %r names a missing inode object %s (EIO for that name)",
                          name, entry.link)
                corrupt.add(name)
            # else: it names another object now; the next listing takes it

    @no_await
    def _holder_of(self, entry: Entry) -> Inode | None:
        """The inode this node holds, under another name, for a linked entry."""
        if not entry.link:
            return None
        ino = self.st.ns.ino_of_link_id(entry.link)
        holder = self.st.ns.maybe_get(ino) if ino is not None else None
        return holder if holder is not None and holder.parent else None

    @no_await
    def _forget_subtree(self, inode: Inode, parent: int | None = None,
                        name: bytes | None = None, top: bool = True) -> None:
        """Drop a name that vanished from the store (another node removed it); by
        default the inode's first name.  What this node still has work for (dirty,
        open for writing, queued, locked) stays, and so do the directories leading to
        it: another node may have *moved* the directory, and the listing of its new
        place takes it back whole (``_move_here``).  A hard-linked inode stays while it
        has a name."""
        if inode.type == "dir":
            for child_name, child in self.st.ns.children(inode.ino):
                child_inode = self.st.ns.get(child)
                if child_inode.dirty or self.st._writers(child) or child in self.st.queue.queued:
                    continue
                self._forget_subtree(child_inode, inode.ino, child_name, top=False)
            if not top and self.st.ns.has_children(inode.ino):
                return
        if parent is None:
            parent, name = inode.parent, inode.name
        if (parent, name) in inode.names:   # else taken already (``_move_here``)
            self.st.ns.unlink(inode, parent, name)
        if self.st.invalidate_entry is not None and name is not None:
            # The kernel forgets the dentry now, not at its entry timeout (a task: the
            # notification must not be awaited inside the apply phase).
            self.st.nursery.start_soon(self.st.invalidate_entry, parent, name)
        if not inode.parent and not self.st._is_open(inode.ino) and \
                not (inode.type == "dir" and self.st.ns.has_children(inode.ino)):
            self.delete_inode(inode)
        self.st.invalidate(inode.ino)


async def still_linked(entries: EntryIO, store: ObjectStore,
                       missing: dict[bytes, str | None],
                       remote: dict[bytes, tuple[str, str]]
                       ) -> dict[bytes, bool | None]:
    """Each name's entry read again, for links whose object was missing: True, it
    still links to that object (or cannot be read now); False, it names another
    object now; None, it is gone."""
    still: dict[bytes, bool | None] = {}

    async def read_again(name: bytes, link_id: str | None) -> None:
        try:
            body, _ = await entries._store(store.get, remote[name][0])
        except NotFound:
            still[name] = None
            return
        except FsError:
            still[name] = True     # unknown now: as read, answered as corrupt
            return
        try:
            again = Entry.from_json(body, MAX_CHUNK_SIZE)
        except BadEntry:
            still[name] = True
            return
        still[name] = again.type == "link" and again.link == link_id

    async with trio.open_nursery() as nursery:
        for name, named in missing.items():
            nursery.start_soon(read_again, name, named)
    return still
