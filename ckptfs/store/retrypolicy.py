"""One retry policy for every retry loop: how many tries (``attempts``), how long to
wait between them (exponential ``backoff`` from ``base_delay`` by ``factor`` up to
``max_delay``, optionally with full jitter), and the overall ``deadline`` of one call.

The store's retries (``store.retry``), the background publish queue (``publish_queue``),
lease renewals and pending-seal polls (``leases``), the metadata log (``oplog``) and the
cache's refetch of a corrupt chunk (``cache``) each hold one of these instead of their
own numbers.  A leaf module:
it imports nothing of ckptfs and knows nothing of what is retried.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int | None = 6          # tries in all, the first included; None: no limit
    base_delay: float = 0.1           # wait after the first failure
    max_delay: float = 5.0            # cap of one wait
    factor: float = 2.0               # each further failure multiplies the wait by this
    jitter: bool = False              # full jitter: a uniform wait in [0, backoff]
    deadline: float | None = None     # seconds for one call, every try and wait included

    def delay(self, failures: int, rand: Callable[[], float] = random.random) -> float:
        """The wait after the ``failures``-th failure in a row (1: the first)."""
        backoff = min(self.max_delay, self.base_delay * self.factor ** max(0, failures - 1))
        return backoff * rand() if self.jitter else backoff

    def gives_up(self, failures: int) -> bool:
        """True once ``failures`` tries have failed and no more are allowed."""
        return self.attempts is not None and failures >= self.attempts
