"""The claims this node sent (a rename's, an rmdir's), by the key they claim: a claim
whose reply was lost is found on the next try of its rename or rmdir, live, and must be
known as this node's own -- taken for another node's, an rmdir waited out its 60 s TTL
and a sync rename or rmdir answered ENOENT (decision 0016, addendum of stop 46).  Kept
in memory, the latest ``KEPT``: a claim sent before a restart is replayed from the
journal or expires.

Knows entries' claim fields; nothing of the store, the namespace or FUSE."""

from __future__ import annotations

from collections import OrderedDict

from ..format.remote import Entry

KEPT = 4096


class SentClaims:
    """Claim times (``moving_at``) by claimed key, the latest ``KEPT``."""

    def __init__(self) -> None:
        self._at: OrderedDict[str, float] = OrderedDict()

    def sent(self, key: str, moving_at: float) -> None:
        """Before the claim's PUT goes."""
        self._at[key] = moving_at
        self._at.move_to_end(key)
        while len(self._at) > KEPT:
            self._at.popitem(last=False)

    def own(self, key: str, entry: Entry) -> bool:
        """Whether ``entry``'s claim is the one this node sent on ``key``."""
        return bool(entry.moving_at) and self._at.get(key) == entry.moving_at

    def forget(self, key: str) -> None:
        self._at.pop(key, None)
