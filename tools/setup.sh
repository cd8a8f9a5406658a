#!/usr/bin/env bash
# Install everything ckptfs needs on a Debian machine (run as root); idempotent.
#   apt: fuse3, libfuse3-dev, pkg-config (pyfuse3 builds from source), gcc, python3 venv/headers,
#        openssl (a TLS test makes its own CA), util-linux (fincore, in a page-cache test)
#   .venv in the repository root with ckptfs and its test dependencies.
# Usage: tools/setup.sh [extra ...]   e.g. tools/setup.sh frameworks
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(fuse3 libfuse3-dev pkg-config gcc python3-venv python3-dev openssl util-linux)
missing=()
for p in "${packages[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
extras="test"
for e in "$@"; do extras="$extras,$e"; done
stamp=".venv/.ckptfs-installed-$(sha256sum pyproject.toml | cut -c1-16)-${extras//,/-}"
if [ ! -e "$stamp" ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extras]"
    touch "$stamp"
fi

# Kernel FUSE passthrough (README "The data path"): libfuse 3.17 and a patched pyfuse3 in
# .venv; if that cannot be built, one line says so and the stock pyfuse3 stays.
tools/build_passthrough.sh .venv

# mount -t fuse.ckptfs (fstab): mount(8) runs mount.fuse3 with a clean PATH, which runs
# `ckptfs STORE_URL MOUNTPOINT -o ...`; put the command where that PATH finds it.
if [ "$(id -u)" = 0 ] && [ -d /usr/local/sbin ]; then
    ln -sfn "$PWD/.venv/bin/ckptfs" /usr/local/sbin/ckptfs
fi
