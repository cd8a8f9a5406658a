"""The writer's half of the gc/dedup protocol (decision 0003): may this node reference
a chunk it did not just upload, and what must it do first?

gc publishes its progress in one small object, ``gc/state.json`` (``GcState``): the
current pass's generation and phase, the set of chunks that pass may delete (its
*candidates*, condemned by the pass before), the set the next pass may delete, and the
candidate sets of recent passes.  A writer

- remembers each chunk it has verified in the store with the generation it verified it
  at; that memory is trusted until a pass whose candidates contain the chunk has
  started since (then one HEAD, or a PUT if it is gone);
- re-PUTs (touches) a chunk that is a candidate of a pass in its marking phase, so that
  pass sees it as re-put and keeps it;
- waits for a pass in its deleting phase to end before referencing one of its
  candidates;
- sends every entry PUT within ``settle / 2`` of reading the state it checked against.

``GuardedStore`` (guarded_store.py) applies the last three rules to every entry PUT of
the daemon, whichever code path makes it (publish, rename, attribute change, journal
replay).
Blocking; runs in worker threads.  Knows nothing of inodes, FUSE or LMDB.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..format.chunkid import sha256_of
from ..format.remote import chunk_key
from ..store import NotFound, ObjectStore, StoreError

log = logging.getLogger(__name__)

GC_STATE_KEY = "gc/state.json"
GC_CANDIDATES_PREFIX = "gc/candidates/"
GC_CLOCK_KEY = "gc/clock"
DEFAULT_SETTLE = 600.0
IDLE, MARKING, DELETING = "idle", "marking", "deleting"


def candidates_key(generation: int) -> str:
    return f"{GC_CANDIDATES_PREFIX}{generation:012d}.json"



@dataclass
class _StateRead:
    """One GET of the gc state that concurrent callers wait on."""

    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[GcState, float] | None = None
    error: BaseException | None = None

    def wait(self) -> tuple[GcState, float]:
        """The leader's answer, or its failure raised here too."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.result is not None, "a read is done with a result or an error"
        return self.result

class ChunkGone(StoreError):
    """An entry would reference a chunk that gc has collected: publish again (the
    uploader PUTs it again from the local bytes)."""


@dataclass
class GcState:
    """The contents of ``gc/state.json``."""

    generation: int = 0               # the newest pass that started (0: none yet)
    phase: str = IDLE
    candidates: str | None = None     # running pass: key of the set it may delete
    next: str | None = None           # idle: key of the set the next pass may delete
    history: list[tuple[int, str | None]] = field(default_factory=list)
    settle: float = DEFAULT_SETTLE
    lease: float = 0.0                # running pass: seconds after this state's PUT
                                      # within which it sends its last DELETE
    owner: str = ""                   # the gc run that wrote it (no two bodies alike)

    @property
    def running(self) -> bool:
        return self.phase in (MARKING, DELETING)

    def to_json(self) -> bytes:
        return json.dumps({"v": 1, "generation": self.generation, "phase": self.phase,
                           "candidates": self.candidates, "next": self.next,
                           "history": [[g, k] for g, k in self.history],
                           "settle": self.settle, "lease": self.lease,
                           "owner": self.owner},
                          separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, body: bytes) -> "GcState":
        try:
            doc = json.loads(body)
            state = cls(generation=int(doc["generation"]), phase=str(doc["phase"]),
                        candidates=doc.get("candidates"), next=doc.get("next"),
                        history=[(int(g), k) for g, k in doc.get("history", [])],
                        settle=float(doc.get("settle", DEFAULT_SETTLE)),
                        lease=float(doc.get("lease", 0.0)),
                        owner=str(doc.get("owner", "")))
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"{GC_STATE_KEY} is corrupt: {exc}") from None
        if state.phase not in (IDLE, MARKING, DELETING):
            raise StoreError(f"{GC_STATE_KEY} has unknown phase {state.phase!r}")
        return state


def read_candidates(store: ObjectStore, key: str) -> frozenset[str]:
    body, _ = store.get(key)
    try:
        chunks = json.loads(body)["chunks"]
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"{key} is corrupt: {exc}") from None
    return frozenset(str(c) for c in chunks)


