"""What a failed bind or connect means, in one line that says what to change.

Used where sockets are made (transport/sockets.py), by the launcher (launch/supervisor.py) and by
the agent on a remote host (launch/agent.py), so it imports the standard library and psutil
only (the agent runs before the host's environment is checked).
"""

from __future__ import annotations

import errno
import os
import socket

import psutil


def bind_advice(errno_: int | None, address: str, port: str | int,
                machine: str = "this machine") -> str:
    """What a failed bind of `address`:`port` means and what to change (one line)."""
    port = str(port)
    if errno_ == errno.EADDRNOTAVAIL:
        return (f"{address} is not an address of {machine} (its addresses: "
                f"{', '.join(local_addresses()) or 'none found'})")
    if errno_ == errno.EADDRINUSE:
        return f"port {port} is in use on {address}: pick another port, or 0 (any free port)"
    if errno_ == errno.EACCES:
        return f"no permission to bind port {port} on {address}: use a port above 1023, or 0"
    return os.strerror(errno_) if errno_ else "the bind failed"


def local_addresses() -> list[str]:
    """This machine's IP addresses (loopback last), as `[[hosts]] address` takes them."""
    try:
        found = [a.address.split("%")[0] for addrs in psutil.net_if_addrs().values()
                 for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
    except Exception:  # psutil missing or the interfaces unreadable: say none
        return []
    return sorted(dict.fromkeys(found), key=lambda a: (a.startswith(("127.", "::1")),
                                                        ":" in a, a))


def probe_bind(address: str, port: int = 0) -> str:
    """'' when `address`:`port` can be bound on this machine now (as servers bind, with
    SO_REUSEADDR), else the one-line reason and what to change."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((address, port))
    except socket.gaierror as e:
        return f"{address} does not resolve on this machine ({e.strerror})"
    except OSError as e:
        return bind_advice(e.errno, address, port)
    return ""


def connect_advice(error: BaseException) -> str:
    """A failed TCP connect in a few words (refused, unreachable, timed out, ...)."""
    if isinstance(error, TimeoutError):
        return "no answer (timed out: a firewall, or a host that does not route there)"
    if isinstance(error, socket.gaierror):
        return f"the name does not resolve ({error.strerror})"
    if isinstance(error, OSError) and error.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
        return f"{os.strerror(error.errno)} (no route from there)"
    if isinstance(error, OSError) and error.errno == errno.ECONNREFUSED:
        return "connection refused (nothing listens there: another machine has the address?)"
    return str(error) or type(error).__name__
