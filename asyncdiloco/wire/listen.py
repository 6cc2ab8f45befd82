"""Listening on every address a host name resolves to, or on none: a client resolving
``--host localhost`` may pick any of its addresses, so each listener (gRPC port, bulk
channel, metrics endpoint) binds the port on all of them or the server refuses to start
(docs/operations.md "Server and workers on separate hosts").
"""

from __future__ import annotations

import dataclasses
import errno
import socket

from asyncdiloco.errors import ConfigError

#: Tries of a fresh port when port 0 was asked for and the port picked on the first
#: address is taken on another.
_PICK_TRIES = 8


@dataclasses.dataclass(frozen=True)
class ListenAddress:
    """One numeric address a listener binds."""

    #: socket.AF_INET or socket.AF_INET6.
    family: int
    #: The numeric address, e.g. "127.0.0.1" or "::1" (no brackets).
    host: str

    def with_port(self, port: int) -> str:
        """ "HOST:PORT", the IPv6 address in brackets ("[::1]:29500")."""
        return f"[{self.host}]:{port}" if self.family == socket.AF_INET6 else f"{self.host}:{port}"


def listen_address_of(sock: socket.socket) -> ListenAddress:
    """The address a bound socket holds."""
    return ListenAddress(sock.family, sock.getsockname()[0])


def listen_addresses(host: str) -> tuple[ListenAddress, ...]:
    """Every address ``host`` resolves to for listening (TCP), each once, in the
    resolver's order. "" is every interface (0.0.0.0 and ::, where the machine has IPv6).

    Args:
        host: a name or a numeric address (an IPv6 one with or without brackets).
    Raises:
        ConfigError: ``host`` does not resolve.
    """
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise ConfigError(
            f"--host {host!r} does not resolve ({exc.strerror or exc}); give an address of this machine, "
            f"e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
        ) from None
    out: list[ListenAddress] = []
    for family, _, _, _, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        address = ListenAddress(family, str(sockaddr[0]))
        if address not in out:
            out.append(address)
    if not out:
        raise ConfigError(f"--host {host!r} resolves to no IPv4 or IPv6 address; give an address of this machine")
    return tuple(out)


def bind_every(host: str, port: int, *, what: str, flag: str) -> list[socket.socket]:
    """One TCP socket bound to ``port`` on each address of ``host`` (not yet listening).

    With SO_REUSEADDR, as gRPC binds, so a port left in TIME_WAIT binds and a port a
    listener holds does not. An IPv6 socket is IPv6-only when ``host`` also resolves to
    an IPv4 address (that one gets its own socket). Port 0 picks one port free on
    every address. On any failure every socket bound so far is closed.

    Args:
        host: the server's ``--host``.
        port: the TCP port; 0 picks a free one.
        what: the listener, for the error ("the gRPC port", "the bulk data channel").
        flag: the flag that chose ``port`` ("--port", "--bulk-port"), for the fix.
    Returns:
        The bound sockets, in the order of ``listen_addresses``; all on one port.
    Raises:
        ConfigError: ``host`` does not resolve, or one of its addresses cannot be bound
            (port in use, or not an address of this machine); the message names the
            address and the fix.
    """
    addresses = listen_addresses(host)
    v6only = any(a.family == socket.AF_INET for a in addresses)
    for _ in range(_PICK_TRIES if port == 0 else 1):
        bound: list[socket.socket] = []
        chosen = port
        for address in addresses:
            try:
                sock = _bind_one(address, chosen, v6only)
            except OSError as exc:
                for other in bound:
                    other.close()
                if port == 0 and bound and exc.errno == errno.EADDRINUSE:
                    break  # the port picked on the first address is taken on this one: pick again
                raise _cannot_bind(host, addresses, address, chosen, exc, what, flag) from None
            bound.append(sock)
            chosen = sock.getsockname()[1]
        else:
            return bound
    raise ConfigError(
        f"cannot find one free port on every address of --host {host} ({', '.join(a.host for a in addresses)}) "
        f"for {what} in {_PICK_TRIES} tries; give {flag} a port that is free on all of them"
    )


def _bind_one(address: ListenAddress, port: int, v6only: bool) -> socket.socket:
    """A TCP socket bound to ``port`` on ``address``; closed again when the bind fails."""
    sock = socket.socket(address.family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if address.family == socket.AF_INET6 and v6only:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((address.host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _cannot_bind(
    host: str,
    addresses: tuple[ListenAddress, ...],
    address: ListenAddress,
    port: int,
    exc: OSError,
    what: str,
    flag: str,
) -> ConfigError:
    where = address.with_port(port)
    also = one = ""
    if len(addresses) > 1:
        also = (
            f" (--host {host} resolves to {', '.join(a.host for a in addresses)}, and every one of them is "
            f"served: a client may connect to any)"
        )
        one = ", or give --host one address (e.g. 127.0.0.1)"
    if exc.errno == errno.EADDRINUSE:
        return ConfigError(
            f"cannot listen on {where} for {what}: port in use (another process holds it){also}; stop that "
            f"process, or choose another {flag} (0 picks a free one){one}"
        )
    return ConfigError(
        f"cannot listen on {where} for {what} ({exc.strerror or exc}){also}: it is not an address of this "
        f"machine, or not allowed; fix --host, or choose another {flag}"
    )
