#!/usr/bin/env bash
# Kernel FUSE passthrough for ckptfs (README "The data path"): build libfuse 3.17.2 from
# Debian trixie's source package and pyfuse3 3.5.0 from its PyPI sdist with
# tools/patches/pyfuse3-3.5.0-passthrough.patch into VENV (default .venv): libfuse under
# VENV/opt/libfuse-3.17.2 (beside the system's), pyfuse3 linked to it by rpath.  Nothing
# else is downloaded but the build tools' pinned wheels (meson, ninja, Cython, setuptools).
# Idempotent: a stamp carries the patch's hash.  If anything fails, one line says so and
# the stock pyfuse3 stays (ckptfs then runs its data path through the daemon); the build
# log stays in VENV/ckptfs-passthrough-build.log.  Run as root (apt-get).
# Usage: tools/build_passthrough.sh [VENV]
set -uo pipefail
cd "$(dirname "$0")/.."
venv=$(realpath -m "${1:-.venv}")
patch=$PWD/tools/patches/pyfuse3-3.5.0-passthrough.patch
prefix=$venv/opt/libfuse-3.17.2
stamp=$venv/.ckptfs-passthrough-$(sha256sum "$patch" | cut -c1-16)
log=$venv/ckptfs-passthrough-build.log
py=$venv/bin/python
# Built, and still installed (a later pip run may have put the stock pyfuse3 back).
if [ -e "$stamp" ] && (cd / && "$py" -c "import pyfuse3, sys; sys.exit(not getattr(
        pyfuse3, 'PASSTHROUGH_SUPPORTED', False))" 2>/dev/null); then
    exit 0
fi
work=$(mktemp -d /tmp/ckptfs-passthrough.XXXXXX)
trap 'rm -rf "$work"' EXIT

build() {
    set -euxo pipefail
    # The source package, from a private sources list (the machine's stay untouched).
    command -v dpkg-source >/dev/null || {
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dpkg-dev >/dev/null; }
    mkdir -p "$work/apt/lists/partial" "$work/src"
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]" \
         "http://deb.debian.org/debian trixie main" > "$work/apt/trixie.list"
    local apt=(-o "Dir::Etc::SourceList=$work/apt/trixie.list" -o "Dir::Etc::SourceParts=/dev/null"
               -o "Dir::State::Lists=$work/apt/lists")
    apt-get "${apt[@]}" update -qq
    (cd "$work/src" && apt-get "${apt[@]}" source -qq fuse3=3.17.2-3)
    # Build tools, pinned, beside the build only.
    "$py" -m pip install -q --disable-pip-version-check --target "$work/tools" \
        meson==1.12.1 ninja==1.13.2 Cython==3.1.8 setuptools==84.2.1 setuptools_scm==10.3.4
    export PATH=$work/tools/bin:$PATH PYTHONPATH=$work/tools
    (cd "$work/src/fuse3-3.17.2" &&
        meson setup build --prefix="$prefix" --libdir=lib -Dexamples=false -Dutils=false \
            -Dtests=false -Duseroot=false -Dudevrulesdir="$prefix/udev" -Dinitscriptdir= &&
        ninja -C build install)
    "$py" -m pip download -q --disable-pip-version-check --no-deps --no-binary pyfuse3 \
        --no-build-isolation pyfuse3==3.5.0 -d "$work/sdist"
    tar xzf "$work/sdist/pyfuse3-3.5.0.tar.gz" -C "$work/sdist"
    cd "$work/sdist/pyfuse3-3.5.0"
    patch -p1 < "$patch"
    rm -f src/pyfuse3/__init__.c        # generated again from the patched .pyx
    PKG_CONFIG_PATH=$prefix/lib/pkgconfig LDFLAGS="-Wl,-rpath,$prefix/lib" \
        "$py" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
        --force-reinstall .
    cd / && PYTHONPATH= "$py" -c "import pyfuse3; assert pyfuse3.PASSTHROUGH_SUPPORTED"
}

if (build) >"$log" 2>&1; then
    touch "$stamp"
    echo "setup: pyfuse3 with kernel passthrough built (libfuse 3.17.2 in $prefix)" >&2
else
    echo "setup: kernel passthrough not built (see $log); stock pyfuse3 stays: data path daemon" >&2
fi
