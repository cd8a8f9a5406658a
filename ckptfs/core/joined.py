"""A directory made here whose name another node made meanwhile (two ranks'
``makedirs``, or this node's own put before a restart): the directory there is joined,
with its id, and what this node already published under its own id moves over.  Another
object under the name is a conflict (``NameTaken``): the caller keeps the directory
under a name of its own.

Knows the namespace, the leases' directory ids and the store's entries; nothing of FUSE
or of how the metadata log orders its records (the caller runs this for a mkdir record).
"""

from __future__ import annotations

import errno
import logging

from ..errors import FsError
from ..format.remote import MAX_CHUNK_SIZE, BadEntry, Entry, entry_key
from ..meta.namespace import Inode
from ..store import NotFound
from .conflicts import NameTaken
from .entries import EntryIO
from .state import CoreState, dir_id_of

log = logging.getLogger(__name__)


async def join_dir(st: CoreState, entries: EntryIO, inode: Inode, key: str) -> None:
    """The name was taken in the store meanwhile (two ranks' ``makedirs``, or this
    node's own put before a restart): a directory there is joined, with its id."""
    try:
        body, etag = await entries._store(st.store.get, key)
    except NotFound:
        raise FsError(errno.EIO, f"{key} vanished while creating it") from None
    try:
        other = Entry.from_json(body, MAX_CHUNK_SIZE)
    except BadEntry as exc:
        raise NameTaken(f"the store's entry {key} is corrupt ({exc})") from None
    if other.type != "dir":
        raise NameTaken(f"another node made {key} a {other.type}")
    old_id = dir_id_of(inode)
    if other.id is None:
        raise NameTaken(f"the store's entry {key} is a directory without an id")
    if other.id != old_id:
        log.info("%s was created by another node too: joined its directory",
                 st._path_for_log(inode))
        await st.leases.dir_id_changed(inode.ino, other.id)
        st.oplog.alias(old_id, other.id)
        st.ns.change_dir_id(inode, other.id)
        inode.staged = other.staged
    inode.published, inode.remote_etag, inode.listed_at = True, etag, 0.0
    st.ns.save(inode)
    if other.id != old_id:
        await _rehome_children(st, entries, inode, old_id)
    if inode.attrs_unsent:
        # Changed here since (a chmod while the mkdir waited): the joined entry does
        # not have it yet.  Sent now; another node's newer changes stay.
        await entries._rewrite_entry(inode, key)


async def _rehome_children(st: CoreState, entries: EntryIO, inode: Inode,
                           old_id: str) -> None:
    """Entries already published under a joined directory's old id move to its
    new one (files renamed into it before it reached the store)."""
    for name, child in st.ns.children(inode.ino):
        async with st._rt(child).lock:
            child_inode = st.ns.maybe_get(child)
            if child_inode is None or not child_inode.published:
                continue
            old_key = entry_key(old_id, name)
            try:
                body, _ = await entries._store(st.store.get, old_key)
            except NotFound:
                continue
            new_key = entry_key(dir_id_of(inode), name)
            new_etag = await entries._store(st.store.put, new_key, body)
            await entries.landed(new_key)
            await entries._store(st.store.delete, old_key)
            if not child_inode.link_id:
                child_inode.remote_etag = new_etag
                st.ns.save(child_inode)
        st._drop_rt(child)
