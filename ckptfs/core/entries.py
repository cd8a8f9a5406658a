"""Entry I/O: the one place that maps an ``Inode`` to its remote entry and back, and puts,
rewrites (compare-and-swap) or deletes entries.  Must not know FUSE, handles or the
publish queue."""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import trio

from ..errors import FsError
from ..meta.namespace import Inode
from ..format.remote import (COUNTED_KEPT, MAX_CHUNK_SIZE, BadEntry, Entry, entry_key,
                             inode_key)
from ..store import NotFound, PreconditionFailed, StoreClosed, StoreError
from ..store.health import outage_cause

from . import unsure
from .conflicts import NameTaken
from .critical import no_await
from .state import CoreState, dir_id_of, link_id_of

log = logging.getLogger(__name__)


class EntryIO:
    """The inode <-> remote entry mapping; no state of its own."""

    def __init__(self, st: CoreState,
                 landed: Callable[[str], Awaitable[None]]) -> None:
        self.st = st
        # What a write of a new name does after its PUT: a directory removed meanwhile
        # by another node comes back (``removals.DirRemovals.landed``, decision 0028).
        self.landed = landed

    @no_await
    def adopt(self, parent: int, name: bytes, entry: Entry, etag: str | None) -> Inode:
        """A name this node learns from an entry the store has (a listing; a held entry
        shown again): a published inode of its own (no await)."""
        size = len(entry.target) if entry.target is not None else entry.size
        return self.st.ns.new_inode(parent, name, entry.type, entry.mode, entry.uid,
                                    entry.gid, size=size, chunks=entry.chunks,
                                    published=True, remote_etag=etag, dir_id=entry.id,
                                    target=entry.target, mtime_ns=entry.mtime_ns,
                                    rdev=entry.rdev, xattrs=dict(entry.xattrs),
                                    link_id=entry.link,
                                    remote_nlink=entry.nlink if entry.link else 0,
                                    link_counted=list(entry.counted),
                                    staged=entry.staged and entry.type == "dir",
                                    sealed_at=entry.sealed_at, save_id=read_save_id(entry))

    def _entry_of(self, inode: Inode) -> Entry:
        """The entry a name of ``inode`` has in its directory: the whole object, or for
        a hard-linked inode a "link" entry naming its shared inode object (0008)."""
        if inode.link_id:
            return Entry(type="link", mode=0, link=inode.link_id)
        return content_entry(inode)

    async def _store(self, fn, *args, abandon_on_cancel: bool = False):
        async with self.st.meta_limiter:
            try:
                return await trio.to_thread.run_sync(fn, *args,
                                                     abandon_on_cancel=abandon_on_cancel)
            except (NotFound, PreconditionFailed):
                raise
            except StoreClosed as exc:   # unmounting: calls in flight are given up
                log.info("store call given up: %s", exc)
                raise FsError(errno.EIO, str(exc)) from None
            except StoreError as exc:
                if self.st.store_health.unavailable and outage_cause(exc) is not None:
                    log.debug("store error: %s", exc)   # the outage is said once (0016)
                else:
                    log.error("store error: %s", exc)
                raise FsError(errno.EIO, str(exc)) from None

    async def put_new(self, key: str, body: bytes, *, empty_is_free: bool = False,
                      abandon_on_cancel: bool = False) -> str | None:
        """Write a new name's entry only if the name is free: the new ETag, or None when
        ``key`` holds another entry.  ``body`` found there is this node's own write whose
        answer was lost (a retry then met its own object): taken as written.

        ``empty_is_free``: an EMPTY object there counts as free (a PUT cut short: no
        ckptfs writer writes an empty entry; SeaweedFS kept one for a daemon SIGKILLed
        mid-PUT before put_if_absent sent a checksum).  Only for a name the caller knows
        was free when it looked -- the name is not in its listing's corrupt set
        (``Names._check_absent``) -- so the empty object is a new name's torn write, not
        an entry an older release emptied while its node still holds the file.  It is
        replaced only while it is still that empty object (If-Match its ETag)."""
        for _ in range(3):
            created = await self._store(self.st.store.put_if_absent, key, body,
                                        abandon_on_cancel=abandon_on_cancel)
            if created:
                return created
            try:
                held, etag = await self._store(self.st.store.get, key,
                                               abandon_on_cancel=abandon_on_cancel)
            except NotFound:
                continue                        # removed meanwhile: free again
            if bytes(held) == body:
                return etag                     # ours: the answer to our write was lost
            if held or not empty_is_free:
                return None
            log.warning("%s: the store held an empty object there (a write cut short); "
                        "replaced with this node's entry", key)
            try:
                return await self._store(functools.partial(self.st.store.put, key, body,
                                                           if_match=etag),
                                         abandon_on_cancel=abandon_on_cancel)
            except PreconditionFailed:
                continue                        # written meanwhile (by us?): look again
        return None

    def _key_of(self, inode: Inode) -> str:
        """Where ``inode``'s content entry lives: its shared inode object once it is
        hard-linked (decision 0008), else the entry of its name."""
        if inode.link_id:
            return inode_key(link_id_of(inode))
        return entry_key(dir_id_of(self.st.ns.get(inode.parent)), inode.name)

    async def _put_entry(self, inode: Inode) -> None:
        if inode.link_id:
            await self._put_linked(inode)
            return
        parent = self.st.ns.get(inode.parent)
        key = entry_key(dir_id_of(parent), inode.name)
        # A compare-and-swap on the entry this node knows (none: a new name): a save
        # over a file keeps what another node changed of its attributes since, or made
        # of the name meanwhile (``_keep_attributes``).
        known = inode.remote_etag if inode.published else None
        for _ in range(8):
            body = self._entry_of(inode).to_json()
            if known is None:
                etag = await self._store(self.st.store.put_if_absent, key, body)
                if etag:
                    break
            else:
                try:
                    etag = await self._store(functools.partial(self.st.store.put, key,
                                                               body, if_match=known))
                    break
                except PreconditionFailed:
                    pass
            refused, known = known, await self._keep_attributes(inode, key)
            if known is not None and known == refused:
                # The ETag just read is the one the store refused: it does not honour
                # If-Match (mounted --single-writer): written over, as before.
                etag = await self._store(self.st.store.put, key, self._entry_of(inode).to_json())
                break
        else:
            raise FsError(errno.EIO, f"{key} keeps changing; not published")
        inode.remote_etag = etag
        inode.published = True
        inode.attrs_unsent = []
        unsure.answered(inode, key)         # what the store has there is known now
        self.st.ns.save(inode)
        await self.landed(key)

    async def _keep_attributes(self, inode: Inode, key: str) -> str | None:
        """The entry under ``key`` changed since this node's view of it.  A save over a
        file keeps the mode, owner and ``user.*`` attributes the store's file has now
        (another node's chmod stays), as POSIX keeps them across an ``O_TRUNC`` write,
        unless this node changed its own since (``attrs_unsent``).  The content and
        mtime are this save's (the last close wins, decision 0005).  Returns the ETag
        to write over; None where the name is gone (written again); NameTaken where it
        is no file now (another node's directory: never written over) but the entry
        this file holds there (renamed over it, held.py), or does not parse."""
        try:
            body, etag = await self._store(self.st.store.get, key)
            entry = Entry.from_json(body, MAX_CHUNK_SIZE)
        except NotFound:
            return None
        except BadEntry:
            return etag         # written over, as an unconditional save did
        if same_object(entry, {h[2] for h in inode.held}):
            return etag
        if entry.type != "file":
            raise NameTaken(f"another node made {key} a {entry.type}",
                            link=entry.link if entry.type == "link" else None)
        take_attributes(inode, entry, mtime=False)
        return etag

    async def _put_linked(self, inode: Inode) -> None:
        """Publish a hard-linked inode: one PUT of its inode object (the content of
        every name at once), then — the first time — the link entries of its names."""
        key = inode_key(link_id_of(inode))
        if inode.links_pending and not inode.published:
            inode.remote_nlink = len(inode.names)
            etag = await self.put_new(key, content_entry(inode).to_json(),
                                      empty_is_free=True)     # a fresh uuid's key
            if not etag:
                raise FsError(errno.EIO, f"{key} exists already")
            inode.remote_etag, inode.published, inode.attrs_unsent = etag, True, []
            self.st.ns.save(inode)
        else:
            await self._rewrite_entry(inode)
        if inode.links_pending:
            link = self._entry_of(inode)
            body = link.to_json()
            for parent, name in inode.names:
                key = entry_key(dir_id_of(self.st.ns.get(parent)), name)
                unsure.note(self.st.ns, inode, key, entry_identity(link))  # as a publish
                await self._store(self.st.store.put, key, body)
                unsure.answered(inode, key)
                await self.landed(key)
                # A listing of that directory that LISTed before this PUT must not take
                # the name for one another node removed (refresh.py's apply).
                self.st._touch_dir(parent)
            inode.links_pending = False
            self.st.ns.save(inode)

    async def unput(self, key: str, etag: str, what: str) -> None:
        """Take back an entry this node just put, whose local half failed."""
        try:
            await self._store(functools.partial(self.st.store.delete, key, if_match=etag))
        except (FsError, StoreError) as exc:
            log.warning("%s failed here but its entry %s stays in the store: %s", what, key,
                        exc)

    async def unput_link(self, inode: Inode, key: str, etag: str) -> None:
        """Take back a link's entry and count, put before its local half failed."""
        await self.unput(key, etag, "link")
        try:
            await self._change_nlink(inode, -1)
        except (FsError, StoreError) as exc:
            log.warning("link failed here but the link count of %s stays one higher in "
                        "the store: %s", inode.link_id, exc)

    async def _change_nlink(self, inode: Inode, delta: int) -> None:
        """Count a name more or less in a hard-linked inode's object (compare-and-swap
        on its ETag); the object goes with its last name.  The change carries an id of
        its own (``Entry.counted``): a try that meets its own earlier write, whose reply
        was lost, ends there instead of counting the name twice."""
        key = inode_key(link_id_of(inode))
        etag = inode.remote_etag
        count_id = uuid.uuid4().hex
        for _ in range(8):
            if etag is None:
                try:
                    entry, etag = await self._current_entry(inode, key)
                except FsError as exc:
                    if exc.errno == errno.ENOENT and delta < 0:
                        return   # gone already
                    raise
                self._adopt_newer(inode, entry, etag)
                if count_id in inode.link_counted:
                    return      # made already: its reply was lost
            n = inode.remote_nlink + delta
            try:
                if n <= 0:
                    await self._store(functools.partial(self.st.store.delete, key, if_match=etag))
                    inode.remote_nlink, inode.remote_etag = 0, None
                else:
                    entry = content_entry(inode)
                    entry.nlink, entry.counted = n, counted_with(inode.link_counted, count_id)
                    inode.remote_etag = await self._store(
                        functools.partial(self.st.store.put, key, entry.to_json(),
                                          if_match=etag))
                    inode.remote_nlink, inode.attrs_unsent = n, []    # sent with it
                    inode.link_counted = entry.counted
                self.st.ns.save(inode)
                return
            except PreconditionFailed:
                etag = None
        raise FsError(errno.EIO, f"{key} keeps changing; link count not changed")

    async def _make_linked(self, inode: Inode) -> None:
        """The first hard link of a published inode: its content moves into a shared
        inode object (written first, If-None-Match), then its name's entry becomes a
        link to it (If-Match the entry we read: a newer version another node
        published meanwhile is adopted first, never lost)."""
        key = entry_key(dir_id_of(self.st.ns.get(inode.parent)), inode.name)
        for _ in range(8):
            entry, etag = await self._current_entry(inode, key, allow_link=True)
            if entry.claim_is_live(time.time(), self.st.config.rename_claim_ttl):
                raise FsError.enoent(f"{key} is being renamed by another node")
            if entry.type == "link":   # another node linked it meanwhile
                assert entry.link is not None   # a decoded link names its object (remote.py)
                self._adopt_link(inode, entry.link)
                inode.remote_etag = None
                return
            self._adopt_newer(inode, entry, etag)
            link_id = uuid.uuid4().hex
            content = content_entry(inode)
            obj = inode_key(link_id)
            obj_etag = await self.put_new(obj, content.to_json(),
                                          empty_is_free=True)   # a fresh uuid's key
            try:
                await self._store(functools.partial(
                    self.st.store.put, key, Entry(type="link", mode=0, link=link_id).to_json(),
                    if_match=etag))
            except PreconditionFailed:
                await self._store(self.st.store.delete, obj)
                continue
            self.st.ns.set_link_id(inode, link_id)
            inode.remote_etag, inode.remote_nlink = obj_etag or None, 1
            inode.link_counted = []         # (a new object)
            inode.attrs_unsent = []         # the object has them
            self.st.ns.save(inode)
            return
        raise FsError(errno.EIO, f"{key} keeps changing; not linked")

    def _adopt_link(self, inode: Inode, link_id: str) -> None:
        self.st.ns.set_link_id(inode, link_id)

    def _identity(self, inode: Inode) -> dict:
        """What tells that the store's entry of a name is still ``inode``'s, whatever
        this node rewrote or moved meanwhile: a directory's id, else the content."""
        return {"ident": inode_identity(content_entry(inode), inode.save_id)}

    async def _current_entry(self, inode: Inode, key: str,
                             allow_link: bool = False) -> tuple[Entry, str]:
        """The store's entry for a name this node has, checked to be the same object
        (a directory with the same id, an entry of the same type, a link to the same
        inode object; with ``allow_link`` any link, for an inode not linked here yet)."""
        try:     # (a 404 here finishes a rename, seal or attribute record: asked twice)
            body, etag = await self._store(self.st.store.get_confirmed, key)
        except NotFound:
            self.st._touch_dir(inode.parent)
            raise FsError.enoent(f"{key} was renamed or removed by another node") from None
        try:
            entry = Entry.from_json(body, MAX_CHUNK_SIZE)
        except BadEntry as exc:
            raise FsError(errno.EIO, f"corrupt entry {key}: {exc}") from None
        if entry.type == "link":
            if (inode.link_id and entry.link == inode.link_id) or \
                    (allow_link and not inode.link_id):
                return entry, etag
            self.st._touch_dir(inode.parent)
            raise FsError.enoent(f"{key} now names another object")
        if entry.type != inode.type or (inode.type == "dir" and entry.id != inode.dir_id):
            self.st._touch_dir(inode.parent)
            raise FsError.enoent(f"{key} now names another object")
        return entry, etag

    def _adopt_newer(self, inode: Inode, entry: Entry, etag: str, moves: bool = False) -> None:
        """Take the store's version of a file another node published after our view of
        it (never move or rewrite a stale version).  A version closed here and not yet
        published stays: its publish comes later and is the newest.  So do attributes
        changed here and not sent yet (``attrs_unsent``); the others are the store's."""
        if etag == inode.remote_etag:
            return
        writing = getattr(self.st.runtime.get(inode.ino), "session", None) is not None
        saved = read_save_id(entry)
        mine = saved if inode.type != "file" or inode.save_id is None else inode.save_id
        new_save = inode.type == "file" and not inode.dirty and \
            (inode.chunks, mine) != (entry.chunks, saved)
        if new_save and moved_from_its_readers(self.st, inode, writing, moves):
            raise FsError(errno.ESTALE, "another node saved it: the step goes again")
        inode.remote_etag = etag
        if entry.type == inode.type:
            # The mtime too, of a file no version of which is being written here; while
            # one is, the closed version's (the one entries sent meanwhile carry).
            take_attributes(inode, entry, mtime=inode.type == "file" and not inode.dirty
                                  and not writing)
            if writing and not inode.dirty and inode.closed_mtime_ns is not None and \
                    "mtime" not in inode.attrs_unsent:
                inode.closed_mtime_ns = entry.mtime_ns
        if inode.link_id:
            inode.remote_nlink, inode.link_counted = entry.nlink, list(entry.counted)
        inode.save_id = mine    # (a file's new save: below)
        if new_save:
            inode.chunks, inode.save_id = list(entry.chunks), saved
            if not writing:         # (the size and mtime shown are the working version's)
                inode.size = entry.size
                if "mtime" not in inode.attrs_unsent:   # a utime here is the later change
                    inode.mtime_ns = entry.mtime_ns
            if inode.local_copy:
                inode.local_copy = False
                self.st.cache.untrack_local(inode.ino)
                self.st._drop_version_if_unused(inode.ino, inode.ver)
            self.st.taken_behind_the_kernel(inode.ino)
        self.st.ns.save(inode)

    async def _rewrite_entry(self, inode: Inode, key: str | None = None, moves=False) -> None:
        """Rewrite a published entry's metadata (attributes, seal) as a compare-and-swap
        on the ETag we know: if another node changed it meanwhile we take its version
        and apply ours again; if it was renamed or removed, ENOENT — never resurrect an
        old name, never overwrite a newer file version with a stale one."""
        key = key or self._key_of(inode)
        etag = inode.remote_etag
        for _ in range(8):
            if etag is None:
                entry, etag = await self._current_entry(inode, key)
                if entry.claim_is_live(time.time(), self.st.config.rename_claim_ttl):
                    raise FsError.enoent(f"{key} is being renamed by another node")
                self._adopt_newer(inode, entry, etag, moves)
            try:
                inode.remote_etag = await self._store(
                    functools.partial(self.st.store.put, key,
                                      content_entry(inode).to_json(), if_match=etag))
                inode.published, inode.attrs_unsent = True, []
                self.st.ns.save(inode)
                return
            except PreconditionFailed:
                etag = None
        raise FsError(errno.EIO, f"{key} keeps changing; not rewritten")

    async def _delete_if_same(self, key: str, ident: str | None, *also: str) -> bool:
        """Delete the entry under ``key`` if it still holds the object ``ident`` (or one
        of ``also``: entries this node sent there unanswered) names (compare-and-swap on
        its ETag); a newer object there stays.  Whether it deleted one."""
        idents = {i for i in (ident, *also) if i}
        if not idents:
            return False
        for _ in range(8):
            try:
                body, etag = await self._store(self.st.store.get, key)
            except NotFound:
                return False
            try:
                entry = Entry.from_json(body, MAX_CHUNK_SIZE)
            except BadEntry:
                return False    # not ours to judge: left for gc and the log
            if not same_object(entry, idents):
                log.info("%s holds another object now: left as it is", key)
                return False
            try:
                await self._store(functools.partial(self.st.store.delete, key, if_match=etag))
                return True
            except PreconditionFailed:
                continue
        raise FsError(errno.EIO, f"{key} keeps changing; not deleted")


