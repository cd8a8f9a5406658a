"""The marker of the core's critical sections.

In trio a critical section is code with no ``await``: nothing else runs on the event
loop until it returns.  The core keeps its invariants in such sections (the apply phase
of a refresh, a publish landing after its entry PUT, the namespace move after a
rename's store steps, an unlink after its store step, a close's commit).  Each is a
plain ``def`` marked ``@no_await``; ``tests/unit/test_no_await.py`` reads the core with
``ast`` and fails when a marked function is ``async def`` or contains an ``await``.
Must not know anything of the core itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., object])


def no_await(fn: F) -> F:
    """Mark ``fn`` as a critical section (checked by a test, no cost at run time)."""
    return fn
