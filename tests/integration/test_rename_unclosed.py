"""Issue item 5: a new file renamed over a published one while its writer still holds it
open, then the writer is SIGKILLed.  A name changes only when a closed version lands
(DESIGN.md promise 2), so the target keeps its previous content on every node, after a
remount too, in both durability modes.  On the writing node the name shows the new
file while its writer holds it; once the writer is killed that name goes, and the next
listing of the store brings the previous version back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from support.mounts import eventually, run_ckptfs

# Opens a new file, writes, renames it over ``t`` with the descriptor still open, then
# waits to be killed.
RENAMER = r"""
import os, sys
d = sys.argv[1]
fd = os.open(os.path.join(d, "n"), os.O_CREAT | os.O_WRONLY, 0o644)
os.write(fd, b"B" * 300000)
os.rename(os.path.join(d, "n"), os.path.join(d, "t"))
print("renamed", flush=True)
sys.stdin.readline()
"""


def content(path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_killed_writer_renaming_its_new_file_over_a_published_one_changes_nothing(
        store, make_mount, durability):
    old = b"A" * 200000
    mnt = make_mount(store, durability=durability)
    other = make_mount(store, name="other", durability=durability)
    (mnt.path / "t").write_bytes(old)
    run_ckptfs("wait", str(mnt.path), check=True, timeout=120)
    assert eventually(lambda: content(other.path / "t") == old)
    proc = subprocess.Popen([sys.executable, "-c", RENAMER, str(mnt.path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "renamed"
    # While the writer holds it: this node shows the new file under the name...
    assert os.listdir(mnt.path) == ["t"]
    # ... other nodes and a fresh mount still the previous version.
    fresh = make_mount(store, name="fresh", durability=durability)
    assert content(fresh.path / "t") == old
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_ckptfs("wait", str(mnt.path), check=True, timeout=120)
    assert content(make_mount(store, name="fresh2").path / "t") == old
    assert eventually(lambda: content(other.path / "t") == old)
    assert eventually(lambda: content(mnt.path / "t") == old)
    assert sorted(os.listdir(mnt.path)) == ["t"]
    mnt.stop()
    mnt.start(durability=durability)
    assert content(mnt.path / "t") == old and sorted(os.listdir(mnt.path)) == ["t"]
