"""Authentication for both services and their clients: a shared bearer token in call metadata
(checked in constant time) and optional TLS / mutual TLS from certificate files.

Secrets come from files or the environment (MOE_AUTH_TOKEN), never from the command line, which
`ps` shows to every user. Health checks stay open so probes need no secret; everything else,
reflection included, needs the token when one is configured.

Clients of the GPU service may instead be tenants (`--tenants-file`: a name and a token per line): each client's
token names its tenant, which keeps its own namespace of the prefix cache; the shared token then stays the one the
GPU service sends its expert service.
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


def add_tenant_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("tenants (clients)")
    g.add_argument("--tenants-file", help="clients authenticate as tenants: one 'NAME TOKEN' per line ('#' comments); "
                   "their requests never share prefix-cache blocks across tenants (--prefix-cache-scope). The shared "
                   "--auth-token-file then only authenticates this service to its expert service")


def read_tenants(path: str) -> dict[str, str]:
    """token -> tenant name, from a tenants file (ValueError naming the line for anything malformed)."""
    out: dict[str, str] = {}
    for n, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[0].isprintable():
            raise ValueError(f"{path}:{n}: expected 'NAME TOKEN'")
        name, token = parts
        if token in out:
            raise ValueError(f"{path}:{n}: the token of tenant {name!r} is {out[token]!r}'s too")
        out[token] = name
    if not out:
        raise ValueError(f"{path} names no tenant")
    return out


def presented_token(authorization: str | bytes | None, api_key: str | bytes | None = None) -> str:
    """The token a caller presents: `Authorization: Bearer T`, or Anthropic's `x-api-key: T`."""
    auth = authorization.decode(errors="replace") if isinstance(authorization, bytes) else (authorization or "")
    if auth.startswith("Bearer "):
        return auth[len("Bearer "):]
    key = api_key.decode(errors="replace") if isinstance(api_key, bytes) else (api_key or "")
    return key


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
    """UNAUTHENTICATED for any call whose token (`authorization: Bearer <token>`, or `x-api-key`) `tenant_of` does not
    know (constant-time checks)."""

    def __init__(self, tenant_of):
        self._tenant_of = tenant_of

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method in OPEN_METHODS:
            return handler
        md = dict(details.invocation_metadata or ())
        if self._tenant_of(presented_token(md.get("authorization"), md.get("x-api-key"))) is not None:
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
    tenants: dict[str, str] | None = None  # token -> tenant name (--tenants-file): the clients' credentials

    def tenant_of(self, token: str) -> str | None:
        """The tenant a client's token names: its name with a tenants file, "" with the one shared token (or none
        configured); None for a wrong or missing token. Every known token is compared, in constant time."""
        if self.tenants is not None:
            found = None
            for want, name in self.tenants.items():
                if hmac.compare_digest(token.encode(), want.encode()):
                    found = name
            return found
        if self.token is None:
            return ""
        return "" if hmac.compare_digest(token.encode(), self.token.encode()) else None

    @property
    def authenticates(self) -> bool:
        return self.token is not None or self.tenants is not None

    @classmethod
    def from_args(cls, args) -> "ServerSecurity":
        token = read_token(args.auth_token_file)
        tenants = read_tenants(args.tenants_file) if getattr(args, "tenants_file", None) else None
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
            return cls(token, creds, ctx, tenants)
        elif args.tls_client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return cls(token, creds, None, tenants)

    @property
    def interceptors(self) -> list:
        return [TokenInterceptor(self.tenant_of)] if self.authenticates else []

    def warn_if_open(self, address: str) -> None:
        if not self.authenticates and not _is_loopback(address):
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
