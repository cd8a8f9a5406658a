"""Invariants of tools/peer_sim.py, the simulated peer restore (issue 24): every live node gets
every chunk, the store serves at least one checkpoint, without peers exactly one per node,
and a dead owner's or a liar's chunks still reach everyone.  Small clusters only (< 5 s)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "peer_sim.py"


@pytest.fixture(scope="module")
def sim() -> ModuleType:
    spec = importlib.util.spec_from_file_location("peer_sim", TOOL)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["peer_sim"] = mod          # dataclasses look their module up by name
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules["peer_sim"]
    return mod


def small(sim: ModuleType, **kw: object) -> object:
    # 24 nodes, 0.4 GB in 8 MiB chunks (48 chunks): a few thousand deliveries
    return sim.Params(**{"nodes": 24, "size_gb": 0.4, **kw})


def everyone_has_everything(r: object) -> None:
    live = [i for i, t in enumerate(r.finished) if t is not None]
    assert live == [i for i in range(r.params.nodes) if i not in r.dead]
    assert all(r.complete[i] for i in live)


@pytest.mark.parametrize("order", ["same", "rotated", "shuffled"])
@pytest.mark.parametrize("hop", [False, True])
def test_every_node_gets_every_chunk_and_the_store_serves_one_checkpoint(sim, order, hop):
    p = small(sim, hop=hop, order=order)
    r = sim.simulate(p)
    everyone_has_everything(r)
    assert r.store_bytes == p.size_bytes              # single flight: each chunk once
    assert sum(r.uploads) == (p.nodes - 1) * p.size_bytes


def test_without_peers_every_node_reads_the_whole_checkpoint_from_the_store(sim):
    p = small(sim, peers=False, dead=0.1)
    r = sim.simulate(p)
    everyone_has_everything(r)
    survivors = p.nodes - len(r.dead)
    assert r.store_bytes >= survivors * p.size_bytes
    q = small(sim, peers=False)
    rq = sim.simulate(q)
    assert rq.store_bytes == q.nodes * q.size_bytes
    assert sum(rq.uploads) == 0


@pytest.mark.parametrize("fallback", ["store", "next"])
@pytest.mark.parametrize("hop", [False, True])
def test_dead_owners_and_liars_chunks_still_reach_every_live_node(sim, hop, fallback):
    p = small(sim, hop=hop, dead=0.125, liars=0.125, fallback=fallback, peer_timeout=0.5,
              membership_ttl=3.0)
    r = sim.simulate(p)
    assert len(r.dead) == 3 and len(r.liars) == 3
    everyone_has_everything(r)
    # the dead did own chunks, and the liars' wrong bytes were seen and cost store fetches
    assert r.bad_bytes > 0 and r.fault_store_fetches > 0
    assert r.store_bytes >= p.size_bytes


def test_same_seed_same_numbers_other_seed_other_placement(sim):
    p = small(sim, hop=True, dead=0.1, liars=0.1)
    a, b = sim.simulate(p), sim.simulate(p)
    assert (a.store_bytes, a.uploads, a.finished) == (b.store_bytes, b.uploads, b.finished)
    c = sim.simulate(sim.Params(**{**p.__dict__, "seed": 2}))
    assert c.uploads != a.uploads


def test_the_second_hop_spreads_the_owners_upload(sim):
    # 64 nodes, 2 chunks: without the hop an owner uploads 63 copies of its chunk
    p = sim.Params(nodes=64, size_gb=0.016, chunk_size=8 << 20)
    flat, hop = sim.simulate(p), sim.simulate(sim.Params(**{**p.__dict__, "hop": True}))
    assert max(flat.uploads) >= 63 * p.chunk_size
    assert max(hop.uploads) <= 2 * (p.relay_count + 1) * p.chunk_size


def test_the_table_prints_a_row_per_mode(sim, capsys):
    sim.main(["--nodes", "12", "--size-gb", "0.1", "--dead", "0,0.1"])
    out = capsys.readouterr().out
    rows = [x for x in out.splitlines() if x.startswith("|") and "nodes" not in x and "--" not in x]
    assert len(rows) == 6
    assert "Assumptions:" in out
