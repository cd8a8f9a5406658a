"""ckptfs: a FUSE filesystem for ML checkpoints, published atomically to an object store."""

__version__ = "0.1.0"
