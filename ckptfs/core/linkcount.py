"""Counting one name out of a hard-linked file's shared inode object, by its link id
(decision 0008), for the node whose write replaced that name's link entry in the store
-- which need not hold the linked file at all: another node renamed one of its names
over a name this node then renamed a file onto (soak seed 1215583).

Only the node whose compare-and-swap took the link entry away counts it out (an unlink
that finds another node's object under the name counts nothing, ``names.py``): a link
counted out twice takes the object while another name still links it, and that name
then answers EIO.  The object is rewritten as the store has it, with one name less
(compare-and-swap on its ETag); it goes only with its last counted name.  Nothing of
this node's view of the file is written: a node holding it adopts the count at its next
compare-and-swap on the object, which this one makes fail.

Knows the store's inode objects and the retry of ``EntryIO``; nothing of FUSE or of the
metadata log (``count_out_link`` nothing of this node's inodes either).
"""

from __future__ import annotations

import errno
import functools
import logging
import uuid

from ..errors import FsError
from ..format.remote import MAX_CHUNK_SIZE, BadEntry, Entry, inode_key
from ..store import NotFound, PreconditionFailed
from ..meta.namespace import Inode
from .entries import EntryIO, counted_with, entry_identity

log = logging.getLogger(__name__)

ATTEMPTS = 8


async def count_out_link(entries: EntryIO, link_id: str, count_id: str | None = None
                         ) -> None:
    """One name fewer in the shared object ``link_id``; the object goes with its last
    name.  An object already gone stays gone; one whose count says no name is left
    (corrupt, or older than counts) is left as it is, with a WARNING: never deleted on
    a count that cannot be right.  ``count_id``: this count-out's id, the same in every
    try of it (a record's, kept in the record): an object that holds it already
    (``Entry.counted``) had it made by a try whose reply was lost, and is left as it is
    -- counted again, the object went while another name still linked it."""
    key = inode_key(link_id)
    store = entries.st.store
    count_id = count_id or uuid.uuid4().hex
    for _ in range(ATTEMPTS):
        try:
            body, etag = await entries._store(store.get, key)
        except NotFound:
            return
        try:
            obj = Entry.from_json(body, MAX_CHUNK_SIZE)
        except BadEntry as exc:
            raise FsError(errno.EIO, f"corrupt inode object {key}: {exc}") from None
        if count_id in obj.counted:
            return                  # made already: its reply was lost
        try:
            if obj.nlink == 1:
                await entries._store(functools.partial(store.delete, key, if_match=etag))
            elif obj.nlink > 1:
                obj.nlink, obj.counted = obj.nlink - 1, counted_with(obj.counted, count_id)
                await entries._store(functools.partial(store.put, key, obj.to_json(),
                                                       if_match=etag))
            else:
                log.warning("inode object %s counts no name, yet one more linked it: left "
                            "as it is", key)
            return
        except PreconditionFailed:
            continue        # changed meanwhile (another count, a save): read it again
    raise FsError(errno.EIO, f"{key} keeps changing; link count not changed")


async def count_out_replaced(entries: EntryIO, replaced: Entry | None,
                             holder: Inode | None) -> None:
    """A rename's write replaced ``replaced`` under its new name: a link is counted
    out of its object -- through ``holder``, the inode this node knew there, when it is
    that linked file, else by id (another node's rename put the link there since this
    node looked).  Nothing when the rename replaced no link: one renamed away by
    another node meanwhile is that node's, and counting it out would delete the
    object under its new name."""
    if replaced is None or replaced.type != "link" or not replaced.link:
        return
    if holder is not None and holder.link_id == replaced.link:
        await entries._change_nlink(holder, -1)
    else:
        await count_out_link(entries, replaced.link)


async def unlink_linked(entries: EntryIO, inode: Inode, key: str) -> None:
    """Remove ``key``, a name of the hard-linked ``inode``: the link this node knows
    there goes and is counted out.  Another node's object there now (its rename over the
    name, which counted the link out itself) stays, and nothing is counted: the serial
    order is this unlink, then that rename."""
    if await entries._delete_if_same(key, entry_identity(entries._entry_of(inode))):
        await entries._change_nlink(inode, -1)
