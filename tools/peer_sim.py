"""Simulated restore of one checkpoint by 100-1 000 nodes that fetch chunks from each other
(issue 24, "beyond one machine").  Stdlib only, deterministic for a given --seed.

It answers, for a cluster too big to run here: how many bytes the store serves, how much each
node uploads, and when the last node has the whole checkpoint, with peers (with or without
the second hop) compared with every node reading from the store directly.  Not a part of
ckptfs: it imports nothing from it and must not; the protocol below is modelled, not run.

    python tools/peer_sim.py --nodes 100,300,1000 --size-gb 10 --dead 0.01 --liars 0.01

THE PROTOCOL MODELLED (the one being built on branch `peers`):
  - every chunk has an owner among the live peers by rendezvous hashing; the owner fetches it
    from the store once (single flight) and serves it to whoever asks;
  - second hop (--hop): the chunk's next RELAYS peers in the same ranking (default
    ceil(sqrt(nodes))) ask the owner; every other node asks one of those relays (picked by a
    hash of node and chunk); a relay that has not got the chunk yet fetches it from the owner
    first (single flight), so the owner uploads RELAYS copies instead of nodes-1;
  - a peer that errors, is dead (noticed after --peer-timeout) or sends bytes whose hash is
    wrong sends the node to the store for that chunk (--fallback store, the rule as written:
    one store fetch per chunk per bad peer per node) or to the next peer in the ranking
    (--fallback next); either way the node rests that peer (never asks it again) and its share
    moves to the next peer in the ranking, for that node only;
  - every node sees a dead peer leave the membership --membership-ttl after it died (the lease
    of its object under peers/); until then only the nodes that tried it know.

THE MODEL, and why: a discrete-event simulation at chunk granularity (one event per chunk
delivered) with a work-conserving calendar per bandwidth resource -- each node's uplink, each
node's downlink, the store's aggregate egress and its GET rate.  A transfer reserves its bytes
on each resource it crosses when it starts, FIFO, and ends when the last of them has carried
it (and no sooner than latency + size / per-connection cap for a store GET).  Why not a
fluid model with max-min sharing: recomputing every flow's rate at every event costs
O(flows) per event, and 1 000 nodes x 100 GB is 11.9 M chunk deliveries; a fixed time step is
as costly and blurs a chunk's 3 ms on a 25 Gbit/s card.  What chunk granularity keeps and a
fluid model of aggregate rates loses: which node owns which chunk (an owner of 7 chunks
when the mean is 1.2), single flight, nodes all asking for the same chunk at once (the
thundering herd on one owner), a peer dying with requests queued on it.

ASSUMPTIONS (printed with the table):
  - sizes in decimal GB; bandwidths in Gbit/s (10^9 bit/s) and MB/s (10^6 B/s);
  - each resource is a FIFO server at its full rate (TCP's fair sharing finishes the same set of
    bytes at the same time; it only interleaves them); a transfer reserves the receiver's
    downlink when it starts even if its sender is busy, so a node's downlink may look busy up
    to GETS chunk-times early (about 20 ms at the defaults);
  - the network core is not a bottleneck: only the NICs and the store are;
  - every node reads every chunk once, GETS at a time (ckptfs's fetch_concurrency), in the
    --order given: `same` (every rank reads the file front to back, as torch.load does),
    `rotated` (each node starts at its own offset), `shuffled`;
  - no cache eviction, no CPU cost, hashing is free; a liar sends wrong bytes for every chunk
    it serves (costing its uplink and the receiver's downlink) and restores honestly itself;
  - a dying node dies after it has read a random 10-90 % of its own chunks; the other nodes
    detect it on the next request or for transfers in flight after --peer-timeout;
  - a slow peer is waited for (no "slower than a store GET" cut-off): the column
    `waits>GET` says how many of a node's chunk reads from peers took longer than one store
    GET would have with nobody else at the store, i.e. how often that cut-off would fire;
  - rendezvous ranking is drawn as a uniformly random permutation per chunk (what a good hash
    gives), not with a real hash;
  - the direct rows are the same simulation with peers off.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys
from dataclasses import dataclass, field, replace

GB = 10**9
MiB = 1 << 20
STORE = -1

# event kinds
_DONE, _FAIL, _GONE = 0, 1, 2
# roles of a fetch: for the node's own restore, asked as a relay, asked as the owner
_SELF, _RELAY, _OWNER = 0, 1, 2


@dataclass(frozen=True)
class Params:
    nodes: int = 100
    size_gb: float = 10.0
    chunk_size: int = 8 * MiB          # ckptfs's default chunk_size (ckptfs/node/config.py)
    down_gbit: float = 25.0
    up_gbit: float = 25.0
    store_gbit: float = 100.0          # the store's aggregate egress
    store_conn_mbs: float = 100.0      # one GET's throughput (S3: ~100 MB/s a connection)
    store_gets: float = 5500.0         # GET/s the store admits (S3: 5 500/s a prefix); 0: no limit
    store_latency: float = 0.030       # a store GET's time to first byte
    peer_latency: float = 0.0005       # a peer request's round trip
    gets: int = 8                      # chunk reads in flight per node (fetch_concurrency)
    peers: bool = True
    hop: bool = False
    relays: int = 0                    # second-hop relays per chunk; 0: ceil(sqrt(nodes))
    dead: float = 0.0                  # fraction of nodes that die mid-restore
    liars: float = 0.0                 # fraction of nodes that serve wrong bytes
    order: str = "same"                # same | rotated | shuffled
    fallback: str = "store"            # store | next
    peer_timeout: float = 2.0          # time to notice a dead peer
    membership_ttl: float = 30.0       # lease_ttl: when every node stops asking a dead peer
    seed: int = 1

    @property
    def chunks(self) -> int:
        return max(1, math.ceil(self.size_gb * GB / self.chunk_size))

    @property
    def size_bytes(self) -> int:
        return self.chunks * self.chunk_size

    @property
    def relay_count(self) -> int:
        return self.relays or math.ceil(math.sqrt(self.nodes))

    def mode(self) -> str:
        if not self.peers:
            return "direct"
        return "peers+hop" if self.hop else "peers"


@dataclass
class Result:
    params: Params
    store_bytes: int = 0
    store_gets: int = 0
    uploads: list[int] = field(default_factory=list)      # bytes each node uploaded
    finished: list[float | None] = field(default_factory=list)   # per node; None: died
    complete: list[bool] = field(default_factory=list)    # has every chunk (survivors)
    dead: list[int] = field(default_factory=list)
    liars: list[int] = field(default_factory=list)
    fault_store_fetches: int = 0       # store GETs caused by dead or lying peers
    cycle_store_fetches: int = 0       # store GETs because views disagreed into a loop
    peer_reads: int = 0                # own chunk reads served through peers
    slow_peer_reads: int = 0           # ... that took longer than one idle store GET
    bad_bytes: int = 0                 # wrong bytes received from liars

    @property
    def survivors(self) -> list[float]:
        return [t for t in self.finished if t is not None]


class _Sim:
    """One restore: the event loop and the state of every node."""

    def __init__(self, p: Params) -> None:
        self.p = p
        n, c = p.nodes, p.chunks
        rng = random.Random(p.seed)
        self.csize = p.chunk_size
        self.C = c
        self.peer_latency = p.peer_latency
        self.up_t = p.chunk_size / (p.up_gbit * GB / 8)
        self.down_t = p.chunk_size / (p.down_gbit * GB / 8)
        self.store_t = p.chunk_size / (p.store_gbit * GB / 8)
        self.conn_t = p.chunk_size / (p.store_conn_mbs * 1e6)
        self.get_gap = 1.0 / p.store_gets if p.store_gets > 0 else 0.0
        self.idle_get = p.store_latency + max(self.conn_t, self.down_t)
        # who dies (and when, in own chunks read) and who lies
        order = list(range(n))
        rng.shuffle(order)
        ndead = round(p.dead * n)
        nliars = round(p.liars * n)
        self.dead_set = set(order[:ndead])
        self.liar = [False] * n
        for i in order[ndead:ndead + nliars]:
            self.liar[i] = True
        self.die_after = [-1] * n
        for i in sorted(self.dead_set):
            self.die_after[i] = max(1, int(c * rng.uniform(0.1, 0.9)))
        # rendezvous ranking: a random permutation prefix per chunk, long enough that every
        # node's view keeps 1 + relays candidates whatever it excluded
        k = p.relay_count if p.hop else 0
        m = min(n, 1 + k + ndead + nliars + 2)
        self.rank = [rng.sample(range(n), m) for _ in range(c)] if p.peers else []
        self.k = k
        # each node's read order
        base = list(range(c))
        self.orders: list[list[int]] = []
        for i in range(n):
            if p.order == "same":
                self.orders.append(base)
            elif p.order == "rotated":
                s = i * c // n
                self.orders.append(base[s:] + base[:s])
            elif p.order == "shuffled":
                o = base[:]
                rng.shuffle(o)
                self.orders.append(o)
            else:
                raise ValueError(f"order must be same, rotated or shuffled, not {p.order!r}")
        # node state
        self.have = [bytearray(c) for _ in range(n)]      # 0 none, 1 fetching, 2 have
        self.want = [bytearray(c) for _ in range(n)]      # the node's own restore waits on it
        # c -> (source, asked it as, own role)
        self.src: list[dict[int, tuple[int, int, int]]] = [{} for _ in range(n)]
        self.waiters: list[dict[int, list[int]]] = [{} for _ in range(n)]   # c -> requesters
        self.outgoing: list[set[tuple[int, int]]] = [set() for _ in range(n)]
        self.issued: list[dict[int, float]] = [{} for _ in range(n)]
        self.rested: list[set[int]] = [set() for _ in range(n)]
        self.died: list[float | None] = [None] * n
        self.gone: set[int] = set()        # dead, and out of every node's membership view
        self.pos = [0] * n
        self.inflight = [0] * n
        self.done = [0] * n
        self.finished: list[float | None] = [None] * n
        self.up_free = [0.0] * n
        self.down_free = [0.0] * n
        self.store_free = 0.0
        self.get_free = 0.0
        self.events: list[tuple[float, int, int, int, int, int]] = []
        self.seq = 0
        self.r = Result(params=p, uploads=[0] * n)

    # -- events -------------------------------------------------------------------------

    def push(self, t: float, kind: int, dst: int, c: int, src: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, dst, c, src))

    def run(self) -> Result:
        for i in range(self.p.nodes):
            self.issue(i, 0.0)
        ev = self.events
        while ev:
            t, _, kind, dst, c, src = heapq.heappop(ev)
            if kind == _DONE:
                self.on_done(t, dst, c, src)
            elif kind == _FAIL:
                self.on_fail(t, dst, c, src)
            else:
                self.gone.add(dst)
        r = self.r
        r.finished = self.finished
        r.dead = sorted(self.dead_set)
        r.liars = [i for i in range(self.p.nodes) if self.liar[i]]
        full = bytes([2]) * self.p.chunks
        r.complete = [self.died[i] is None and self.have[i] == full for i in range(self.p.nodes)]
        stuck = [i for i in range(self.p.nodes) if self.died[i] is None and not r.complete[i]]
        if stuck:
            raise RuntimeError(f"simulation stalled: {len(stuck)} live nodes never finished "
                               f"(first: node {stuck[0]})")
        return r

    # -- a node's own restore -----------------------------------------------------------

    def issue(self, n: int, now: float) -> None:
        order, have, want = self.orders[n], self.have[n], self.want[n]
        chunks, gets = self.C, self.p.gets
        while self.inflight[n] < gets and self.pos[n] < chunks:
            c = order[self.pos[n]]
            self.pos[n] += 1
            if have[c] == 2:
                self.count_done(n, now)
                if self.died[n] is not None:
                    return
                continue
            want[c] = 1
            self.inflight[n] += 1
            self.issued[n][c] = now
            if have[c] == 0:
                self.fetch(n, c, _SELF, now)

    def count_done(self, n: int, now: float) -> None:
        self.done[n] += 1
        if self.done[n] == self.die_after[n]:
            self.die(n, now)
        elif self.done[n] == self.C:
            self.finished[n] = now

    def arrived(self, n: int, c: int, now: float) -> None:
        self.have[n][c] = 2
        del self.src[n][c]
        for w in self.waiters[n].pop(c, ()):
            self.send(n, w, c, now)
        if self.want[n][c]:
            self.want[n][c] = 0
            self.inflight[n] -= 1
            del self.issued[n][c]
            self.count_done(n, now)
            if self.died[n] is None:
                self.issue(n, now)

    # -- routing --------------------------------------------------------------------------

    def route(self, n: int, c: int, role: int, now: float) -> tuple[int, int]:
        """Where node n gets chunk c from, and in which role it asks."""
        if not self.p.peers or role == _OWNER:
            return STORE, _OWNER
        rested, gone = self.rested[n], self.gone
        if rested or gone:
            live = [q for q in self.rank[c] if q not in rested and q not in gone]
        else:
            live = self.rank[c]
        if not live:
            return STORE, _OWNER
        owner = live[0]
        if owner == n:
            return STORE, _OWNER
        if role == _RELAY or not self.k:
            return owner, _OWNER
        relays = live[1:1 + self.k]
        if n in relays:
            return owner, _OWNER
        if not relays:
            return owner, _OWNER
        pick = relays[((n * 0x9E3779B1) ^ (c * 0x85EBCA77)) % 2**32 % len(relays)]
        return pick, _RELAY

    def fetch(self, n: int, c: int, role: int, now: float) -> None:
        """Node n starts getting chunk c (it has none of it)."""
        self.have[n][c] = 1
        src, asked_as = self.route(n, c, role, now)
        self.src[n][c] = (src, asked_as, role)
        if src == STORE:
            self.store_get(n, c, now, role)
        else:
            self.request(src, c, n, asked_as, now)

    def store_get(self, n: int, c: int, now: float, role: int) -> None:
        self.src[n][c] = (STORE, _OWNER, role)
        start = now
        if self.get_gap:
            self.get_free = max(self.get_free, now) + self.get_gap
            start = self.get_free
        t0 = start + self.p.store_latency
        self.store_free = max(self.store_free, t0) + self.store_t
        self.down_free[n] = max(self.down_free[n], t0) + self.down_t
        end = max(t0 + self.conn_t, self.store_free, self.down_free[n])
        self.r.store_bytes += self.csize
        self.r.store_gets += 1
        self.push(end, _DONE, n, c, STORE)

    def request(self, q: int, c: int, n: int, asked_as: int, now: float) -> None:
        """Node n asks peer q for chunk c."""
        if self.died[q] is not None:
            self.push(now + self.p.peer_timeout, _FAIL, n, c, q)
            return
        hq = self.have[q][c]
        if hq == 2:
            self.send(q, n, c, now + self.peer_latency)
            return
        if hq == 1 and self.loops(q, c, n):
            self.r.cycle_store_fetches += 1
            self.store_get(n, c, now, self.src[n][c][2])
            return
        self.waiters[q].setdefault(c, []).append(n)
        if hq == 0:
            self.fetch(q, c, _RELAY if asked_as == _RELAY else _OWNER, now)

    def loops(self, q: int, c: int, n: int) -> bool:
        """Does q's fetch of c wait, through peers, on n?"""
        for _ in range(self.p.nodes):
            if q == n:
                return True
            if self.have[q][c] != 1:
                return False
            q = self.src[q][c][0]
            if q == STORE:
                return False
        return True

    def send(self, q: int, n: int, c: int, now: float) -> None:
        """Peer q sends chunk c to node n."""
        up = self.up_free[q]
        up = (up if up > now else now) + self.up_t
        self.up_free[q] = up
        down = self.down_free[n]
        down = (down if down > now else now) + self.down_t
        self.down_free[n] = down
        self.r.uploads[q] += self.csize
        self.outgoing[q].add((n, c))
        self.seq += 1
        heapq.heappush(self.events, (up if up > down else down, self.seq, _DONE, n, c, q))

    # -- outcomes ---------------------------------------------------------------------------

    def on_done(self, now: float, n: int, c: int, src: int) -> None:
        if src != STORE:
            if (n, c) not in self.outgoing[src]:
                return                      # cancelled: the sender died
            self.outgoing[src].discard((n, c))
        if self.died[n] is not None:
            return
        if src != STORE and self.liar[src]:
            self.r.bad_bytes += self.csize
            self.bad_peer(n, c, src, now)
            return
        if src != STORE and self.want[n][c]:
            self.r.peer_reads += 1
            if now - self.issued[n][c] > self.idle_get:
                self.r.slow_peer_reads += 1
        self.arrived(n, c, now)

    def on_fail(self, now: float, n: int, c: int, src: int) -> None:
        if self.died[n] is not None or self.have[n][c] != 1 or self.src[n][c][0] != src:
            return
        self.bad_peer(n, c, src, now)

    def bad_peer(self, n: int, c: int, q: int, now: float) -> None:
        self.rested[n].add(q)
        role = self.src[n][c][2]
        if self.p.fallback == "next":
            src, asked_as = self.route(n, c, role, now)
            if src != STORE:
                self.src[n][c] = (src, asked_as, role)
                self.request(src, c, n, asked_as, now)
                return
        self.r.fault_store_fetches += 1
        self.store_get(n, c, now, role)

    def die(self, n: int, now: float) -> None:
        self.died[n] = now
        self.finished[n] = None
        self.push(now + self.p.membership_ttl, _GONE, n, 0, 0)
        t = now + self.p.peer_timeout
        for (w, c) in self.outgoing[n]:
            self.push(t, _FAIL, w, c, n)
        self.outgoing[n] = set()
        for c, ws in self.waiters[n].items():
            for w in ws:
                self.push(t, _FAIL, w, c, n)
        self.waiters[n] = {}


