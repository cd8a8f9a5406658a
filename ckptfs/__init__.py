"""ckptfs: a FUSE filesystem for ML checkpoints, published atomically to an object store.

Training scripts use ``ckptfs.wait``, ``ckptfs.state`` and ``ckptfs.commit`` (api.py)."""

from .cli.api import CommitResult, NotMounted, commit, state, wait

__version__ = "0.1.0"
__all__ = ["CommitResult", "NotMounted", "commit", "state", "wait"]
