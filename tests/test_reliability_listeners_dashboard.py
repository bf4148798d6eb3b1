"""The dashboard off loopback (issue 44, family 8): anonymous requests answered by one gate
without a traceback on the server's terminal, the password compared in constant time, failed
logins limited per client address, and the limit a window, not a lock."""

from __future__ import annotations

import http.client
import re
import time
import urllib.parse

import pytest

from dashboard.exposure import LoginThrottle, client_key, password_matches
from tests.test_dashboard_serve import _start

# -- constant time -----------------------------------------------------------------------------


def _fastest(compare, expected: str, *givens: str, tries: int = 15) -> list[float]:
    """The fastest of `tries` calls for each given password, interleaved (the machine is
    shared: load that comes and goes then weighs on all of them alike)."""
    best = [float("inf")] * len(givens)
    for _ in range(tries):
        for i, given in enumerate(givens):
            start = time.perf_counter()
            compare(given, expected)
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def test_the_password_is_compared_in_a_time_that_does_not_depend_on_where_it_differs():
    # A plain == stops at the first difference: 8 MiB differing at the first character
    # against the last differ in time by a factor of about a thousand; constant time, about
    # 1 (the bounds leave room for a shared machine's noise, not for an early exit).
    expected = "p" * (8 << 20)
    early, late = _fastest(password_matches, expected, "X" + expected[1:], expected[:-1] + "X")
    assert 0.2 < early / late < 5, (early, late)
    assert password_matches(expected, expected) and not password_matches("", expected)


@pytest.mark.parametrize("given", ["pässwörd-ü", "\udcff-lone-surrogate", "", "x" * 10_000])
def test_any_text_is_an_answer_not_an_error(given):
    assert password_matches(given, "the-password") is False
    assert password_matches(given, given) is True


# -- the limit on failed logins ----------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_failed_logins_make_one_address_wait_for_the_window_not_forever():
    clock = _Clock()
    throttle = LoginThrottle(limit=5, window_s=60, clock=clock)
    lefts = [throttle.failed("10.0.0.9") for _ in range(5)]
    assert lefts == [4, 3, 2, 1, 0]
    assert throttle.wait_s("10.0.0.9") == 60
    assert throttle.wait_s("127.0.0.1") == 0  # the laptop's own user is another address
    clock.now += 59.5
    assert 0 < throttle.wait_s("10.0.0.9") <= 0.5
    clock.now += 0.5
    assert throttle.wait_s("10.0.0.9") == 0  # the window has passed: tries again
    assert throttle.failed("10.0.0.9") == 4


def test_failures_spread_over_more_than_the_window_never_make_anyone_wait():
    clock = _Clock()
    throttle = LoginThrottle(limit=3, window_s=10, clock=clock)
    for _ in range(50):
        throttle.failed("10.0.0.9")
        clock.now += 5  # two failures per window at most
        assert throttle.wait_s("10.0.0.9") == 0


def test_a_success_forgets_the_failures_and_many_addresses_are_bounded():
    clock = _Clock()
    throttle = LoginThrottle(limit=2, window_s=60, clock=clock)
    throttle.failed("a")
    throttle.succeeded("a")
    assert throttle.failed("a") == 1
    for i in range(20_000):
        throttle.failed(f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}")
    assert len(throttle._failures) <= 10_000


@pytest.mark.parametrize("one, other, same", [
    ("2001:db8::1", "2001:db8::ffff:1234", True),  # one host's /64
    ("2001:db8::1", "2001:db8:0:1::1", False),
    ("::ffff:10.0.0.9", "10.0.0.9", True),  # an IPv4 client on a dual-stack socket
    ("10.0.0.9", "10.0.0.10", False),
    ("fe80::1%eth0", "fe80::2%eth1", True),
])
def test_failures_count_against_an_address_or_a_whole_ipv6_64(one, other, same):
    assert (client_key(one) == client_key(other)) is same


# -- a real server -----------------------------------------------------------------------------

# Anonymous requests: (method, path, headers). Every one must be answered by the gate or a
# public route, without a traceback: the first is the probe's (Panel awaited None).
WS = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
      "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