# An inode's save id when this node read its entry and the entry had none (written by
# a release before save ids): its records then say "no save id" (``@-``), which an entry
# with one does not match.  ``None`` on an inode is "not known" (a record of an older
# release), compared by content only.
READ_WITHOUT_SAVE_ID = ""


def read_save_id(entry: Entry) -> str | None:
    """The save id an inode takes from an entry it reads."""
    if entry.type == "dir":
        return None
    return entry.save_id or READ_WITHOUT_SAVE_ID


def moved_from_its_readers(st, inode: Inode, writing: bool, moves: bool) -> bool:
    """Sync mode: another node's save is about to replace the version readers here hold
    open, in the middle of a step on the file (a chmod's compare-and-swap): the name
    moves to a fresh inode (showing the version they read, until the repeated step
    takes the new one), the old inode stays the readers' -- the kernel's size of it
    stays theirs: a reader of a 1 MB version read 40 bytes of it once a 40-byte save
    was taken in.  Called before anything of the new version is taken: the fresh inode
    must show the version before.  Async mode's log applies steps later, on the inode
    it recorded: only where the caller says it ``moves`` on (``_exec_attrs``)."""
    return not writing and (moves or not st._deferred()) and st._is_open(inode.ino) and \
        st.fresh_inode_for_name(inode.ino, held_here=True)


