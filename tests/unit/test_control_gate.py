"""The control socket's bounds (control_gate.py, control.py): caps per uid and in all
with room kept for root, caps shrunk below the descriptor limit, one log line per
offender per minute, and a request that is too large, too slow or too deep answered
with one line and closed."""

from __future__ import annotations

import json
import logging
import os
import socket

import pytest
import trio

from ckptfs.node.control import ControlServer
from ckptfs.node.control_gate import ALL_USERS, FD_SHARE, ROOT_RESERVE, Every, Gate, Limits


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_ordinary_user_holding_its_whole_quota_leaves_room_for_root_and_others():
    gate = Gate(Limits(per_uid=2, all_users=3, root=1))
    assert gate.admit(1000) is None and gate.admit(1000) is None
    assert "uid 1000" in gate.admit(1000)
    assert gate.admit(1001) is None
    assert "ordinary users" in gate.admit(1002)         # all users' cap
    assert gate.admit(0) is None                         # root's own room
    assert "root" in gate.admit(0)
    gate.release(1000)
    assert gate.admit(1002) is None
    assert gate.report()["connections"] == {"1000": 1, "1001": 1, "0": 1, "1002": 1}


def test_the_caps_stay_well_below_the_descriptor_limit():
    assert Limits.for_fd_limit(20000) == Limits()
    assert Limits.for_fd_limit(1024) == Limits()
    for nofile in (16, 64, 256, 512):
        limits = Limits.for_fd_limit(nofile)
        assert limits.all_users + limits.root <= max(2, nofile // FD_SHARE), nofile
        assert limits.root >= 1 and limits.per_uid >= 1
        assert limits.per_uid <= limits.all_users
    assert ALL_USERS + ROOT_RESERVE <= 1024 // FD_SHARE


def test_an_offender_is_named_once_a_minute_with_what_it_did(caplog):
    clock = Clock()
    gate = Gate(Limits(), clock=clock)
    with caplog.at_level(logging.WARNING, logger="ckptfs.node.control_gate"):
        for _ in range(5000):
            gate.offence(1000, "connections over the cap")
        gate.offence(1001, "request over 8192 bytes")
        clock.now = 59.0
        gate.offence(1000, "request over 8192 bytes")
        assert len(caplog.records) == 2
        clock.now = 61.0
        gate.offence(1000, "connections over the cap")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "uid 1000" in lines[0] and "uid 1001" in lines[1]
    assert "5000 × connections over the cap" in lines[2], lines[2]
    assert "1 × request over 8192 bytes" in lines[2], lines[2]
    assert not any(r.exc_info for r in caplog.records)
    assert gate.report()["refused"]["1000"] == {"connections over the cap": 5001,
                                                "request over 8192 bytes": 1}


def test_accept_failing_for_want_of_descriptors_is_one_line_a_minute(caplog):
    clock = Clock()
    gate = Gate(Limits(), clock=clock)
    emfile = OSError(24, "Too many open files")
    with caplog.at_level(logging.WARNING, logger="ckptfs.node.control_gate"):
        for tick in range(600):          # a minute of retries every 0.1 s
            clock.now = tick / 10
            gate.accept_failed(emfile)
        clock.now = 60.0
        gate.accept_failed(emfile)
    assert [r.getMessage().count("Too many open files") for r in caplog.records] == [1, 1]
    assert not any(r.exc_info for r in caplog.records)


def test_every_forgets_quiet_keys():
    clock = Clock()
    every = Every(60, clock)
    for key in range(3000):
        assert every.due(key)
        clock.now += 0.1
    assert len(every._last) <= 1026
    assert not every.due(2999)


class FakeHost:
    fs = opts = config = stale = None

    def status_doc(self) -> dict:
        return {"ok": True}


async def _ask(path: str, payload: bytes) -> bytes:
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with sock:
        await sock.connect(path)
        try:
            await sock.send(payload)
        except OSError:
            pass
        out = b""
        while True:
            try:
                piece = await sock.recv(65536)
            except ConnectionResetError:
                return out
            if not piece:
                return out
            out += piece


@pytest.mark.trio
async def test_requests_too_large_too_slow_or_too_deep_get_one_line(tmp_path, caplog):
    path = str(tmp_path / "c.sock")
    server = ControlServer(FakeHost(), path,  # type: ignore[arg-type]
                           Limits(per_uid=4, all_users=8, root=4, max_request=4096,
                                  deadline=0.5))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        replies = {
            "large": await _ask(path, b"x" * 4097),     # read whole: no reset
            "slow": await _ask(path, b'{"cmd": "sta'),
            "deep": await _ask(path, b"[" * 2000 + b"]" * 2000 + b"\n"),
            "odd": await _ask(path, b'{"cmd": ["status"]}\n'),
            "status": await _ask(path, b'{"cmd": "status"}\n'),
        }
        nursery.cancel_scope.cancel()
    assert json.loads(replies["large"])["errno"] == "EMSGSIZE"
    assert json.loads(replies["slow"])["errno"] == "ETIMEDOUT"
    assert json.loads(replies["deep"]) == {"error": "bad request"}
    assert json.loads(replies["odd"]) == {"error": "bad request"}
    status = json.loads(replies["status"])
    assert status["ok"] and status["control"]["refused"] == {
        str(os.getuid()): {"request over 4096 bytes": 1,
                                          "no complete request within 0.5 s": 1}}
    assert not any(r.exc_info for r in caplog.records)
    assert server.gate.report()["connections"] == {}


@pytest.mark.trio
async def test_a_client_turned_away_as_busy_tries_again(tmp_path, monkeypatch):
    from pathlib import Path

    from ckptfs.cli import api

    path = str(tmp_path / "c.sock")
    monkeypatch.setattr(api, "control_socket", lambda mountpoint: path)
    server = ControlServer(FakeHost(), path,  # type: ignore[arg-type]
                           Limits(per_uid=1, all_users=1, root=1))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        held = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await held.connect(path)                 # root's one connection, idle
        while not server.gate.held:
            await trio.sleep(0.01)
        answer: list[dict] = []

        def ask() -> None:
            answer.extend(api.request(Path("/mnt"), {"cmd": "status"}, timeout=60))

        async def client() -> None:
            await trio.to_thread.run_sync(ask)

        nursery.start_soon(client)
        while not server.gate.offences:          # it was turned away at least once
            await trio.sleep(0.01)
        held.close()                              # room again
        while not answer:
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert answer[0]["ok"] and answer[0]["control"]["refused"]["0"][
        "connections over the cap"] >= 1
