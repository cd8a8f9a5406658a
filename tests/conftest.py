"""Shared fixtures: a real SeaweedFS S3 server on loopback, real ckptfs mounts started
through the CLI exactly as a user would, and the core over the in-memory store.  The
helpers they use live in tests/support/ (one definition each); the names other test
modules import from here are re-exported below."""

from __future__ import annotations

import uuid

import pytest

# Assertions in the shared helpers explain themselves like those in tests.
pytest.register_assert_rewrite("support")

from support import coverage_gate  # noqa: E402

# Before anything imports ckptfs.core: its module-level statements count too.
coverage_gate.start()

from ckptfs.bench.seaweed import SeaweedServer  # noqa: E402
from ckptfs.core import Config  # noqa: E402
from ckptfs.store import MemoryStore  # noqa: E402
from support.core import Core, open_core  # noqa: E402
from support.mounts import (BUCKET, Mount, StoreSpec, eventually, run_ckptfs,  # noqa: E402,F401
                            one_line_failure)
from support.proxy import FaultProxy  # noqa: E402

# Every integration test fails on an unexpected ERROR or Traceback in a daemon log; the
# core-coverage figure is printed (and held at its floor) at the end of a run; the
# longest test files run first (tests/durations.json); pytester runs users' example
# tests against the ckptfs.testing plugin.
pytest_plugins = ["support.logcheck", "support.coverage_gate", "support.schedule", "pytester"]


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    server = SeaweedServer(tmp_path_factory.mktemp("seaweed"))
    server.start()
    server.create_bucket(BUCKET)
    yield server
    server.stop()


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> StoreSpec:
    """A fresh, empty store: a LocalStore directory or a prefix in the SeaweedFS bucket."""
    if request.param == "local":
        root = tmp_path / "store"
        root.mkdir()
        return StoreSpec("local", f"file://{root}", root=root)
    server = request.getfixturevalue("seaweed")
    return StoreSpec("s3", f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}", env=server.env(),
                     seaweed=server)


@pytest.fixture
def local_store(tmp_path) -> StoreSpec:
    root = tmp_path / "store"
    root.mkdir(exist_ok=True)
    return StoreSpec("local", f"file://{root}", root=root)


@pytest.fixture
def s3_store(seaweed) -> StoreSpec:
    return StoreSpec("s3", f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}", env=seaweed.env(),
                     seaweed=seaweed)


@pytest.fixture
def store_proxy(s3_store):
    """The same store as ``s3_store``, reached through a fault-injecting TCP proxy:
    ``store_proxy.proxy.mode = "hang"`` (pass/refuse/hang/503/reset/slow) while a
    daemon runs.  ``s3_store`` in the same test is the direct way to the same prefix."""
    proxy = FaultProxy(s3_store.seaweed.s3_port)
    env = dict(s3_store.env)
    env["AWS_ENDPOINT_URL"] = proxy.endpoint_url
    yield StoreSpec("s3", s3_store.url, env=env, seaweed=s3_store.seaweed, proxy=proxy)
    proxy.close()


@pytest.fixture
def make_mount(tmp_path):
    mounts: list[Mount] = []

    def factory(store: StoreSpec, name: str | None = None, **start_kwargs) -> Mount:
        mount = Mount(tmp_path, store, name or f"node{len(mounts)}")
        mounts.append(mount)
        extra = start_kwargs.pop("extra", ())
        mount.start(*extra, **start_kwargs)
        return mount

    yield factory
    for mount in mounts:
        mount.cleanup()


@pytest.fixture
def mnt(store, make_mount) -> Mount:
    return make_mount(store)


# --------------------------------------------------------------------------- the core, no FUSE
# A Filesystem over the in-memory store, as a pytest-trio fixture that owns its nursery
# (background publishing and the metadata log run in it).  Here, not in tests/unit/
# conftest.py: a second conftest module would shadow this one for `from conftest import`.

@pytest.fixture
def core_config() -> dict:
    """Config fields for the ``core`` fixture; a test overrides it to change them."""
    return {}


@pytest.fixture
async def core(tmp_path, core_config):
    store = MemoryStore(gate_limit=30)
    async with open_core(tmp_path, store, Config(**core_config)) as fs:
        yield Core(fs, store)
