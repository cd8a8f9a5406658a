"""Seal-lease requests per node for one HF-style checkpoint written by two nodes (issue
15, docs/decisions/0004): three mounts of one LocalStore; node B writes four rank files,
the last one still open when node A closes its mark; prints each node's lease requests
and when node C lists the checkpoint.

    PYTHONPATH=$PWD .venv/bin/python tools/lease_requests.py
"""
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "tests"))
sys.path.insert(0, str(HERE / "tests" / "integration"))
from support.mounts import Mount, StoreSpec, eventually
from test_leases import Writer, hf_rank0, listing
base = Path(tempfile.mkdtemp(prefix="ckptfs-leases-"))
(base/"store").mkdir()
spec = StoreSpec("local", f"file://{base}/store", root=base/"store")
nodes = {n: Mount(base, spec, n) for n in "abc"}
for m in nodes.values(): m.start()
a, b, c = nodes["a"], nodes["b"], nodes["c"]
try:
    for hold in (0.0, 5.0):
        before = {n: dict(m.status()["lease_requests"]) for n, m in nodes.items()}
        name = f"checkpoint-{int(hold)+1}"
        (a.path / "out" / name).mkdir(parents=True)
        ck = b.path / "out" / name
        assert eventually(ck.is_dir)
        w = Writer()
        f = ck / "rng_state_1.pth"
        # B writes 4 files (ranks 1..4 on node B), the last one stays open for `hold` s.
        for r in range(2, 5):
            p = ck / f"rng_state_{r}.pth"; w.open(p); w.write(p, os.urandom(4096)); w.close(p)
        w.open(f); w.write(f, os.urandom(4096))
        t0 = time.monotonic()
        hf_rank0(a.path / "out" / name)
        time.sleep(hold)
        w.close(f); w.stop()
        assert eventually(lambda: name in (listing(c.path / "out") or []), timeout=60)
        seen = time.monotonic() - t0
        for m in nodes.values():
            eventually(lambda: m.status()["held_leases"] == [])
        after = {n: m.status()["lease_requests"] for n, m in nodes.items()}
        print(f"B holds {hold:.0f} s after A's mark: visible on C after {seen:.1f} s;",
              {n: {k: after[n][k] - before[n][k] for k in after[n]} for n in nodes})
finally:
    for m in nodes.values(): m.stop()