ANONYMOUS = [
    ("GET", "/app/autoload.js?bokeh-autoload-element=x", {}),
    ("GET", "/app/autoload.js?bokeh-autoload-element=x&bokeh-absolute-url=http://e.example/", {}),
    ("GET", "/app/autoload.js?bokeh-autoload-element=x&bokeh-session-id=abc", {}),
    ("GET", "/app/autoload.js", {"Bokeh-Session-Id": "abc"}),
    ("GET", "/app/autoload.js", {}),
    ("GET", "/app", {}), ("GET", "/app/", {}), ("GET", "/", {}),
    ("GET", "/app?bokeh-session-id=abc", {}), ("GET", "/app?bokeh-token=garbage", {}),
    ("GET", "/app/ws", {}), ("GET", "/app/ws", WS), ("GET", "/app/ws?bokeh-session-id=x", WS),
    ("GET", "/app/metadata", {}), ("GET", "/nope", {}), ("GET", "/%2e%2e/etc/passwd", {}),
    ("GET", "/components/panel/x.js", {}), ("GET", "/panel-preview/render/app", {}),
    ("GET", "/liveness", {}), ("GET", "/rest/session_info", {}), ("GET", "/app/../app", {}),
    ("GET", "/app", {"Cookie": "user=admin"}),  # not signed
    ("GET", "/app", {"Cookie": 'user="2|1:0|10:1700000000|4:user|8:YWRtaW4=|' + "0" * 64 + '"'}),
    ("GET", "/login?next=//evil.example/", {}), ("GET", "/logout", {}),
    ("GET", "/static/js/bokeh.min.js", {}), ("GET", "/static/nope.js", {}),
    ("GET", "/static/../app", {}), ("GET", "/favicon.ico", {}),
    *[(method, path, {}) for method in ("HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")
      for path in ("/app", "/app/autoload.js?bokeh-autoload-element=x", "/app/ws", "/nope")],
    ("PROPFIND", "/app", {}), ("POST", "/login", {}),
]
PUBLIC = ("/login", "/logout", "/static/", "/favicon.ico")


def _request(port: int, method: str, path: str, headers: dict[str, str] | None = None,
             body: str | None = None, source: str = "127.0.0.1") -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(source, 0))
    conn.request(method, path, body=body, headers={
        **({"Content-Type": "application/x-www-form-urlencoded"} if body else {}),
        **(headers or {})})
    response = conn.getresponse()
    response.text = response.read().decode("utf-8", "replace")
    conn.close()
    return response


def _login(port: int, password: str, source: str = "127.0.0.1"):
    return _request(port, "POST", "/login", body=urllib.parse.urlencode(
        {"username": "", "password": password}), source=source)


@pytest.mark.slow  # a real Panel server: ~20 s under load
def test_off_loopback_no_anonymous_request_reaches_a_handler_or_the_terminal(tmp_path):
    secret = tmp_path / "password"
    secret.write_text("correct-horse-battery\n")
    proc, port, _ = _start(tmp_path, "--address", "0.0.0.0", "--password-file", str(secret))
    try:
        answers = []
        for method, path, headers in ANONYMOUS:
            response = _request(port, method, path, headers)
            answers.append((method, path, response.status, response.getheader("Location")))
        # The limit: 5 wrong tries from one address, then 429 whatever it sends, the right
        # password included; another address (the laptop's own user) is not shut out.
        wrong = [_login(port, "wrong-password", source="127.0.0.2") for _ in range(6)]
        right_but_waiting = _login(port, "correct-horse-battery", source="127.0.0.2")
        login_page = _request(port, "GET", "/login", source="127.0.0.2")
        own = _login(port, "correct-horse-battery")
        cookie = "; ".join(c.split(";")[0] for c in own.headers.get_all("Set-Cookie"))
        page = _request(port, "GET", "/app", {"Cookie": cookie})
    finally:
        proc.terminate()
        terminal = proc.communicate(timeout=30)[0]
    assert len(ANONYMOUS) == 55
    for method, path, status, location in answers:
        public = any(path.startswith(p) for p in PUBLIC) and ".." not in path
        if public:
            assert status in (200, 302, 400, 404, 405), (method, path, status)
        elif status == 302:
            assert location.startswith("/login"), (method, path, location)
        else:
            assert status in (403, 405), (method, path, status)
    assert [r.status for r in wrong[:4]] == [302] * 4
    assert "1 try left" in wrong[3].getheader("Location").replace("+", " ")
    assert [r.status for r in wrong[4:]] == [429, 429]
    assert right_but_waiting.status == 429 and 55 <= int(right_but_waiting.getheader("Retry-After")) <= 60
    assert re.search(r"Too many wrong passwords from your address: wait \d+ s", login_page.text)
    assert "user=" in cookie and page.status == 200
    assert not re.search(r"Traceback|Uncaught exception|Error", terminal), terminal
