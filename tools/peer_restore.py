"""Store bytes and time for N fresh nodes restoring one checkpoint at once, with and
without peers (issue 24, cluster/peers.py).

Starts a private SeaweedFS, writes one checkpoint file through a mount beside the
counting proxy, then for each node count and each mode starts N fresh mounts (own state
dirs) whose store traffic goes through a byte-counting TCP proxy, reads the file on all
of them at once, checks every node's bytes, and prints one row: nodes, peers on/off,
bytes the store served / checkpoint size, wall seconds until the last node finished,
bytes served by relays (the second hop) / checkpoint size.
With ``--kill`` one extra peer node is SIGKILLed as soon as the others start reading;
``--fanout K`` sets the peers' ``--peer-fanout`` (K < N − 1 makes relays serve: the second hop).

    PYTHONPATH=. .venv/bin/python tools/peer_restore.py [--size-mib 64] [--chunk 1M]
        [--nodes 1,2,4] [--kill] [--fanout K]

Root is needed (FUSE mounts).  Numbers on a shared machine are noisy: compare the
rows of one run.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from ckptfs.bench.seaweed import SeaweedServer  # noqa: E402
from support.mounts import BUCKET, Mount, StoreSpec, eventually  # noqa: E402
from support.proxy import FaultProxy  # noqa: E402

MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_all(mounts: list[Mount], extra: list[list[str]]) -> None:
    threads = [threading.Thread(target=m.start, args=tuple(x)) for m, x in zip(mounts, extra)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def read_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(4 * MiB):
            h.update(piece)
    return h.hexdigest()


def run(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="peer-restore-"))
    server = SeaweedServer(work / "seaweed")
    server.start()
    server.create_bucket(BUCKET)
    proxy = FaultProxy(server.s3_port)
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    direct = StoreSpec("s3", url, env=server.env(), seaweed=server)
    env = dict(server.env())
    env["AWS_ENDPOINT_URL"] = proxy.endpoint_url
    counted = StoreSpec("s3", url, env=env, seaweed=server, proxy=proxy)
    common = ["--chunk-size", args.chunk, "--lease-ttl", "3"]
    fanout = ["--peer-fanout", str(args.fanout)] if args.fanout else []
    mounts: list[Mount] = []
    try:
        writer = Mount(work, direct, "writer")
        mounts.append(writer)
        writer.start(*common)
        data = os.urandom(args.size_mib * MiB)
        want = hashlib.sha256(data).hexdigest()
        (writer.path / "model.bin").write_bytes(data)
        del data
        writer.stop()
        print(f"{'nodes':>5} {'peers':>5} {'store/size':>10} {'seconds':>8} "
              f"{'relayed/size':>12}", flush=True)
        for n in args.nodes:
            for peers in (False, True):
                tag = f"n{n}{'p' if peers else 's'}"
                extra_nodes = 1 if (peers and args.kill) else 0
                group = [Mount(work, counted, f"{tag}-{i}") for i in range(n + extra_nodes)]
                mounts.extend(group)
                start_all(group, [common + (["--peer-listen", f"127.0.0.1:{free_port()}",
                                             *fanout] if peers else []) for _ in group])
                if peers:
                    for m in group:
                        eventually(lambda m=m: m.status()["peers"]["alive"] >= len(group) - 1,
                                   timeout=30)
                readers = group[:n]
                results: dict = {}
                started = threading.Event()

                def one(m: Mount) -> None:
                    started.set()
                    results[m.path] = read_sha(m.path / "model.bin")
                proxy.count_reset()
                t0 = time.monotonic()
                threads = [threading.Thread(target=one, args=(m,)) for m in readers]
                for t in threads:
                    t.start()
                if extra_nodes:
                    started.wait()
                    group[-1].kill()
                for t in threads:
                    t.join()
                wall = time.monotonic() - t0
                ok = all(results.get(m.path) == want for m in readers)
                relayed = sum(m.status()["peers"]["serve"].get("relayed_bytes", 0)
                              for m in readers) if peers else 0
                print(f"{n:>5} {'on' if peers else 'off':>5} "
                      f"{proxy.bytes_down / (args.size_mib * MiB):>10.3f} {wall:>8.2f} "
                      f"{relayed / (args.size_mib * MiB):>12.3f}"
                      f"{'' if ok else '  WRONG BYTES'}", flush=True)
                for m in readers:
                    m.stop()
    finally:
        for m in mounts:
            m.cleanup()
        proxy.close()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=64)
    p.add_argument("--chunk", default="1M")
    p.add_argument("--nodes", default="1,2,4",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--fanout", type=int, default=0,
                   help="--peer-fanout of the peer nodes (default: the setting's default)")
    p.add_argument("--kill", action="store_true",
                   help="SIGKILL one extra peer node as the others start reading")
    run(p.parse_args())


if __name__ == "__main__":
    main()
