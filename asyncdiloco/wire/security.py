"""Authentication and transport security: the shared token (``authorization: Bearer``
metadata, compared in constant time by ``TokenAuthInterceptor`` before the servicer runs;
the bulk channel's ``token_matches``), TLS credentials and ``ssl`` contexts from PEM files
checked up front (``check_pem_files``), and the rule that a token goes over TLS or stays
on the loopback unless ``--insecure-trusted-network`` (``check_server_transport``,
``check_client_transport``); docs/operations.md "Authentication and TLS".
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import logging
import os
import ssl
import stat

import grpc

from asyncdiloco.errors import REASON_METADATA_KEY, ConfigError, UnauthenticatedError, require, require_file

log = logging.getLogger(__name__)


def _require_cert_and_key(tls_cert: str | None, tls_key: str | None) -> None:
    """A certificate and its private key come together (both or neither)."""
    require(
        (tls_cert is None) == (tls_key is None),
        "tls_cert/tls_key",
        (tls_cert, tls_key),
        "give both --tls-cert and --tls-key, or neither",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerSecurityConfig:
    """Shared-token authentication and TLS for the server (security.py)."""

    #: File holding the shared token (first line); every RPC must carry it. None: no token.
    token_file: str | None = None
    #: PEM server certificate chain and private key; both or neither (None: plaintext).
    tls_cert: str | None = None
    tls_key: str | None = None
    #: PEM CA bundle that client certificates must chain to; set = mutual TLS (clients
    #: without a valid certificate are refused during the handshake).
    tls_client_ca: str | None = None
    #: Serve the token over plaintext on a host beyond the loopback (a network trusted end
    #: to end); False: such a server refuses to start (``check_server_transport``).
    insecure_trusted_network: bool = False

    def __post_init__(self) -> None:
        for name in ("token_file", "tls_cert", "tls_key", "tls_client_ca"):
            require_file(getattr(self, name), name)
        _require_cert_and_key(self.tls_cert, self.tls_key)
        require(
            self.tls_client_ca is None or self.tls_cert is not None,
            "tls_client_ca",
            self.tls_client_ca,
            "mutual TLS needs the server's own --tls-cert and --tls-key too",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientSecurityConfig:
    """Token and TLS settings of a worker or other client (security.py)."""

    #: File holding the shared token the server expects (first line). None: send none.
    token_file: str | None = None
    #: PEM CA bundle to verify the server's certificate with; set = connect over TLS.
    tls_ca: str | None = None
    #: PEM client certificate and key, for a server that requires mutual TLS.
    tls_cert: str | None = None
    tls_key: str | None = None
    #: Expected name in the server's certificate when it differs from the host in the
    #: address (e.g. "localhost" when connecting to an IP); None = the address's host.
    tls_server_name: str | None = None
    #: Send the token over plaintext to a server beyond the loopback (a network trusted
    #: end to end); False: such a client refuses to connect (``check_client_transport``).
    insecure_trusted_network: bool = False

    def __post_init__(self) -> None:
        for name in ("token_file", "tls_ca", "tls_cert", "tls_key"):
            require_file(getattr(self, name), name)
        _require_cert_and_key(self.tls_cert, self.tls_key)
        require(
            self.tls_cert is None or self.tls_ca is not None,
            "tls_cert",
            self.tls_cert,
            "a client certificate is only sent over TLS: also give --tls-ca",
        )


#: The opt-in that lets a token travel over plaintext beyond the loopback.
TRUSTED_NETWORK_FLAG = "--insecure-trusted-network"


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` names this machine's loopback: ``localhost``, or an address in
    127.0.0.0/8 or ::1 (IPv6 with or without brackets). Any other name counts as beyond
    the loopback: it is not resolved here, and could resolve elsewhere later.
    """
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def check_server_transport(host: str, config: ServerSecurityConfig | None) -> None:
    """Refuse a server that would take its token over plaintext beyond the loopback.

    Args:
        host: the address the server listens on (``--host``).
        config: its security settings (None: no token, nothing to protect).
    Raises:
        ConfigError: a token, no TLS, ``host`` beyond the loopback and no
            ``insecure_trusted_network``; the message names the TLS flags and the opt-in.
    """
    if config is None or config.token_file is None or config.tls_cert is not None:
        return
    if config.insecure_trusted_network or is_loopback_host(host):
        return
    raise ConfigError(
        f"--token-file without TLS on --host {host}, which is not a loopback address: the token would cross the "
        f"network in clear, and whoever reads it can push to the model. Give --tls-cert and --tls-key (the "
        f"workers then give --tls-ca), or listen on the loopback only (--host 127.0.0.1), or, on a network "
        f"you trust end to end, add {TRUSTED_NETWORK_FLAG}"
    )


