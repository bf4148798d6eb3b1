"""The dashboard's door off loopback (docs/dashboard.md, Exposing it): its login page, and one
gate in front of every other route.

Panel's basic auth compares the password with a plain ==, counts no failures, and leaves the
routes themselves to refuse an anonymous client: its autoload.js handler then awaits the None
that Bokeh's login redirect returns, and puts a traceback on the server's terminal. Here the
login compares in constant time and limits failures per client address
(dashboard.exposure.LoginThrottle), and the gate answers every anonymous request itself, before
any of Panel's or Bokeh's handlers runs: a redirect to the login page for a GET or HEAD, 403
for anything else (a websocket cannot follow a redirect).
"""

from __future__ import annotations

import math

from panel.auth import BasicAuthProvider, BasicLoginHandler
from panel.io.resources import CDN_DIST
from tornado.escape import url_escape
from tornado.httputil import HTTPServerRequest
from tornado.routing import Matcher, Rule
from tornado.web import RequestHandler, decode_signed_value

from dashboard.exposure import LoginThrottle, client_key, password_matches

LOGIN = "/login"
LOGOUT = "/logout"
# What an anonymous client may fetch: the login and logout pages, the JavaScript and styles
# they load (Bokeh's and Panel's static files, the same for everyone) and the icon.
PUBLIC = (LOGIN, LOGOUT, "/static/", "/favicon.ico")
COOKIE = "user"  # the signed cookie Panel's login sets


class PasswordAuth(BasicAuthProvider):
    """Panel's basic auth with the dashboard's login page (any user name, one password)."""

    def __init__(self, password: str, throttle: LoginThrottle | None = None) -> None:
        # Before Bokeh's constructor, which checks the login handler.
        self._handler = type("LoginHandler", (LoginHandler,),
                             {"password": password, "throttle": throttle or LoginThrottle(),
                              "_login_endpoint": LOGIN})
        super().__init__(login_endpoint=LOGIN, logout_endpoint=LOGOUT)

    @property
    def login_handler(self):
        return self._handler


class LoginHandler(BasicLoginHandler):
    """POST /login: the password compared in constant time; a client address (an IPv6 /64)
    with too many recent failures is answered 429 with the wait, on the login page, whatever
    it sends."""

    password: str
    throttle: LoginThrottle

    def get(self) -> None:
        wait = self.throttle.wait_s(client_key(self.request.remote_ip))
        if wait:
            self._page(_wait_message(wait))
        else:
            super().get()

    def post(self) -> None:
        client = client_key(self.request.remote_ip)
        wait = self.throttle.wait_s(client)
        if wait:
            return self._too_many(wait)
        if password_matches(self.get_argument("password", ""), self.password):
            self.throttle.succeeded(client)
            # Any user name will do; an empty one would set no cookie and loop to this page.
            self.set_current_user(self.get_argument("username", "") or "user")
            self.redirect(_local(self.get_cookie("next_url", "/")))
            return
        left = self.throttle.failed(client)
        if not left:
            return self._too_many(self.throttle.wait_s(client))
        tries = f"{left} {'try' if left == 1 else 'tries'}"
        self.redirect(f"{LOGIN}?error=" + url_escape(
            f"Wrong password: {tries} left before a {self.throttle.window_s:.0f} s wait"))

    def _too_many(self, wait: float) -> None:
        self.set_status(429)
        self.set_header("Retry-After", str(math.ceil(wait)))
        self._page(_wait_message(wait))

    def _page(self, message: str) -> None:
        self.write(self._login_template.render(login_endpoint=LOGIN, errormessage=message,
                                               PANEL_CDN=CDN_DIST))


def _local(url: str | None) -> str:
    """`url` if it is a path on this server, else "/": a login never sends a browser away."""
    url = url or "/"
    return url if url.startswith("/") and not url.startswith("//") and "\\" not in url else "/"


def _wait_message(wait: float) -> str:
    return (f"Too many wrong passwords from your address: wait {math.ceil(wait)} s before "
            f"the next try")


class _Anonymous(Matcher):
    """Matches a request without a valid login cookie for anything but PUBLIC."""

    def __init__(self, cookie_secret: str, max_age_days: float) -> None:
        self._secret = cookie_secret
        self._max_age_days = max_age_days

    def match(self, request: HTTPServerRequest) -> dict | None:
        path = request.path or "/"
        if any(path == p or (p.endswith("/") and path.startswith(p)) for p in PUBLIC):
            return None
        morsel = request.cookies.get(COOKIE) if request.cookies else None
        if morsel is not None and decode_signed_value(self._secret, COOKIE, morsel.value,
                                                      max_age_days=self._max_age_days):
            return None
        return {}


class _Refuse(RequestHandler):
    """Every method of an anonymous request ends in prepare(): a redirect or a 403."""

    def prepare(self) -> None:
        upgrade = self.request.headers.get("Upgrade", "").lower() == "websocket"
        if self.request.method in ("GET", "HEAD") and not upgrade:
            self.redirect(f"{LOGIN}?next=" + url_escape(self.request.path))
        else:
            self.send_error(403)

    def write_error(self, status_code: int, **kwargs) -> None:
        self.finish(f"{status_code}: log in at {LOGIN} first\n")


def install_gate(tornado_app, cookie_secret: str, max_age_days: float) -> None:
    """Put the gate before every route of a Bokeh server's Tornado application."""
    tornado_app.default_router.rules.insert(
        0, Rule(_Anonymous(cookie_secret, max_age_days), _Refuse))
