#!/usr/bin/env bash
# The main job: set everything up, then mount ckptfs over the embedded local store in a
# scratch directory, save a checkpoint the way trainers do, remount with fresh node-local
# state, read it back and verify it.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
exec .venv/bin/python tools/quickstart.py "$@"