def content_entry(inode: Inode) -> Entry:
    """The entry of ``inode``'s closed version (``closed_mtime``), whole (a hard-linked
    inode's names have "link" entries: ``EntryIO._entry_of``)."""
    return Entry(type=inode.type, mode=inode.mode, uid=inode.uid, gid=inode.gid,
                 mtime_ns=closed_mtime(inode),
                 size=inode.published_size if inode.type == "file" else 0,
                 chunks=list(inode.chunks),
                 id=inode.dir_id, target=inode.target,
                 staged=inode.staged and inode.type == "dir",
                 rdev=inode.rdev, xattrs=dict(inode.xattrs),
                 nlink=max(1, inode.remote_nlink) if inode.link_id else 1,
                 sealed_at=inode.sealed_at,
                 save_id=(inode.save_id or None) if inode.type != "dir" else None,
                 counted=list(inode.link_counted) if inode.link_id else [])


def counted_with(counted: list[str], count_id: str) -> list[str]:
    """An inode object's latest count-out ids (``Entry.counted``) with ``count_id``."""
    return [*counted, count_id][-COUNTED_KEPT:]


def closed_mtime(inode: Inode) -> int:
    """The mtime of the closed version: while a save of the file is open here, the one
    that version closed with (a write session's times are this node's until its close:
    a rename, a chmod or an older version's publish meanwhile sent them, with the old
    bytes: soak seed 1215482)."""
    return inode.mtime_ns if inode.closed_mtime_ns is None else inode.closed_mtime_ns


