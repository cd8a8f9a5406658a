"""Evidence for a slow step of a model test: which step, how long, and where every trio
task of the run was waiting.  A step past ``after`` seconds prints that once to stdout
(pytest shows it with the failure: a run cut short by pytest-timeout or ``fail_after``
then says what it waited on, instead of only where the main thread happened to be)."""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import trio
import trio.lowlevel


def task_stacks() -> str:
    """Every task under the run's root: its name and its await chain, innermost last."""
    lines: list[str] = []

    def walk(task: trio.lowlevel.Task, depth: int) -> None:
        lines.append("  " * depth + f"task {task.name}")
        for frame in _frames(task.coro):
            code = frame.f_code
            if "/trio/_core/" in code.co_filename:
                continue        # the scheduler's own frames: the same in every task
            lines.append("  " * depth + f"  {code.co_filename}:{frame.f_lineno} "
                         f"{code.co_name}")
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child, depth + 1)

    root = trio.lowlevel.current_root_task()
    if root is not None:
        walk(root, 0)
    return "\n".join(lines)


def _frames(coro: object) -> Iterator[types.FrameType]:
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or \
            getattr(coro, "gi_frame", None)
        if frame is None:
            return
        yield frame
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or \
            getattr(coro, "gi_yieldfrom", None)


@dataclass
class Watchdog:
    """``async with trio.open_nursery() as n: n.start_soon(dog.run)``, then each step
    under ``with dog.step(op)``."""

    after: float = 20.0
    _what: object = None
    _since: float = 0.0
    _told: bool = False

    @contextmanager
    def step(self, what: object) -> Iterator[None]:
        self._what, self._since, self._told = what, trio.current_time(), False
        try:
            yield
        finally:
            took = trio.current_time() - self._since
            if self._told:
                print(f"watchdog: step {self._what!r} ended after {took:.1f} s", flush=True)
            self._what = None

    async def run(self) -> None:
        while True:
            await trio.sleep(1.0)
            if self._what is None or self._told:
                continue
            took = trio.current_time() - self._since
            if took >= self.after:
                self._told = True
                print(f"watchdog: step {self._what!r} still running after {took:.1f} s; "
                      f"tasks:\n{task_stacks()}", flush=True)
