"""The server's limits: request size, open connections and their headers, the API key's sources, the port, and a
SIGTERM drain that ends."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from decode_path import named_decode  # noqa: E402
from serving import MODEL, Server  # noqa: E402


@pytest.fixture
def small_bodies(tiny_artifacts, tmp_path):
    running = Server(tiny_artifacts["fp8"], tmp_path / "small-bodies", "--max-request-bytes", "4096", "--body-timeout", "2")
    yield running
    running.stop()


@pytest.mark.parametrize("size, declared, status", [
    (2_000, True, 200),
    (10_000, True, 413),  # refused on its Content-Length
    (10_000, False, 413),  # chunked, refused while it is read
    (50 << 20, True, 413),
])
def test_request_bodies_over_the_limit_get_413(small_bodies, size, declared, status):
    prompt = "a" * max(0, size - 100)
    body = ('{"model": "%s", "max_tokens": 1, "prompt": "%s"}' % (MODEL, prompt)).encode()
    content = body if declared else iter([body[i:i + 1024] for i in range(0, len(body), 1024)])
    answer = httpx.post(f"{small_bodies.url}/v1/completions", content=content, timeout=120,
                        headers={"Content-Type": "application/json"})
    assert answer.status_code == status, answer.text[:300]
    if status == 413:
        error = answer.json()["error"]
        assert error["code"] == "request_too_large" and "4096 bytes" in error["message"]
    assert httpx.get(f"{small_bodies.url}/health", timeout=30).status_code == 200


def _serve_fails(artifact, *args, env=None):
    done = subprocess.run([sys.executable, "-m", "k2deploy", *named_decode(["serve", str(artifact), *args])],
                          capture_output=True,
                          text=True, timeout=120, env=env)
    return done


@pytest.mark.parametrize("args, message", [
    (["--port", "99999"], "--port 99999 is not a TCP port"),
    (["--port", "-1"], "--port -1 is not a TCP port"),
    (["--api-key", ""], "--api-key is empty"),
    (["--api-key-file", "/nonexistent/key"], "--api-key-file /nonexistent/key"),
    (["--max-request-bytes", "10"], "--max-request-bytes must be at least 1024"),
    (["--drain-timeout", "-1"], "--drain-timeout must be at least 0 seconds"),
    (["--header-timeout", "0"], "--header-timeout must be more than 0 seconds"),
    (["--max-connections", "0"], "--max-connections must be at least 1"),
])
def test_bad_server_options_are_one_line(tiny_artifacts, args, message):
    done = _serve_fails(tiny_artifacts["fp8"], *args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("source", ["file", "environment"])
def test_the_api_key_from_a_file_or_the_environment(tiny_artifacts, tmp_path, source, monkeypatch):
    if source == "file":
        (tmp_path / "key").write_text("sesame\n")
        args = ("--api-key-file", str(tmp_path / "key"))
    else:
        args = ()
        monkeypatch.setenv("K2DEPLOY_API_KEY", "sesame")
    server = Server(tiny_artifacts["fp8"], tmp_path / "keyed", *args)
    try:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert "sesame" not in " ".join(server.process.args)  # not on the command line, where `ps` shows it
    finally:
        server.stop()


def _long_stream(server):
    """A request that runs for many steps; returns the open stream and its line iterator."""
    http = httpx.Client(timeout=120)
    body = {"model": MODEL, "prompt": "The ferry", "max_tokens": 3000, "temperature": 0, "stream": True}
    stream = http.stream("POST", f"{server.url}/v1/completions", json=body)
    lines = stream.__enter__().iter_lines()
    assert next(line for line in lines if line.startswith("data: "))
    return http, stream, lines


def _rest(lines) -> list[str]:
    try:
        return [line for line in lines if line.startswith("data: ")]
    except httpx.HTTPError:  # the server went away mid-stream
        return ["(cut)"]


@pytest.mark.parametrize("second_signal", [False, True], ids=["drain timeout", "second SIGTERM"])
def test_sigterm_drain_ends(tiny_artifacts, tmp_path, second_signal):
    """A request of 3000 tokens is still running: after --drain-timeout, or at a second SIGTERM, the server exits
    without it finishing."""
    drain = "600" if second_signal else "1"
    server = Server(tiny_artifacts["fp8"], tmp_path / "drain", "--max-context", "4096", "--drain-timeout", drain)
    http, stream, lines = _long_stream(server)
    try:
        server.process.send_signal(signal.SIGTERM)
        if second_signal:  # once the first is being handled: two signals sent at once may arrive as one
            deadline = time.monotonic() + 60
            while "Shutting down" not in server.stderr_path.read_text():
                assert time.monotonic() < deadline and server.process.poll() is None, server.stderr_path.read_text()
                time.sleep(0.05)
            server.process.send_signal(signal.SIGTERM)
        rest = _rest(lines)
        server.process.wait(timeout=120)
    finally:
        http.close()
        server.stop()
    assert not any('"finish_reason": "length"' in line for line in rest)  # it did not run to its end
    if second_signal:
        assert server.process.returncode == 128 + signal.SIGTERM
        assert "second signal" in server.stderr_path.read_text()
    else:  # the stream hears why, then ends properly; the server logs no traceback
        assert rest[-1] == "data: [DONE]", rest[-3:]
        assert "shut down before this request finished (--drain-timeout 1 s)" in rest[-2]
        assert "Traceback" not in server.stderr_path.read_text()


def test_a_body_promised_and_never_sent_gets_408(small_bodies):
    """A client that sends headers promising 100 bytes and then stalls does not hold its connection forever."""
    host, port = small_bodies.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        answer = b""
        while chunk := conn.recv(4096):  # the server closes the connection after its answer (headers and body
            answer += chunk              # may arrive apart)
    answer = answer.decode()
    assert answer.startswith("HTTP/1.1 408") and "request_timeout" in answer, answer


def _half_open(server: Server, count: int) -> list[socket.socket]:
    """`count` connections that send the start of a request's headers and never the rest."""
    host, port = server.url.removeprefix("http://").split(":")
    connections = []
    for _ in range(count):
        connections.append(socket.create_connection((host, int(port)), timeout=60))
        connections[-1].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    return connections


def _closed_by_the_server(connection: socket.socket) -> bool:
    try:
        return connection.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.slow
def test_half_open_connections_neither_stall_the_server_nor_stay(tiny_artifacts, tmp_path):
    """200 clients that never finish their headers: a whole request is still answered at once, one connection past
    --max-connections gets a 503, and the server closes the 200 after --header-timeout."""
    server = Server(tiny_artifacts["fp8"], tmp_path / "half-open", "--header-timeout", "8", "--max-connections", "200")
    connections = []
    try:
        connections += _half_open(server, 199)
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # the 200th connection, answered
        connections += _half_open(server, 1)
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503  # the 201st
        assert all(_closed_by_the_server(c) for c in connections)  # each within its recv timeout, 60 s
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        for connection in connections:
            connection.close()
        server.stop()