def simulate(p: Params) -> Result:
    if p.nodes < 1 or p.gets < 1:
        raise ValueError("nodes and gets must be at least 1")
    return _Sim(p).run()


# -- the table -------------------------------------------------------------------------------

def _gb(b: float) -> str:
    return f"{b / GB:,.1f}"


def row(r: Result) -> list[str]:
    p = r.params
    size = p.size_bytes
    ups = sorted(r.uploads)
    times = sorted(r.survivors)
    slow = f"{100 * r.slow_peer_reads / r.peer_reads:.0f}%" if r.peer_reads else "-"
    return [str(p.nodes), f"{p.size_gb:g}", p.mode(), f"{p.dead:.0%}/{p.liars:.0%}",
            _gb(r.store_bytes), f"{r.store_bytes / size:.2f}x",
            _gb(ups[-1]), _gb(statistics.median(ups)),
            f"{times[-1]:.1f}", f"{statistics.median(times):.1f}",
            slow, str(r.fault_store_fetches + r.cycle_store_fetches)]


HEAD = ["nodes", "GB", "mode", "dead/liars", "store GB", "x size", "up max GB", "up p50 GB",
        "last s", "p50 s", "waits>GET", "fault GETs"]


def table(rows: list[list[str]]) -> str:
    widths = [max(len(x[i]) for x in [HEAD, *rows]) for i in range(len(HEAD))]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(HEAD, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += ["| " + " | ".join(v.rjust(w) for v, w in zip(x, widths)) + " |" for x in rows]
    return "\n".join(out)


def assumptions(p: Params) -> str:
    return (f"chunk {p.chunk_size / MiB:g} MiB; NIC {p.down_gbit:g}/{p.up_gbit:g} Gbit/s down/up; "
            f"store {p.store_gbit:g} Gbit/s aggregate, {p.store_conn_mbs:g} MB/s a GET, "
            f"{p.store_gets:g} GET/s, {p.store_latency * 1e3:g} ms to first byte; "
            f"{p.gets} GETs in flight a node; read order {p.order}; relays "
            f"{'ceil(sqrt(nodes))' if not p.relays else p.relays}; fallback {p.fallback}; "
            f"peer timeout {p.peer_timeout:g} s; membership TTL {p.membership_ttl:g} s; "
            f"seed {p.seed}.  FIFO bandwidth calendars per NIC and for the store; network core "
            f"not a bottleneck; a slow peer is waited for (waits>GET: share of a node's peer "
            f"reads slower than one idle store GET); see the docstring.")


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    d = Params()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="100", help="comma list, e.g. 100,300,1000")
    ap.add_argument("--size-gb", default="10", help="checkpoint size, GB; comma list")
    ap.add_argument("--chunk-mib", type=float, default=d.chunk_size / MiB)
    ap.add_argument("--down-gbit", type=float, default=d.down_gbit)
    ap.add_argument("--up-gbit", type=float, default=d.up_gbit)
    ap.add_argument("--store-gbit", type=float, default=d.store_gbit)
    ap.add_argument("--store-conn-mbs", type=float, default=d.store_conn_mbs)
    ap.add_argument("--store-gets", type=float, default=d.store_gets, help="GET/s; 0: no limit")
    ap.add_argument("--store-latency", type=float, default=d.store_latency)
    ap.add_argument("--peer-latency", type=float, default=d.peer_latency)
    ap.add_argument("--gets", type=int, default=d.gets, help="chunk reads in flight a node")
    ap.add_argument("--modes", default="direct,peers,peers+hop")
    ap.add_argument("--relays", type=int, default=0, help="second-hop relays a chunk; 0: sqrt")
    ap.add_argument("--dead", default="0", help="fractions of nodes dying; comma list")
    ap.add_argument("--liars", type=float, default=None,
                    help="fraction of lying nodes (default: the same as each --dead)")
    ap.add_argument("--order", choices=("same", "rotated", "shuffled"), default=d.order)
    ap.add_argument("--fallback", choices=("store", "next"), default=d.fallback)
    ap.add_argument("--peer-timeout", type=float, default=d.peer_timeout)
    ap.add_argument("--membership-ttl", type=float, default=d.membership_ttl)
    ap.add_argument("--seed", type=int, default=d.seed)
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    for m in modes:
        if m not in ("direct", "peers", "peers+hop"):
            ap.error(f"unknown mode {m!r}")
    base = replace(d, chunk_size=int(a.chunk_mib * MiB), down_gbit=a.down_gbit,
                   up_gbit=a.up_gbit, store_gbit=a.store_gbit, store_conn_mbs=a.store_conn_mbs,
                   store_gets=a.store_gets, store_latency=a.store_latency,
                   peer_latency=a.peer_latency, gets=a.gets, relays=a.relays, order=a.order,
                   fallback=a.fallback, peer_timeout=a.peer_timeout,
                   membership_ttl=a.membership_ttl, seed=a.seed)
    rows = []
    for nodes in (int(x) for x in _floats(a.nodes)):
        for size in _floats(a.size_gb):
            for dead in _floats(a.dead):
                liars = dead if a.liars is None else a.liars
                for m in modes:
                    p = replace(base, nodes=nodes, size_gb=size, dead=dead, liars=liars,
                                peers=m != "direct", hop=m == "peers+hop")
                    rows.append(row(simulate(p)))
                    print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(table(rows))
    print()
    print("Assumptions: " + assumptions(base))


if __name__ == "__main__":
    main()
