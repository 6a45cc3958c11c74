"""gpuswapctl through a restart of gpuswapd: a dropped connection is a pause, the token reclaims the request.

A stand-in for gpuswapd on a real Unix socket answers the acquire with its token and hangs up
(as a SIGKILL would); the acquire is sent again with ``"reclaim"``, and answered.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from gpuswapd.ctl import reclaim
from gpuswapd.ctl.client import Unreachable
from gpuswapd.ctl.reclaim import Acquirer

TOKEN = "ab" * 16


def _stand_in(path: Path, answers: list[str]) -> tuple[threading.Thread, list[dict[str, Any]]]:
    """Serve one connection per answer: "drop" (accept the request, then hang up), "lease" or "stopping"."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)
    seen: list[dict[str, Any]] = []

    def serve() -> None:
        with server:
            for answer in answers:
                conn, _ = server.accept()
                with conn, conn.makefile("rwb") as f:
                    seen.append(json.loads(f.readline()))
                    f.write(json.dumps({"event": "accepted", "token": TOKEN, "reclaim_s": 1}).encode() + b"\n")
                    if answer == "lease":
                        f.write(json.dumps({"ok": True, "lease": {"id": "l1"}}).encode() + b"\n")
                    elif answer == "stopping":
                        error = {"code": "stopping", "message": "gpuswapd is stopping"}
                        f.write(json.dumps({"ok": False, "error": error}).encode() + b"\n")
                    f.flush()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread, seen


def test_an_acquire_whose_gpuswapd_restarts_is_sent_again_with_its_token(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reclaim, "BACKOFF_S", (0.01, 0.01))
    path = tmp_path / "gpuswapd.sock"
    thread, seen = _stand_in(path, ["drop", "stopping", "lease"])
    acquirer = Acquirer(str(path), {"op": "acquire", "for": 60}, quiet=True)
    client, reply = acquirer.acquire()
    client.close()
    thread.join(5)
    assert reply["lease"]["id"] == "l1" and acquirer.reclaims == 1
    assert [m.get("reclaim") for m in seen] == [None, TOKEN, TOKEN]


def test_a_gpuswapd_that_does_not_come_back_within_the_grace_is_unreachable(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reclaim, "BACKOFF_S", (0.01, 0.05))
    monkeypatch.setattr(reclaim, "RECONNECT_FLOOR_S", 0.3)
    path = tmp_path / "gpuswapd.sock"
    thread, _ = _stand_in(path, ["drop"])  # then nobody listens: connections are refused
    with pytest.raises(Unreachable):
        Acquirer(str(path), {"op": "acquire"}, quiet=True).acquire()
    thread.join(5)


def test_an_acquire_never_accepted_is_not_retried(tmp_path: Path) -> None:
    with pytest.raises(Unreachable):
        Acquirer(str(tmp_path / "none.sock"), {"op": "acquire"}, quiet=True).acquire()
