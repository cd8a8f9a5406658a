"""Node-local metadata in LMDB: the namespace, its transactions, the metadata log."""