def take_attributes(inode: Inode, entry: Entry, *, mtime: bool) -> None:
    """The store's attributes (with ``mtime``, its mtime too), except those changed
    here and not sent yet (``attrs_unsent``): those are the later change."""
    mine = set(inode.attrs_unsent)
    if "mode" not in mine:
        inode.mode = entry.mode
    if "owner" not in mine:
        inode.uid, inode.gid = entry.uid, entry.gid
    if "xattrs" not in mine:
        inode.xattrs = dict(entry.xattrs)
    if mtime and "mtime" not in mine:
        inode.mtime_ns = entry.mtime_ns


def inode_identity(entry: Entry, save_id: str | None) -> str:
    """``entry_identity`` of an inode's entry; read here without a save id, ``@-``: an
    entry with one is then another save (``same_object``)."""
    suffix = "@-" if save_id == READ_WITHOUT_SAVE_ID else ""
    return entry_identity(entry) + suffix


def entry_identity(entry: Entry) -> str:
    """A directory's id; for anything else a digest of what it holds (type, chunks,
    size, link target, device) and, for a file, ``@`` its save id: the same after a
    rename or a mode change, different after another version was published -- even one
    of the same bytes (an empty marker file, a config written again), which is another
    node's save that a late removal of the old one must leave."""
    if entry.type == "dir":
        return f"dir:{entry.id}"
    what = json.dumps([entry.type, entry.chunks, entry.size, entry.target, entry.rdev,
                       entry.link], default=str)
    ident = f"{entry.type}:{hashlib.sha256(what.encode()).hexdigest()}"
    return f"{ident}@{entry.save_id}" if entry.save_id else ident


def same_object(entry: Entry, idents: set[str]) -> bool:
    """Whether ``entry`` is the object one of ``idents`` names.  Where either side has no
    save id (an entry or a log record written before save ids, or an entry rewritten
    by such a node) only what it holds can be compared."""
    ident = entry_identity(entry)
    if ident in idents:
        return True
    content = ident.partition("@")[0]
    return any(i.partition("@")[0] == content and (not entry.save_id or "@" not in i)
               for i in idents)
