"""A closed version taken over by a rename (DESIGN.md promise 2, decision 0006): a file
not closed yet renamed over a name whose last save has not landed in the store takes
that save as its closed version (``take_closed_version``) -- the state an ``O_TRUNC``
open over the replaced file would leave -- and publishes it under the name, so that the
save is not dropped with the replaced inode.

The save stays the *name's*: the file renamed on before a close of its own leaves it
behind (``holds_taken_version``, ``leave_taken_version``).  The name it leaves goes, as
it went here, and the file is again one with no closed version: its killed writer
leaves nothing, and the save never shows under a name it never had (soak seed 1215567:
three rounds of a rename over a fresh save and back, then the writer killed, left the
last save under the unclosed file's own name).

Knows the namespace, the staging area and the publish queue; nothing of FUSE, of the
store's protocol or of the metadata log (the callers delete the left name there).
"""

from __future__ import annotations

import logging
from typing import Callable

from ..meta.namespace import Inode
from .critical import no_await
from .entries import closed_mtime
from .state import CoreState

log = logging.getLogger(__name__)


@no_await
def take_closed_version(st: CoreState, inode: Inode, replaced: Inode) -> bool:
    """``inode``, a file with no closed version yet, replaces ``replaced``, whose last
    closed version has not landed in the store (its publish queued or refused, or its
    close decided at a last release): that version stays the name's closed version
    until ``inode``'s own close.  It becomes ``inode``'s -- a hard link of its staging
    file, published under the name -- as an ``O_TRUNC`` open over ``replaced`` would
    leave it.  Dropped with ``replaced``, the store kept the save before it (or none)
    on every node.  Whether it was taken (the caller journals the publish)."""
    if replaced.type != "file" or replaced.link_id or inode.link_id or \
            not replaced.dirty or replaced.ino in st._held_pointers or \
            not st.staging.exists(replaced.ino, replaced.ver):
        return False
    ver = inode.max_ver + 1
    st.staging.link_from(replaced.ino, replaced.ver, inode.ino, ver)
    st.ns.on_rollback(lambda: st.staging.remove(inode.ino, ver))
    inode.max_ver, inode.ver, inode.dirty, inode.local_copy = ver, ver, True, True
    inode.taken_ver = ver
    inode.closed_mtime_ns = closed_mtime(replaced)    # (its session's times are its own)
    st.ns.save(inode)
    log.info("%s: a file not closed yet replaced a save that has not landed: that save "
             "stays the name's until its close", st._path_for_log(inode))
    return True


def holds_taken_version(inode: Inode) -> bool:
    """Whether ``inode``'s closed version is one it took over by a rename (not closed
    by it since): renamed on, it leaves that version with the name."""
    return inode.type == "file" and inode.taken_ver != 0 and inode.taken_ver == inode.ver \
        and not inode.link_id


@no_await
def leave_taken_version(st: CoreState, inode: Inode,
                        forget_publish: Callable[[int], None]) -> None:
    """``inode`` moves on from the name whose save it took: it has no closed version
    again -- not dirty, not published, its pending publish forgotten.  The caller has
    deleted (sync) or logged the deletion of (async) the entry its publish left under
    the name, if one landed; the entry it held there goes with the hold (``HeldEntries``).
    Call under the inode's lock (no entry PUT of its publish in flight), in a batch."""
    ver, ino = inode.ver, inode.ino
    log.info("%s: renamed on before its own close: the save it took over stays with the "
             "name it left, which goes", st._path_for_log(inode))
    inode.ver, inode.taken_ver, inode.dirty, inode.local_copy = 0, 0, False, False
    inode.published, inode.chunks, inode.save_id, inode.remote_etag = False, [], None, None
    inode.closed_mtime_ns = None
    st.ns.save(inode)
    forget_publish(ino)
    if ino in st.queue.queued or ino in st.queue.failed:
        st.queue.discard(ino)
        st.ns.on_rollback(lambda: st.queue.submit(ino))
    st.cache.untrack_local(ino)

    def drop_staging() -> None:
        rt = st.runtime.get(ino)
        if not (rt and (rt.refs.get(ver) or (rt.session and rt.session.ver == ver))):
            st.staging.remove(ino, ver)
    st.ns.after_commit(drop_staging)


@no_await
def hand_owed_version_to(st: CoreState, old: Inode, fresh: Inode) -> None:
    """``fresh`` has just taken the names of ``old`` beside ``old``'s readers
    (``Opening._fresh_inode_for_name``) while ``old``'s last closed version is still
    owed to the store: that version becomes ``fresh``'s closed version -- a hard link of
    its staging file -- and ``old``'s pending publish, with its place in the metadata
    log, becomes ``fresh``'s.  ``old``, nameless, keeps its staging file for its readers
    and owes the store nothing (a publish of it in flight finds it nameless and ends).
    Call in a batch, with ``old`` unlocked and ``may_hand_over(old)``."""
    ver = fresh.max_ver + 1
    st.staging.link_from(old.ino, old.ver, fresh.ino, ver)
    st.ns.on_rollback(lambda: st.staging.remove(fresh.ino, ver))
    fresh.max_ver, fresh.ver, fresh.dirty, fresh.local_copy = ver, ver, True, True
    # (no session here: the closed version's mtime is the file's; a field that says
    #  "a session is open" would keep a later utime from the store and the restart)
    fresh.size, fresh.mtime_ns, fresh.closed_mtime_ns = old.size, closed_mtime(old), None
    fresh.attrs_unsent = list(old.attrs_unsent)     # (they ride with the publish)
    st.ns.save(fresh)
    old.dirty, old.attrs_unsent = False, []         # (its staging file: its readers')
    st.ns.save(old)
    epoch = st._publish_epoch.get(old.ino, 0)
    st.ns.publish_pending_add(fresh.ino, epoch)
    st.ns.publish_pending_done(old.ino)

    def hand_over() -> None:
        st._publish_epoch.pop(old.ino, None)
        st._publish_epoch[fresh.ino] = epoch
        since = st.queue.since.get(old.ino)     # (status: pending since the close)
        st.queue.discard(old.ino)
        if since is not None:
            st.queue.since.setdefault(fresh.ino, since)
        st.queue.submit(fresh.ino)
        st.leases.handed_over(old.ino, fresh.ino)   # (a checkpoint's seal waits for it)
    st.ns.after_commit(hand_over)
    log.info("%s: saved over beside a reader before its last save reached the store: "
             "that save goes on from a fresh inode", st._path_for_log(fresh))


def may_hand_over(st: CoreState, inode: Inode) -> bool:
    """Whether ``inode``'s owed closed version can go to a fresh inode
    (``hand_owed_version_to``): a plain file's own closed version, staged, with no
    write session, no pointer waiting for a seal and no hold on another name.  Async
    mode only: a sync close publishes its version itself and returns once it is in
    the store (moved, the close found it nameless and returned at once).  Not while a
    handle that wrote is open: the kernel may write on into that staging file through
    it (a passthrough writer's child), which the fresh inode's link would then show
    and never publish."""
    rt = st.runtime.get(inode.ino)
    writing = rt is not None and any(
        h is not None and h.writable for h in map(st.handles.get, rt.handles))
    return st.config.durability == "async" and not writing and \
        inode.type == "file" and inode.dirty and not inode.link_id and \
        not inode.links_pending and not inode.held and not holds_taken_version(inode) and \
        inode.ino not in st._held_pointers and not (rt is not None and rt.session) and \
        st.staging.exists(inode.ino, inode.ver)
