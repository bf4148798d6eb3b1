"""`labavg dashboard` off loopback: a password to log in, only the origins it serves, and its
own flags refused in one line with exit status 2 (no traceback)."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import time
import urllib.parse

import pytest

from labavg.cli.main import main
from tests.support import PYTHON, child_env, free_port


def _refusal(capsys, *args: str) -> str:
    code = main(["dashboard", "--no-browser", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("labavg: error: "), err
    return err[0]


@pytest.mark.parametrize("args, words", [
    (["--address", "no-such-host.invalid"], "--address 'no-such-host.invalid': not an address"),
    (["--address", "300.1.2.3"], "--address '300.1.2.3'"),
    (["--port", "99999"], "--port 99999: not a TCP port"),
    (["--port", "-1"], "--port -1: not a TCP port"),
    (["--address", "192.0.2.1"], "not an address of this machine"),  # TEST-NET, never local
])
def test_bad_address_or_port_is_one_line(capsys, args, words):
    assert words in _refusal(capsys, *args)


def test_a_port_in_use_is_one_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _refusal(capsys, "--port", str(port))
    assert f"cannot listen on 127.0.0.1 port {port}: the port is in use" in line


@pytest.mark.parametrize("content, words", [(None, "No such file"), ("short", "8 or more"),
                                            (b"\xff\xfe\x00binary", "binary data")])
def test_a_bad_password_file_is_one_line(tmp_path, capsys, content, words):
    path = tmp_path / "password"
    if content is not None:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    line = _refusal(capsys, "--address", "0.0.0.0", "--port", str(free_port()),
                    "--password-file", str(path))
    assert f"--password-file {path}" in line and words in line


def test_serve_refuses_a_network_address_without_a_password():
    # In a child with a time limit: a serve() that does not refuse serves until killed.
    code = ("from dashboard.app import serve\n"
            f"serve(port={free_port()}, open_browser=False, address='0.0.0.0')\n")
    try:
        proc = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True,
                              env=child_env(), timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("serve() listened on 0.0.0.0 without a password")
    assert "UserError: address '0.0.0.0' is not a loopback address" in proc.stderr, proc.stderr


def _start(tmp_path, *args: str) -> tuple[subprocess.Popen, int, str]:
    port = free_port()
    proc = subprocess.Popen([PYTHON, "-m", "labavg", "dashboard", "--no-browser", "--port",
                             str(port), "--runs-dir", str(tmp_path / "runs"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env(), cwd=tmp_path)
    first = proc.stdout.readline()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, first + proc.stdout.read()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port, first
        except OSError:
            time.sleep(0.3)
    proc.kill()
    pytest.fail(f"the dashboard did not listen within 120 s: {first}")


async def _ws_handshake(port: int, headers: dict[str, str]) -> int:
    """The HTTP status of a websocket handshake with /app/ws (101 when it is accepted)."""
    from tornado.httpclient import HTTPClientError, HTTPRequest
    from tornado.websocket import websocket_connect

    request = HTTPRequest(f"ws://127.0.0.1:{port}/app/ws", headers=headers, follow_redirects=False)
    try:
        conn = await websocket_connect(request)
    except HTTPClientError as exc:
        return exc.code
    conn.close()
    return 101


async def _http(port: int, path: str, method: str = "GET", body: str | None = None,
                headers: dict[str, str] | None = None):
    from tornado.httpclient import AsyncHTTPClient, HTTPClientError

    try:
        return await AsyncHTTPClient().fetch(f"http://127.0.0.1:{port}{path}", method=method,
                                             body=body, headers=headers or {},
                                             follow_redirects=False)
    except HTTPClientError as exc:
        return exc.response


@pytest.mark.slow  # a real Panel server: ~20 s under load
def test_off_loopback_it_asks_for_the_printed_password_and_its_own_origins(tmp_path):
    proc, port, first = _start(tmp_path, "--address", "0.0.0.0")
    try:
        password = re.search(r"password (\S+) \(made for this session", first)
        assert password, first
        password = password.group(1)

        async def probe():
            anonymous = await _ws_handshake(port, {})  # a program that sends no Origin
            page = await _http(port, "/app")
            wrong = await _http(port, "/login", "POST",
                                urllib.parse.urlencode({"username": "x", "password": "nope"}))
            login = await _http(port, "/login", "POST",
                                urllib.parse.urlencode({"username": "x", "password": password}))
            cookie = "; ".join(c.split(";")[0] for c in login.headers.get_list("Set-Cookie"))
            logged_page = await _http(port, "/app", headers={"Cookie": cookie})
            foreign = await _ws_handshake(port, {"Cookie": cookie,
                                                 "Origin": f"http://evil.example:{port}"})
            own = await _ws_handshake(port, {"Cookie": cookie,
                                             "Origin": f"http://localhost:{port}"})
            return anonymous, page, wrong, cookie, logged_page, foreign, own

        anonymous, page, wrong, cookie, logged_page, foreign, own = asyncio.run(probe())
        assert anonymous != 101, "a websocket without Origin or login was accepted"
        assert page.code in (302, 401, 403) and "/login" in page.headers.get("Location", "/login")
        assert "user" not in "".join(wrong.headers.get_list("Set-Cookie"))
        assert logged_page.code == 200, cookie
        assert foreign == 403
        assert own == 101
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_on_loopback_it_serves_without_a_password(tmp_path):
    proc, port, first = _start(tmp_path)
    try:
        assert first.startswith(f"labavg dashboard: http://127.0.0.1:{port}/app (Ctrl-C stops it)")
        assert asyncio.run(_http(port, "/app")).code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
