"""Who may reach the dashboard (docs/dashboard.md, Exposing it): on a loopback address only this
machine's users; on any other address only those who log in with a password (Panel's basic
auth: one the command prints, as Jupyter prints its token, or one read from a file), and only
from the origins it serves. Checked before Panel is imported, so a bad address or port is one
line, not a traceback."""

from __future__ import annotations

import errno
import ipaddress
import secrets
import socket
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
