"""Authentication for both services and their clients: a shared bearer token in call metadata
(checked in constant time) and optional TLS / mutual TLS from certificate files.

Secrets come from files or the environment (MOE_AUTH_TOKEN), never from the command line, which
`ps` shows to every user. Health checks stay open so probes need no secret; everything else,
reflection included, needs the token when one is configured.
"""
from __future__ import annotations

import argparse
import dataclasses
import hmac
import ipaddress
import logging
import os
import pathlib
import ssl

import grpc

log = logging.getLogger("security")

TOKEN_ENV = "MOE_AUTH_TOKEN"
OPEN_METHODS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")


def _read(path: str | None) -> bytes | None:
    return pathlib.Path(path).read_bytes() if path else None


def read_token(path: str | None) -> str | None:
    if path:
        tok = pathlib.Path(path).read_text().strip()
        if not tok:
            raise ValueError(f"auth token file {path} is empty")
        return tok
    return os.environ.get(TOKEN_ENV) or None


def add_server_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("security (server)")
    g.add_argument("--auth-token-file", help=f"require this shared token from callers (or set ${TOKEN_ENV})")
    g.add_argument("--tls-cert", help="serve TLS with this certificate chain (PEM)")
    g.add_argument("--tls-key", help="private key of --tls-cert (PEM)")
    g.add_argument("--tls-client-ca", help="mutual TLS: require client certificates signed by this CA (PEM)")


def add_client_args(ap: argparse.ArgumentParser, prefix: str = "", what: str = "the server") -> None:
    g = ap.add_argument_group(f"security (connecting to {what})")
    p = f"--{prefix}" if prefix else "--"
    if not prefix:
        g.add_argument("--auth-token-file", help=f"send this shared token (or set ${TOKEN_ENV})")
    g.add_argument(f"{p}tls-ca", help=f"connect to {what} over TLS, trusting this CA (PEM)")
    g.add_argument(f"{p}tls-client-cert", help="mutual TLS: client certificate chain (PEM)")
    g.add_argument(f"{p}tls-client-key", help="mutual TLS: client private key (PEM)")
    g.add_argument(f"{p}tls-server-name", help="expected name in the server's certificate (default: the host)")


@dataclasses.dataclass
class ClientSecurity:
    token: str | None = None
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str | None = None

    @classmethod
    def from_args(cls, args, prefix: str = "") -> "ClientSecurity":
        a = prefix.replace("-", "_")
        return cls(token=read_token(getattr(args, "auth_token_file", None)), ca=_read(getattr(args, f"{a}tls_ca")),
                   cert=_read(getattr(args, f"{a}tls_client_cert")), key=_read(getattr(args, f"{a}tls_client_key")),
                   server_name=getattr(args, f"{a}tls_server_name"))

    @property
    def metadata(self) -> tuple:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def _creds(self):
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def _options(self, options):
        return list(options) + ([("grpc.ssl_target_name_override", self.server_name)] if self.server_name else [])

    def channel(self, target: str, options=()) -> grpc.Channel:
        if self.ca:
            return grpc.secure_channel(target, self._creds(), self._options(options))
        return grpc.insecure_channel(target, options=list(options))

    def aio_channel(self, target: str, options=()) -> grpc.aio.Channel:
        if self.ca:
            return grpc.aio.secure_channel(target, self._creds(), self._options(options))
        return grpc.aio.insecure_channel(target, options=list(options))


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call without `authorization: Bearer <token>` (constant-time check)."""

    def __init__(self, token: str):
        self._want = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method in OPEN_METHODS:
            return handler
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._want):
            return handler
        return _denied(handler, "missing or wrong auth token (metadata 'authorization: Bearer <token>')")


def _denied(handler, msg: str):
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)
        yield  # pragma: no cover  (makes this an async generator)

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, handler.request_deserializer,
                                                    handler.response_serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(streaming, handler.request_deserializer, handler.response_serializer)


@dataclasses.dataclass
class ServerSecurity:
    token: str | None
    credentials: grpc.ServerCredentials | None
    ssl_context: ssl.SSLContext | None = None  # the same TLS settings for an HTTP listener

    @classmethod
    def from_args(cls, args) -> "ServerSecurity":
        token = read_token(args.auth_token_file)
        creds = None
        if args.tls_cert or args.tls_key:
            if not (args.tls_cert and args.tls_key):
                raise ValueError("--tls-cert and --tls-key go together")
            ca = _read(args.tls_client_ca)
            creds = grpc.ssl_server_credentials([(_read(args.tls_key), _read(args.tls_cert))], root_certificates=ca,
                                                require_client_auth=ca is not None)
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(args.tls_cert, args.tls_key)
            if ca is not None:
                ctx.verify_mode = ssl.CERT_REQUIRED
                ctx.load_verify_locations(cadata=ca.decode())
            return cls(token, creds, ctx)
        elif args.tls_client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return cls(token, creds)

    @property
    def interceptors(self) -> list:
        return [TokenInterceptor(self.token)] if self.token else []

    def warn_if_open(self, address: str) -> None:
        if not self.token and not _is_loopback(address):
            log.warning("!" * 72)
            log.warning("listening on %s WITHOUT authentication: anyone who can reach it can use it. "
                        "Set --auth-token-file (or $%s), and TLS for untrusted networks.", address, TOKEN_ENV)
            log.warning("!" * 72)

    def add_port(self, server: grpc.aio.Server, address: str) -> None:
        self.warn_if_open(address)
        if self.credentials:
            server.add_secure_port(address, self.credentials)
        else:
            server.add_insecure_port(address)


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
