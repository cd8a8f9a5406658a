"""What the ``ckptfs`` command shows people: the short status summary, and progress of
long work (``prefetch``, ``wait``, ``umount``, ``gc``) drawn by ``rich`` on a terminal
and nothing at all when stderr is not one (logs, pipes, systemd).

Knows the JSON the daemon answers with; nothing of how it is obtained.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TaskID,
                           SpinnerColumn, TextColumn, TimeElapsedColumn)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def pending_text(doc: dict, fs: dict) -> str:
    pending = fs.get("pending_uploads", 0)
    text = f"{pending} upload(s), {human_bytes(doc.get('pending_bytes', 0))}"
    if pending and doc.get("oldest_pending_s") is not None:
        text += f", oldest {human_age(doc['oldest_pending_s'])}"
    if pending and fs.get("uploads_held_for_writer_s"):
        text += (f"; giving way to a writer for {human_age(fs['uploads_held_for_writer_s'])}"
                 " (async mode)")
    return text


def peers_text(peers: dict) -> str:
    """The status row of a node serving peers (cluster/peers.py ``report``)."""
    fetch, serve = peers.get("fetch", {}), peers.get("serve", {})
    return (f"{peers.get('alive', 0)} alive (serving on {peers.get('listen')}); "
            f"chunks from peers {human_bytes(peers.get('bytes_from_peers', 0))}, "
            f"from the store {human_bytes(peers.get('bytes_from_store', 0))}; "
            f"{fetch.get('errors', 0)} peer error(s), {fetch.get('wrong', 0)} wrong "
            f"chunk(s); served {human_bytes(serve.get('bytes', 0))}"
            + (f" (relayed {human_bytes(serve['relayed_bytes'])})"
               if serve.get("relayed_bytes") else "")
            + f", refused {serve.get('refused', 0)}"
            + (f"; membership failing: {peers['last_error']}"
               if peers.get("last_error") else ""))


def cache_text(doc: dict, fs: dict) -> str:
    """The cache row: its size, its limit, chunks it refetched."""
    limit = doc.get("cache_limit")
    return (f"{human_bytes(fs.get('cache_bytes', 0))}"
            + (f" of {human_bytes(limit)}" if limit else "")
            + (f", {fs['corrupt_chunks']} corrupt chunk(s) refetched"
               if fs.get("corrupt_chunks") else "")
            + (f", {fs['rotten_cache_chunks']} rotten cache file(s) refetched"
               if fs.get("rotten_cache_chunks") else ""))


def status_text(doc: dict) -> str:
    """A short summary of a ``status`` reply: what an operator looks at first."""
    fs, store = doc.get("fs", {}), doc.get("store_stats", {})
    lines = [f"ckptfs on {doc.get('mountpoint')} (pid {doc.get('pid')}, "
             f"node {doc.get('node_id', '?')})"]

    def row(label: str, value: str) -> None:
        lines.append(f"  {label:<11} {value}")

    row("store", str(doc.get("store")))
    row("durability", str(doc.get("durability")))
    data_path = doc.get("data_path") or {}
    if data_path:
        row("data path", str(data_path.get("path"))
            + (f" ({data_path['reason']})" if data_path.get("reason") else ""))
    row("pending", pending_text(doc, fs))
    if fs.get("pending_metadata"):
        row("metadata", f"{fs['pending_metadata']} change(s) journaled, on their way to "
                        "the store in order (async mode)"
            + (f"; waiting: {next(iter(fs['failing_metadata'].values()))}"
               if fs.get("failing_metadata") else ""))
    if doc.get("durability") == "async" and fs.get("max_staged"):
        row("staged", f"{human_bytes(fs.get('staged_bytes', 0))} closed, not uploaded "
                      f"(max {human_bytes(fs['max_staged'])})"
            + (f"; {fs['writers_waiting_for_uploads']} writer(s) waiting for uploads"
               if fs.get("writers_waiting_for_uploads") else ""))
    failing = fs.get("failing_uploads") or {}
    if failing:
        first = next(iter(failing.values()))
        row("failing", f"{len(failing)} upload(s): {first}")
    row("uploaded", f"{human_bytes(fs.get('bytes_uploaded', 0))} "
                    f"(+{human_bytes(fs.get('bytes_deduplicated', 0))} deduplicated), "
                    f"{fs.get('publishes', 0)} file(s) published")
    row("cache", cache_text(doc, fs))
    if doc.get("peers"):
        row("peers", peers_text(doc["peers"]))
    kinds = store.get("error_kinds") or {}
    errors = store.get("errors", 0)
    detail = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()) if n)
    row("errors", f"{errors} store error(s)" + (f" ({detail})" if detail else "")
        + f", {store.get('retries', 0)} retried, {fs.get('publish_failures', 0)} "
        "failed publish(es)")
    seals = doc.get("pending_seals") or []
    if seals:
        row("seals", f"{len(seals)} pending: " + "; ".join(
            f"{s.get('path')} waits for {', '.join(s.get('waiting_for', []))}"
            for s in seals[:3]))
    stale = doc.get("stale_staged") or []
    if stale:
        row("stale", f"{len(stale)} staged checkpoint dir(s) nobody seals: "
                     + ", ".join(s["path"] for s in stale[:3])
                     + " (`ckptfs commit PATH`)")
    removed = doc.get("retention_removed") or []
    if removed:
        row("retention", f"removed {len(removed)}: " + ", ".join(removed[-5:]))
    return "\n".join(lines)


class Bar:
    """A progress display on stderr when it is a terminal; otherwise does nothing.
    ``kind``: "bytes" (a byte count), "count" (things done of a total), "spin"."""

    def __init__(self, description: str, kind: str = "count",
                 stream: TextIO | None = None) -> None:
        stream = stream or sys.stderr
        self.active = stream.isatty()
        self.kind = kind
        self._task: TaskID | None = None
        self._progress: Progress | None = None
        if not self.active:
            return
        columns = [SpinnerColumn(), TextColumn("{task.description}")]
        if kind == "bytes":
            columns += [BarColumn(), DownloadColumn()]
        elif kind == "count":
            columns += [BarColumn(), MofNCompleteColumn()]
        columns.append(TimeElapsedColumn())
        self._progress = Progress(*columns, console=Console(file=stream), transient=True)
        self._task = self._progress.add_task(description, total=None)

    def __enter__(self) -> "Bar":
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, completed: float | None = None, total: float | None = None,
               description: str | None = None) -> None:
        if self._progress is None or self._task is None:
            return
        fields: dict = {}
        if completed is not None:
            fields["completed"] = completed
        if total is not None:
            fields["total"] = total
        if description is not None:
            fields["description"] = description
        self._progress.update(self._task, **fields)


def watch(fetch, interval: float, stream: TextIO | None = None,
          count: int | None = None) -> None:
    """Print ``fetch()`` every ``interval`` seconds: redrawn in place on a terminal,
    one block after another otherwise.  Stops after ``count`` refreshes (None: never)."""
    stream = stream or sys.stdout
    console = Console(file=stream)
    if stream.isatty():
        from rich.live import Live
        with Live(fetch(), console=console, auto_refresh=False) as live:
            shown = 1
            while count is None or shown < count:
                time.sleep(interval)
                live.update(fetch(), refresh=True)
                shown += 1
        return
    shown = 0
    while count is None or shown < count:
        if shown:
            time.sleep(interval)
            print(file=stream)
        print(fetch(), file=stream, flush=True)
        shown += 1
