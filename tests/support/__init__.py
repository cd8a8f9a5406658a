"""Helpers the tests share, one definition each: mounts and the CLI (``mounts``), the core
without FUSE (``core``), the fault proxy (``proxy``), the daemon-log check (``logcheck``,
a pytest plugin), running code as another user (``asuser``), POSIX calls Python lacks
(``posix``), the direct S3 client's stores (``s3_direct``) and the core-coverage gate
(``coverage_gate``).

Fixtures stay in ``tests/conftest.py``; this package holds plain functions and classes
and knows nothing of pytest's fixture machinery (``logcheck`` and ``coverage_gate`` are
plugins, registered by the conftest).
"""
