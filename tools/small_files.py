"""The small-file table of issue 25 item 4: everyday tools on a tree of small files, on
local disk, through a bare pyfuse3 passthrough, and into ckptfs in async and sync mode.

    PYTHONPATH=$PWD python tools/small_files.py [--rounds 3] [--files 1000] [--size 4]
        [--tools cp_a tar_x rsync_a git_add sqlite_delete]
        [--systems local passthrough ckptfs-async ckptfs-sync] [--work-dir DIR]

Starts a private SeaweedFS (as ``ckptfs bench`` does), builds the tree once on local disk,
and per round runs every tool into a fresh directory of every system (a fresh mount and
state dir per system and round); systems alternate order between rounds.  Prints the
median seconds per tool and system, and each system's ratio to local disk and to the
passthrough, from the same run.  Tools not installed are left out (said once).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from ckptfs.bench.runner import ckptfs_cli, wait_mounted
from ckptfs.bench.seaweed import SeaweedServer
from ckptfs.bench.smallfiles import TOOLS, ToolFailed, available, make_tar, make_tree


class Systems:
    def __init__(self, work: Path, env: dict, store_url: str, endpoint: str,
                 mount_args: list[str]) -> None:
        self.work, self.env, self.store_url, self.endpoint = work, env, store_url, endpoint
        self.mount_args = mount_args

    def enter(self, system: str, name: str) -> tuple[Path, object]:
        """A fresh empty directory of ``system``, and what ``leave`` needs to undo it."""
        if system == "local":
            d = self.work / f"local-{name}"
            d.mkdir()
            return d, None
        if system == "passthrough":
            src = self.work / f"pt-src-{name}"
            src.mkdir()
            mnt = self.work / f"mnt-pt-{name}"
            mnt.mkdir()
            proc = subprocess.Popen([sys.executable, "-m", "ckptfs.bench.passthrough",
                                     str(src), str(mnt)], env=self.env)
            wait_mounted(mnt, proc)
            return mnt, (proc, src)
        durability = system.removeprefix("ckptfs-")
        mnt = self.work / f"mnt-{name}"
        mnt.mkdir()
        state = self.work / f"state-{name}"
        ckptfs_cli("mount", str(mnt), "--store", self.store_url, "--endpoint-url",
                   self.endpoint, "--state-dir", str(state), "--durability", durability,
                   *self.mount_args, env=self.env)
        return mnt, state

    def leave(self, system: str, d: Path, undo: object) -> None:
        if system == "local":
            shutil.rmtree(d)
        elif system == "passthrough":
            assert isinstance(undo, tuple)
            proc, src = undo
            proc.terminate()
            proc.wait(timeout=30)
            if os.path.ismount(d):
                subprocess.run(["fusermount3", "-u", "-z", str(d)], check=False)
            shutil.rmtree(src)
        else:
            ckptfs_cli("wait", str(d), env=self.env)
            ckptfs_cli("umount", str(d), env=self.env)
            shutil.rmtree(str(undo), ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--files", type=int, default=1000)
    p.add_argument("--size", type=int, default=4, help="KiB per file")
    p.add_argument("--tools", nargs="+", default=list(TOOLS), choices=list(TOOLS))
    p.add_argument("--systems", nargs="+",
                   default=["local", "passthrough", "ckptfs-async", "ckptfs-sync"])
    p.add_argument("--work-dir")
    p.add_argument("--mount-arg", action="append", default=[], metavar="ARG")
    args = p.parse_args()
    tools = [t for t in args.tools if available(t)]
    for t in set(args.tools) - set(tools):
        print(f"small_files: {t} left out: its program is not installed", file=sys.stderr)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="ckptfs-small-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, list[float]]] = {}
    env = dict(os.environ)
    with SeaweedServer(work / "seaweed") as server:
        server.create_bucket("small")
        env.update(server.env())
        systems = Systems(work, env, "s3://small/", server.endpoint_url, args.mount_arg)
        src = work / "src"
        src.mkdir()
        tree = make_tree(src, args.files, args.size * 1024)
        archive = make_tar(tree, work / "tree.tar")
        for rnd in range(args.rounds):
            order = args.systems if rnd % 2 == 0 else args.systems[::-1]
            for system in order:
                name = f"{system}-{rnd}-{uuid.uuid4().hex[:6]}"
                d, undo = systems.enter(system, name)
                try:
                    for tool in tools:
                        # Named for the system and round: ckptfs mounts of one run share
                        # the store, and each sees what the others wrote there.
                        target = d / f"{tool}-{name}"
                        target.mkdir()
                        try:
                            seconds = TOOLS[tool](tree, archive, target)
                        except ToolFailed as exc:
                            print(f"round {rnd + 1} {system:<14} {tool:<14} FAILED: {exc}",
                                  file=sys.stderr, flush=True)
                            continue
                        results.setdefault(tool, {}).setdefault(system, []).append(seconds)
                        print(f"round {rnd + 1} {system:<14} {tool:<14} {seconds:8.3f} s",
                              file=sys.stderr, flush=True)
                finally:
                    systems.leave(system, d, undo)
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.files} files x {args.size} KiB; medians of {args.rounds} round(s), seconds")
    bases = [b for b in ("passthrough", "local") if b in args.systems]
    ours = [s for s in args.systems if s.startswith("ckptfs")]
    print(f"{'tool':<14}" + "".join(f"{s:>14}" for s in args.systems)
          + "".join(f"{s + '/' + b.replace('passthrough', 'pt'):>20}" for b in bases
                    for s in ours))
    for tool in tools:
        med = {s: statistics.median(v) for s, v in results.get(tool, {}).items()}
        row = f"{tool:<14}" + "".join(f"{med.get(s, float('nan')):>14.3f}" for s in args.systems)
        for base in bases:
            for s in ours:
                ratio = med[s] / med[base] if med.get(base) and s in med else float("nan")
                row += f"{ratio:>19.2f}x"
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
