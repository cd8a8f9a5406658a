"""Who may ask this node for a chunk: the cluster's shared secret and request signatures.

The secret is one object in the store (``peers/.secret``, 32 random bytes in hex), made by
the first node that needs it (``put_if_absent``: every node ends up with the same one) and
read with the store's own credentials: whoever can read the store may read its chunks
anyway, and nobody else can sign.  A request carries the asking node's id, the time it was
signed and an HMAC-SHA256 over method, chunk id, length, that time and that id; the server
accepts it within ``WINDOW`` seconds of its own clock (as S3 does with its signatures).

Knows the store (for the secret) and nothing of sockets, the cache or membership.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from ..store import ObjectStore

SECRET_KEY = "peers/.secret"
WINDOW = 300.0          # seconds a signature is good for, either side of the server's clock


def load_secret(store: ObjectStore) -> bytes:
    """The cluster's peer secret, created in the store if there is none yet (blocking:
    run it in a worker thread)."""
    store.put_if_absent(SECRET_KEY, secrets.token_hex(32).encode())
    body, _ = store.get(SECRET_KEY)
    text = body.strip()
    if len(text) < 32:
        raise ValueError(f"{SECRET_KEY} in the store is too short to be a secret")
    return text


def _message(method: str, chunk: str, length: int, when: str, node: str) -> bytes:
    return "\n".join((method, chunk, str(length), when, node)).encode()


def sign(secret: bytes, method: str, chunk: str, length: int, when: str, node: str) -> str:
    return hmac.new(secret, _message(method, chunk, length, when, node),
                    hashlib.sha256).hexdigest()


def check(secret: bytes, method: str, chunk: str, length: int, when: str, node: str,
          signature: str, now: float) -> str | None:
    """None if the request is signed with the secret within the window, else why not
    (for the log; the asker is told nothing)."""
    try:
        at = float(when)
    except ValueError:
        return "bad time"
    if not abs(now - at) <= WINDOW:
        return "signature outside the time window"
    want = sign(secret, method, chunk, length, when, node)
    if not hmac.compare_digest(want, signature):
        return "bad signature"
    return None
