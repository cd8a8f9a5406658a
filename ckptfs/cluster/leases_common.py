"""What both sides of the cluster seal leases share (decision 0004; the overview is in
``leases.py``): the store keys, the records of a held lease and of a pending seal, the
request counters, and ``LeaseBook``, the one place their tables live.

Knows the namespace (for paths and the node id) and the store; knows nothing of when a
lease is taken or a seal retried (``leases_held.py``, ``leases_pending.py``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import trio

from ..errors import FsError
from ..meta.namespace import Namespace
from ..store import ObjectStore

LEASE_ROOT = "leases/"
DEAD_FACTOR = 2.0            # unrenewed for lease_ttl × this: the holder is dead
MAX_POLL = 2.0               # a pending seal LISTs the leases at most this far apart
_META_NODE = "lease_node_id"


def lease_prefix(dir_id: str) -> str:
    return f"{LEASE_ROOT}{dir_id}/"


def lease_key(dir_id: str, node_id: str) -> str:
    return lease_prefix(dir_id) + node_id


@dataclass
class LeaseStats:
    puts: int = 0
    deletes: int = 0
    lists: int = 0
    gets: int = 0


@dataclass
class Held:
    """This node's lease on one staged directory."""

    dir_ino: int
    dir_id: str
    files: set[int] = field(default_factory=set)     # open for writing or unpublished
    broken: set[str] = field(default_factory=set)    # abandoned names: never renewed
    acquired: bool = False                           # the object is (believed) in the store
    last_put: float = 0.0                            # monotonic time of the last PUT
    idle_since: float | None = None                  # monotonic; set while files is empty
    seq: int = 0
    lock: trio.Lock = field(default_factory=trio.Lock)   # one store request at a time
    retry_at: float = 0.0                            # monotonic; after a failed request
    failures: int = 0                                # in a row; 0 while requests succeed


@dataclass
class Pending:
    """A seal this node was asked for, waiting for leases to go."""

    ino: int
    dir_id: str
    since: float                                     # wall time, for the status only
    next_check: float = 0.0                          # monotonic
    checks: int = 0                                  # LISTs so far (the poll backs off)
    waiting_for: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    local_writers: int = 0
    logged: bool = False
    logged_dead: set[str] = field(default_factory=set)
    seen: dict[str, tuple[str, float, float]] = field(default_factory=dict)
    checking: bool = False


class LeaseBook:
    """The tables both sides read: leases held (by staged directory), which directory
    each writing file counts under, seals pending; the node id, the counters, and the
    event that wakes the pending-seal loop early."""

    def __init__(self, ns: Namespace, store: ObjectStore) -> None:
        self.ns = ns
        self.store = store
        self.held: dict[int, Held] = {}          # staged dir ino -> lease
        self.file_dir: dict[int, int] = {}       # file ino -> staged dir ino it counts under
        self.pending: dict[int, Pending] = {}    # staged dir ino -> waiting seal
        self.stats = LeaseStats()
        self.wake_event = trio.Event()           # replaced by the pending loop each round
        node = ns.meta_get(_META_NODE)
        if node is None:
            node = uuid.uuid4().hex[:16]
            ns.meta_put(_META_NODE, node)
        self.node_id = node

    def wake(self) -> None:
        """Something a pending seal waits for may have changed: look now."""
        self.wake_event.set()

    async def call(self, fn, *args, abandon_on_cancel: bool = False):
        return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=abandon_on_cancel)

    def path(self, ino: int) -> str:
        try:
            return self.ns.path_of(ino).decode(errors="replace")
        except FsError:
            return f"<inode {ino}>"
