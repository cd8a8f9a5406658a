"""Entry PUTs sent and never answered (``Inode.unsure``): a lost answer, or a daemon that
died waiting for it, leaves the node not knowing whether the store took the entry.  Each
is noted -- its key and the identity of what it holds -- before the PUT goes, and cleared
when a PUT of that key is answered; whatever moves the name away or removes it takes the
notes under it, so the store step deletes what may have landed (decision 0016).

Knows inodes, the namespace's save and entry identities; nothing of the store or FUSE.
"""

from __future__ import annotations

from ..format.remote import Entry
from ..meta.namespace import Inode, Namespace


def file_identity(chunks: list[tuple[str, int]], save_id: str) -> str:
    """The identity of a file entry of the save ``save_id`` holding ``chunks``
    (``entry_identity``'s)."""
    from .entries import entry_identity     # (entries.py uses this module)
    return entry_identity(Entry(type="file", mode=0, size=sum(n for _, n in chunks),
                                chunks=list(chunks), save_id=save_id))


def note(ns: Namespace, inode: Inode, key: str, ident: str) -> None:
    """Before a PUT of the entry ``ident`` under ``key`` goes: noted and saved (with
    the inode as it is: the caller has not changed what it publishes yet)."""
    pair = [key, ident]
    if pair not in inode.unsure:
        inode.unsure.append(pair)
        ns.save(inode)


def answered(inode: Inode, key: str) -> None:
    """A PUT of ``key`` was answered: what is there now is known (the caller saves)."""
    inode.unsure = [u for u in inode.unsure if u[0] != key]


def under(inode: Inode, key: str) -> list[str]:
    """The identities noted under ``key`` (kept)."""
    return [ident for k, ident in inode.unsure if k == key]


def take(inode: Inode, key: str) -> list[str]:
    """The identities noted under ``key``, handed to the caller -- a rename's or a
    removal's record or store step -- and forgotten here (the caller saves)."""
    taken = under(inode, key)
    if taken:
        answered(inode, key)
    return taken


def hand_over(giver: Inode, taker: Inode, key: str) -> None:
    """``taker`` now has the name ``key`` that ``giver`` had (a rename over it, an
    exchange): the notes under it go with the name, so that whatever later moves or
    removes the name takes them (the caller saves both)."""
    for ident in take(giver, key):
        if [key, ident] not in taker.unsure:
            taker.unsure.append([key, ident])
