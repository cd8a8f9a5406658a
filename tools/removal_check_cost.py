"""What decision 0028's check costs: store calls per file when 1 000 files of 4 KiB are
saved one after another into 10 subdirectories, at core level over an in-memory store
with 1 ms per store call, by operation and key prefix, sync and async.

    PYTHONPATH=$PWD python tools/removal_check_cost.py $PWD

Run it on two checkouts (before and after a change) to compare."""
import collections, sys, time
from pathlib import Path
import tempfile
import trio
sys.path.insert(0, sys.argv[1] + "/tests")
from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import Core, open_core

async def main(durability):
    store = MemoryStore()
    counts = collections.Counter()
    def count(call):
        counts[(call.op, call.key.split("/", 1)[0])] += 1
        time.sleep(0.001)
    with tempfile.TemporaryDirectory() as base:
        async with open_core(Path(base), store, Config(durability=durability)) as fs:
            core = Core(fs, store)
            dirs = [(await fs.mkdir(ROOT_INO, f"d{i}".encode(), 0o755, 0, 0)).ino for i in range(10)]
            await fs.wait_idle()
            hook = store.before(count)
            t = time.monotonic()
            for n in range(1000):
                await core.save(dirs[n % 10], f"f{n}".encode(), b"x" * 4096)
            await fs.wait_idle()
            took = time.monotonic() - t
            hook.remove()
    total = sum(counts.values())
    print(durability, f"{total/1000:.2f} calls/file, {took:.1f} s;",
          ", ".join(f"{op} {p}: {c/1000:.2f}" for (op, p), c in sorted(counts.items())))

for d in ("sync", "async"):
    trio.run(main, d)
