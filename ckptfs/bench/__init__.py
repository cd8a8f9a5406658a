"""The benchmark and its baselines (a bare passthrough daemon, a SeaweedFS launcher)."""
