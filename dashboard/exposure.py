"""Who may reach the dashboard (docs/dashboard.md, Exposing it): on a loopback address only this
machine's users; on any other address only those who log in with a password (Panel's basic
auth: one the command prints, as Jupyter prints its token, or one read from a file), and only
from the origins it serves. Checked before Panel is imported, so a bad address or port is one
line, not a traceback."""

from __future__ import annotations

import errno
import hmac
import ipaddress
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from labavg.base.errors import UserError


@dataclass(frozen=True)
class Exposure:
    """Where the dashboard listens and what a client must show to use it."""

    address: str
    port: int
    loopback: bool
    password: str | None = None  # basic auth's password (any user name); None on loopback
    generated: bool = False  # the password was made here (printed once), not read from a file
    origins: list[str] = field(default_factory=list)  # host:port a browser's page may come from
    cookie_secret: str = field(default_factory=lambda: secrets.token_urlsafe(32))


def is_loopback(address: str) -> bool:
    """Whether every address `address` resolves to is a loopback one (False if it resolves to
    none)."""
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(
        ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def plan_exposure(address: str, port: int, password_file: str | None = None,
                  origins: list[str] | tuple[str, ...] = ()) -> Exposure:
    """Check the address and port (UserError naming the flag) and decide the credential and
    the origins; the port is free at the time of the check."""
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port}: not a TCP port (1 to 65535)")
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise UserError(f"--address {address!r}: not an address or host name "
                        f"({getattr(exc, 'strerror', None) or exc})") from None
    _check_free(infos[0], address, port)
    loopback = is_loopback(address)
    password = _read_password(password_file) if password_file else None
    generated = not loopback and password is None
    if generated:
        password = secrets.token_urlsafe(16)
    served = [f"localhost:{port}", f"127.0.0.1:{port}"]
    if not loopback:
        wildcard = all(ipaddress.ip_address(i[4][0].split("%")[0]).is_unspecified for i in infos)
        served += _names_of_this_machine(port) if wildcard else [f"{address}:{port}"]
    served += [o if ":" in o else f"{o}:{port}" for o in origins]
    return Exposure(address, port, loopback, password, generated, list(dict.fromkeys(served)))


def _check_free(info, address: str, port: int) -> None:
    family, kind, proto, _, where = info
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            sock.bind(where)
        except OSError as exc:
            reason = {errno.EADDRINUSE: "the port is in use (another dashboard?); choose "
                                        "another --port",
                      errno.EADDRNOTAVAIL: "not an address of this machine",
                      errno.EACCES: "permission denied (ports below 1024 need root)"}
            raise UserError(f"cannot listen on {address} port {port}: "
                            f"{reason.get(exc.errno, exc.strerror)}") from None


def _names_of_this_machine(port: int) -> list[str]:
    """host:port for this machine's names and addresses (what a browser elsewhere would use)."""
    names = {socket.gethostname(), socket.getfqdn()}
    for name in list(names):
        try:
            names.update(socket.gethostbyname_ex(name)[2])
        except OSError:
            pass
    return [f"{name}:{port}" for name in sorted(names) if name]


def _read_password(path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise UserError(f"--password-file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"--password-file {path}: binary data, expected a password on one line") from None
    if len(text) < 8 or "\n" in text:
        raise UserError(f"--password-file {path}: expected one password of 8 or more characters "
                        f"on one line")
    return text


def password_matches(given: str, expected: str) -> bool:
    """Whether `given` is the password, in a time that does not depend on where they differ
    (a plain == answers sooner the earlier they do, which lets a client guess it a character at
    a time). Bytes, because compare_digest refuses str beyond ASCII."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                               expected.encode("utf-8", "surrogatepass"))


# Failed logins allowed per client address within LOGIN_WINDOW_S; then it waits until the
# oldest of them is that old. A window, not a lock: the laptop's own user, who shares no
# address with the network's, is never shut out for longer than LOGIN_WINDOW_S.
LOGIN_LIMIT = 5
LOGIN_WINDOW_S = 60.0
_MAX_CLIENTS = 10_000  # addresses remembered at most: many clients cannot exhaust memory


def client_key(address: str) -> str:
    """Whom a failed login counts against: the IPv4 address, or the IPv6 /64 (one host
    usually holds a whole /64 and could otherwise try from a new address every time)."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address
    if ip.version == 4:
        return str(ip)
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network(f"{ip}/64", strict=False))


@dataclass
class LoginThrottle:
    """Failed logins per client address in a sliding window (dashboard.gate's login page)."""

    limit: int = LOGIN_LIMIT
    window_s: float = LOGIN_WINDOW_S
    clock: Callable[[], float] = time.monotonic
    _failures: dict[str, deque[float]] = field(default_factory=dict)

    def wait_s(self, client: str) -> float:
        """Seconds `client` must wait before its next try (0: it may try now)."""
        recent = self._recent(client)
        if len(recent) < self.limit:
            return 0.0
        return max(0.0, recent[0] + self.window_s - self.clock())

    def failed(self, client: str) -> int:
        """Record a failed login; the tries `client` has left before it must wait."""
        recent = self._recent(client)
        recent.append(self.clock())
        self._failures[client] = recent
        if len(self._failures) > _MAX_CLIENTS:
            del self._failures[next(iter(self._failures))]  # the longest remembered
        return max(0, self.limit - len(recent))

    def succeeded(self, client: str) -> None:
        self._failures.pop(client, None)

    def _recent(self, client: str) -> deque[float]:
        since = self.clock() - self.window_s
        recent = self._failures.get(client, deque())
        while recent and recent[0] <= since:
            recent.popleft()
        if not recent:
            self._failures.pop(client, None)
        return recent
