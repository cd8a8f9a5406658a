"""The peer protocol on the wire: one small HTTP/1.1 exchange per chunk.

    GET /chunk/<chunk id>?length=<n> HTTP/1.1
    X-Ckptfs-Node: <asking node id>
    X-Ckptfs-Time: <unix seconds, the asker's clock>
    X-Ckptfs-Signature: <hex HMAC-SHA256, peer_auth.sign>
    [X-Ckptfs-Relay: 1]
    Connection: close

answered ``200`` with exactly ``n`` bytes, ``404``/``503`` (the server could not get the
chunk: ask the next peer or the store), or ``403`` with no body (not signed right).
``X-Ckptfs-Relay: 1`` (signed: the method signed is then ``RELAY``) asks the server to
act as the chunk's relay — fetch it from its owner if it has not got it; without it a
server fetches only from the store, so no request goes further than two hops.  One request per
connection.  Heads are bounded (``MAX_HEAD``) and read under a deadline by both sides.

Knows bytes and trio streams; nothing of the cache, the store or membership.
"""

from __future__ import annotations

import re

import trio

MAX_HEAD = 4096
CHUNK_ID = re.compile(r"^[A-Za-z0-9:_.-]{8,160}$")
RELAY_HEADER = "X-Ckptfs-Relay: 1\r\n"
RELAY_METHOD = "RELAY"          # what a relay request's signature covers instead of GET
_PATH = re.compile(r"^/chunk/([^/?]+)\?length=(\d{1,12})$")


class WireError(Exception):
    """The other side broke the protocol (a head too long, a bad line, an early close)."""


async def read_head(stream: trio.abc.ReceiveStream) -> tuple[bytes, bytes]:
    """The head up to the blank line, and whatever body bytes came with it."""
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HEAD:
            raise WireError("head too long")
        piece = await stream.receive_some(MAX_HEAD)
        if not piece:
            raise WireError("connection closed before the head ended")
        data += piece
    head, _, rest = data.partition(b"\r\n\r\n")
    if len(head) > MAX_HEAD:
        raise WireError("head too long")
    return head, rest


def parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    """(first line, lower-cased header names -> values)."""
    try:
        lines = head.decode("ascii").split("\r\n")
    except UnicodeDecodeError:
        raise WireError("head is not ASCII") from None
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise WireError("bad header line")
        fields[name.strip().lower()] = value.strip()
    return lines[0], fields


def request_line(chunk: str, length: int) -> str:
    return f"GET /chunk/{chunk}?length={length} HTTP/1.1"


def parse_request_line(line: str) -> tuple[str, int]:
    """(chunk id, length) of a chunk request; WireError for anything else."""
    parts = line.split(" ")
    if len(parts) != 3 or parts[0] != "GET" or not parts[2].startswith("HTTP/1."):
        raise WireError("not a chunk request")
    m = _PATH.match(parts[1])
    if m is None or not CHUNK_ID.match(m.group(1)):
        raise WireError("not a chunk request")
    return m.group(1), int(m.group(2))


def response_head(status: str, length: int = 0) -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Length: {length}\r\n"
            f"Connection: close\r\n\r\n").encode()
