"""Object stores: the bottom layer.

``base`` holds the ``ObjectStore`` protocol and its errors; ``local`` (a directory),
``s3`` (boto3) and ``memory`` (unit tests, with hooks) implement it; ``retry`` (backoff
within a deadline, counting) and ``faults`` (injected failures) wrap any store; ``url``
opens the store a URL names.  The names every other layer uses are re-exported here, so
``from ckptfs.store import X`` is the one way in.  Knows nothing about files, inodes or
FUSE: it moves opaque bytes under opaque keys.
"""

from .base import (AccessDenied, BucketMissing, ListedObject, NotFound, ObjectStore, PreconditionFailed, StoreClosed,
                   StoreError, StoreTimeout, TransientStoreError, is_permanent,
                   store_cause)
from .local import LocalStore
from .memory import Call, Gate, MemoryStore
from .retrypolicy import RetryPolicy
from .retry import CountingStore, RetryingStore, StoreStats, store_policy
from .s3 import S3Store
from .url import BadStoreURL, check_store_url, open_store

__all__ = [
    "AccessDenied", "BucketMissing", "BadStoreURL", "Call", "CountingStore", "Gate", "ListedObject", "LocalStore",
    "MemoryStore", "NotFound", "ObjectStore", "PreconditionFailed", "RetryPolicy",
    "RetryingStore", "S3Store", "StoreClosed", "StoreError", "StoreStats", "StoreTimeout",
    "TransientStoreError", "check_store_url", "is_permanent", "open_store", "store_cause", "store_policy",
]
