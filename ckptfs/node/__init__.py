"""One node's daemon: wiring, the control socket, metrics, fstab, preflight checks, settings."""
