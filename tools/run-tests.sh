#!/usr/bin/env bash
# Set everything up, then run the whole test suite (real FUSE mounts, a real SeaweedFS
# S3 server on loopback started by the fixtures).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh frameworks
# Two workers, a test file each, the longest files first (tests/support/schedule.py,
# tests/durations.json); extra arguments go to pytest (a file, -k, ...).
exec .venv/bin/python -m pytest -n 2 --dist loadfile --durations=25 "$@"