def check_client_transport(
    address: str,
    config: ClientSecurityConfig | None,
    *,
    token_flag: str = "--token-file",
    tls_flag: str = "--tls-ca",
    address_flag: str = "--server",
) -> None:
    """Refuse a client that would send its token over plaintext beyond the loopback.

    Args:
        address: the server's "HOST:PORT" (one of them, for a sharded server).
        config: the client's security settings (None: no token).
        token_flag, tls_flag, address_flag: the flags to name (the regional server's
            link to its parent has its own: --parent-token-file, --parent-tls-ca).
    Raises:
        ConfigError: a token, no TLS, a host beyond the loopback and no
            ``insecure_trusted_network``; the message names the TLS flag and the opt-in.
    """
    if config is None or config.token_file is None or config.tls_ca is not None:
        return
    host = address.strip().rpartition(":")[0] or address.strip()
    if config.insecure_trusted_network or is_loopback_host(host):
        return
    raise ConfigError(
        f"{token_flag} without TLS to {address_flag} {address.strip()}, which is not a loopback address: the token "
        f"would cross the network in clear, and whoever reads it can push to the model. Give {tls_flag} (the CA of "
        f"that server's --tls-cert), or, on a network you trust end to end, add {TRUSTED_NETWORK_FLAG}"
    )


#: Metadata key carrying the token (gRPC metadata keys are lower case).
AUTH_METADATA_KEY = "authorization"
_SCHEME = "Bearer "


def read_token(path: str) -> str:
    """The token in the first line of ``path``, without surrounding whitespace.

    Raises:
        ConfigError: the file cannot be read or holds an empty token.
    """
    try:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ConfigError(f"token file {path!r} cannot be read ({exc.strerror}); give a readable file") from None
    if not token:
        raise ConfigError(
            f"token file {path!r} holds an empty first line; write the token there "
            f"(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))' > {path}`)"
        )
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("token file %s is readable by other users; chmod 600 it", path)
    return token