class ChunkLiveness:
    """What one node knows about chunks in the store, and the gc state it last read."""

    def __init__(self, store: ObjectStore, settle: float = DEFAULT_SETTLE,
                 memory: dict[str, int | None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.store = store
        self.settle = settle              # the store's (ckptfs.json); a state may raise it
        self.memory: dict[str, int | None] = memory if memory is not None else {}
        self.touched: dict[str, int] = {}  # chunk -> pass whose marking phase saw our PUT
        self.clock = clock
        self.sleep = sleep
        self._lock = threading.Lock()
        self._flight: _StateRead | None = None     # the gc-state GET under way, shared
        self._state = GcState(settle=settle)
        self._fetched = float("-inf")     # clock() when the GET of the state was sent
        self._sets: dict[str, frozenset[str]] = {}
        self.state_reads = 0
        self.touches = 0

    # ------------------------------------------------------------------ the gc state

    def fresh_for(self, state: GcState) -> float:
        return max(self.settle, state.settle) / 2

    def state(self, force: bool = False) -> tuple[GcState, float]:
        """The gc state, read at most ``settle / 2`` ago, and when that read was sent.

        One read at a time, shared: the uploads of a close that all need a fresh state
        wait for the same GET and share its answer or its failure (a hanging store
        costs them one ``store_timeout``, not one each)."""
        with self._lock:
            now = self.clock()
            if not force and now - self._fetched <= self.fresh_for(self._state):
                return self._state, self._fetched
            joined = self._flight
            if joined is None:
                flight = self._flight = _StateRead()
        if joined is not None:
            return joined.wait()
        try:
            try:
                body, _ = self.store.get(GC_STATE_KEY)
                state = GcState.from_json(body)
            except NotFound:
                state = GcState(settle=self.settle)
            with self._lock:
                self.state_reads += 1
                self._state, self._fetched = state, now
            flight.result = (state, now)
            return flight.result
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self._lock:
                self._flight = None
            flight.done.set()

    def _set(self, key: str | None) -> frozenset[str]:
        if key is None:
            return frozenset()
        found = self._sets.get(key)
        if found is None:
            try:
                found = read_candidates(self.store, key)
            except NotFound:
                # Pruned by gc: every memory that needed it is older than the history.
                found = frozenset()
            self._sets[key] = found
        return found

    def candidates_now(self, state: GcState) -> frozenset[str]:
        return self._set(state.candidates) if state.running else frozenset()

    def _settled(self, sha: str) -> GcState:
        """A state in which ``sha`` is not a candidate of a pass that is deleting now:
        waits for such a pass to finish (or for its lease to run out)."""
        state, _ = self.state()
        waited_for: tuple[int, float] | None = None
        while state.phase == DELETING and sha in self.candidates_now(state):
            now = self.clock()
            if waited_for is None or waited_for[0] != state.generation:
                waited_for = (state.generation, now)
                log.info("chunk %s is being collected by gc pass %d: waiting for it to "
                         "finish", sha[:12], state.generation)
            # The pass sends no DELETE after its lease (counted from its PUT's response,
            # up to settle/2 after we could first see it); one may take settle/2 to land.
            if now - waited_for[1] > state.lease + state.settle:
                log.warning("gc pass %d outlived its lease; going on", state.generation)
                return GcState(generation=state.generation, settle=state.settle,
                               history=[*state.history, (state.generation, state.candidates)])
            self.sleep(min(1.0, max(0.05, state.settle / 4)))
            state, _ = self.state(force=True)
        return state

    # ------------------------------------------------------------------ memory

    # A memory is the generation of the first pass that could delete the chunk without
    # this node noticing: verified under state generation g (idle, or running with the
    # chunk not its candidate, or touched), pass g will not delete it, so g + 1.

    def memory_valid(self, sha: str, state: GcState) -> bool:
        """True if no pass that may have deleted ``sha`` started since we verified it."""
        seen_at = self.memory.get(sha)
        if seen_at is None:
            return False
        if state.generation == 0 or seen_at > state.generation:
            return True
        if not state.history or state.history[0][0] > max(seen_at, 1):
            return False    # older than the history gc keeps: ask the store
        return not any(g >= seen_at and sha in self._set(key) for g, key in state.history)

    def remember(self, sha: str, generation: int) -> None:
        self.memory[sha] = generation + 1

    # ------------------------------------------------------------------ uploader

    def plan_upload(self, sha: str) -> tuple[str, int]:
        """("skip" | "head" | "put", generation) for a chunk about to be uploaded.  "put"
        is a touch: a candidate of a pass in its marking phase."""
        state = self._settled(sha)
        if sha in self.candidates_now(state):
            return "put", state.generation
        if self.memory_valid(sha, state):
            return "skip", state.generation
        return "head", state.generation

    def uploaded(self, sha: str, generation: int, action: str) -> None:
        if action == "put":
            self.touched[sha] = generation
        self.remember(sha, generation)

    # ------------------------------------------------------------------ entry PUTs

    def guard_entry(self, chunks: Iterable[str]) -> None:
        """Make every chunk an entry is about to reference safe to reference; returns
        with a state read less than ``settle / 2`` ago (the caller PUTs right away)."""
        wanted = list(dict.fromkeys(chunks))
        while True:
            for sha in wanted:
                state = self._settled(sha)
                if sha in self.candidates_now(state):
                    if self.touched.get(sha) != state.generation:
                        self._touch(sha, state.generation)
                elif sha in self.memory and not self.memory_valid(sha, state):
                    if not self.store.exists(chunk_key(sha)):
                        self.memory.pop(sha, None)
                        raise ChunkGone(f"chunk {sha[:12]} was collected by gc; "
                                        "publish again")
                    self.remember(sha, state.generation)
            state, fetched = self.state()
            if self.clock() - fetched <= self.fresh_for(state) and \
                    all(self.touched.get(s) == state.generation
                        for s in wanted if s in self.candidates_now(state)):
                return

    def _touch(self, sha: str, generation: int) -> None:
        """Re-PUT a chunk we hold no bytes of (a rename of a file it belongs to)."""
        try:
            body, _ = self.store.get(chunk_key(sha))
        except NotFound:
            self.memory.pop(sha, None)
            raise ChunkGone(f"chunk {sha[:12]} was collected by gc; publish again") from None
        self.store.put(chunk_key(sha), body, sha256=sha256_of(sha))
        self.touches += 1
        self.touched[sha] = generation
        self.remember(sha, generation)


def entry_chunks(body: bytes) -> list[str]:
    """The chunk hashes a directory-entry body references (none if not a file entry)."""
    try:
        doc = json.loads(body)
        chunks = doc.get("chunks") if isinstance(doc, dict) else None
        return [c[0] for c in chunks or () if isinstance(c, list) and c and isinstance(c[0], str)]
    except (ValueError, UnicodeDecodeError, AttributeError):
        return []
