"""A storage endpoint that accepts and never answers ends in a coded error, bounded by the timeouts (round 3, class 4).

The endpoint is a real listening socket on 127.0.0.1 that accepts every connection and never
sends a byte (what a stuck S3 gateway does). ``inspect s3://...`` pointed at it held the
process past 900 s; with ``--remote-timeout 1 --remote-retries 2`` it must fail with one
``error: [E1..]`` line, having made at most 2 attempts (s3fs's and botocore's own retries off).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.special_files import fails_instead_of_hanging

pytest.importorskip("s3fs")
runner = CliRunner()


@pytest.fixture
def silent_endpoint() -> Iterator[tuple[int, list[socket.socket]]]:
    """A port that accepts connections and never answers; yields (port, accepted connections)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            accepted.append(conn)  # held open, never read from or written to

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1], accepted
    stop.set()
    t.join(timeout=5)
    for c in accepted:
        c.close()
    srv.close()


def test_a_silent_endpoint_ends_in_a_coded_error(silent_endpoint: tuple[int, list[socket.socket]]) -> None:
    port, accepted = silent_endpoint
    argv = [
        "--storage-option",
        f"client_kwargs.endpoint_url=http://127.0.0.1:{port}",
        "--storage-option",
        "key=AKIAFAKE",
        "--storage-option",
        "secret=fake",
        "--remote-timeout",
        "1",
        "--remote-retries",
        "2",
        "inspect",
        "s3://bucket/ckpt",
    ]
    with fails_instead_of_hanging(120, "inspect of a silent endpoint hung"):
        res = runner.invoke(app, argv)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and lines and lines[0].startswith("error: [E1"), res.stderr
    assert "Traceback" not in res.stderr and "E999" not in res.stderr
    assert "after 2 attempt(s)" in lines[0], lines[0]
    # each attempt may open two connections (aiobotocore reconnects once after a read timeout); never 5 x 5 x 2
    assert 1 <= len(accepted) <= 4, f"{len(accepted)} connections: the retries multiplied"


def test_the_timeout_option_is_a_positive_count() -> None:
    res = runner.invoke(app, ["--remote-timeout", "0", "rules"])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E100]"), res.stderr
