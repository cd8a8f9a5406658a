"""Where torch ranks of a framework test meet: a file (torch's FileStore), never a TCP
port picked free and closed (another process can take it before rank 0 binds it)."""

from __future__ import annotations

import os
import tempfile


def rendezvous() -> str:
    """A fresh ``file://`` init method for ``torch.distributed``."""
    fd, path = tempfile.mkstemp(prefix="ckptfs-rdzv-")
    os.close(fd)
    os.unlink(path)             # FileStore creates it; it must not hold an old run
    return f"file://{path}"