def _read_bytes(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{what} {path!r} cannot be read ({exc.strerror}); give a readable PEM file") from None


# --------------------------------------------------------------- PEM checks
def check_pem_files(config: ServerSecurityConfig | ClientSecurityConfig | None) -> None:
    """Load every PEM file of ``config`` the way TLS will, so that a garbage or mismatched
    file is refused now, naming it, instead of failing later as a handshake error: each
    CA bundle (``tls_ca``, ``tls_client_ca``) must hold a certificate, ``tls_cert`` a
    certificate and ``tls_key`` the private key of that certificate.

    Raises:
        ConfigError: a file cannot be read or is not what its flag needs; the message
            names the flag, the file, the ssl library's reason and the fix.
    """
    if config is None:
        return
    for name in ("tls_ca", "tls_client_ca", "tls_cert"):
        path = getattr(config, name, None)
        if path is not None:
            _load_pem(name, path, lambda ctx, p=path: ctx.load_verify_locations(cafile=p))
    if config.tls_cert is not None and config.tls_key is not None:
        cert, key = config.tls_cert, config.tls_key
        _load_pem("tls_key", key, lambda ctx: ctx.load_cert_chain(cert, key), f" for the certificate {cert!r}")


#: What each PEM file must hold, for the error message.
_PEM_HOLDS = {
    "tls_ca": "a CA certificate",
    "tls_client_ca": "a CA certificate",
    "tls_cert": "a certificate (chain)",
    "tls_key": "the private key",
}


def _load_pem(name: str, path: str, load, what_for: str = "") -> None:
    flag = "--" + name.replace("_", "-")
    try:
        load(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "reason", None) or exc.strerror or str(exc)
        raise ConfigError(
            f"{flag} {path!r} is invalid: it does not hold {_PEM_HOLDS[name]}{what_for} in PEM form ({reason}); "
            f"give the PEM file (-----BEGIN ...-----) that matches, e.g. as written by openssl"
        ) from None


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` (empty when there is none)."""
    return () if token is None else ((AUTH_METADATA_KEY, _SCHEME + token),)


#: Methods answered without a token: the standard health checks, which probes (a
#: kubelet, grpc_health_probe, a load balancer) send without one. They reveal only
#: SERVING or NOT_SERVING. Reflection and every ParameterServer call need the token.
UNAUTHENTICATED_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses, with ``UNAUTHENTICATED``, every call whose token differs from ``token``.

    Args:
        token: the shared secret; compared in constant time.
    """

    def __init__(self, token: str) -> None:
        self._expected = (_SCHEME + token).encode()

    def _authorized(self, metadata) -> bool:
        sent = b""
        for key, value in metadata or ():
            if key == AUTH_METADATA_KEY:
                sent = value.encode() if isinstance(value, str) else value
        return hmac.compare_digest(sent, self._expected)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method in UNAUTHENTICATED_METHODS:
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        method = handler_call_details.method
        log.warning("refused %s: missing or wrong token", method)
        message = (
            f"{method}: missing or wrong token (metadata '{AUTH_METADATA_KEY}: Bearer ...'); "
            f"start the client with the server's --token-file"
        )

        def deny(request_or_iterator, context):
            context.set_trailing_metadata(((REASON_METADATA_KEY, UnauthenticatedError.reason),))
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        def deny_stream(request_or_iterator, context):
            context.set_trailing_metadata(((REASON_METADATA_KEY, UnauthenticatedError.reason),))
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - makes this a generator, as a streaming handler must be

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny_stream)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny_stream)
        return grpc.unary_unary_rpc_method_handler(deny)


def server_interceptors(config: ServerSecurityConfig | None) -> list[grpc.ServerInterceptor]:
    """The interceptors ``config`` asks for (a token check, or none)."""
    if config is None or config.token_file is None:
        return []
    return [TokenAuthInterceptor(read_token(config.token_file))]


def server_credentials(config: ServerSecurityConfig | None) -> grpc.ServerCredentials | None:
    """TLS credentials for the listening port, or None for plaintext.

    Raises:
        ConfigError: a PEM file cannot be read or does not hold what it must (``check_pem_files``).
    """
    if config is None or config.tls_cert is None:
        return None
    assert config.tls_key is not None  # ServerSecurityConfig requires tls_key with tls_cert
    check_pem_files(config)
    cert = _read_bytes(config.tls_cert, "TLS certificate")
    key = _read_bytes(config.tls_key, "TLS key")
    client_ca = _read_bytes(config.tls_client_ca, "TLS client CA") if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def client_token(config: ClientSecurityConfig | None) -> str | None:
    return None if config is None or config.token_file is None else read_token(config.token_file)


def channel_credentials(config: ClientSecurityConfig | None) -> grpc.ChannelCredentials | None:
    """TLS credentials for a channel (server verified against ``tls_ca``; a client
    certificate when given), or None for plaintext.

    Raises:
        ConfigError: a PEM file cannot be read or does not hold what it must (``check_pem_files``).
    """
    if config is None or config.tls_ca is None:
        return None
    check_pem_files(config)
    ca = _read_bytes(config.tls_ca, "TLS CA")
    cert = _read_bytes(config.tls_cert, "TLS certificate") if config.tls_cert else None
    key = _read_bytes(config.tls_key, "TLS key") if config.tls_key else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


# ---------------------------------------------------------- bulk data channel
def token_matches(sent: str, expected: str) -> bool:
    """Constant-time comparison of a token sent on the bulk channel with the server's."""
    return hmac.compare_digest(sent.encode(), expected.encode())


def server_ssl_context(config: ServerSecurityConfig | None) -> ssl.SSLContext | None:
    """The bulk channel's TLS, from the same PEM files as ``server_credentials``: the
    server certificate, and with a client CA, required client certificates (mutual TLS).
    None for plaintext.

    Raises:
        ConfigError: a PEM file cannot be loaded.
    """

    if config is None or config.tls_cert is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)
        if config.tls_client_ca:
            ctx.load_verify_locations(cafile=config.tls_client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"TLS certificate {config.tls_cert!r} / key / client CA cannot be loaded ({exc}); give readable PEM files"
        ) from None
    return ctx


def client_ssl_context(config: ClientSecurityConfig | None) -> ssl.SSLContext | None:
    """The bulk channel's TLS for a client, from the same PEM files as
    ``channel_credentials`` (server verified against ``tls_ca``, host name checked; a
    client certificate when given). None for plaintext.

    Raises:
        ConfigError: a PEM file cannot be loaded.
    """

    if config is None or config.tls_ca is None:
        return None
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=config.tls_ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if config.tls_cert:
            ctx.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"TLS CA {config.tls_ca!r} / client certificate cannot be loaded ({exc}); give readable PEM files"
        ) from None
    return ctx
