"""Malformed request bytes answered as INVALID_ARGUMENT (gRPC's default is INTERNAL, from a
deserializer exception): a server interceptor swaps in a deserializer that never raises and a
handler that turns what it could not parse into a clear status."""
from __future__ import annotations

import grpc


class Malformed:
    def __init__(self, error: Exception):
        self.error = error


def _safe(deserialize):
    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, invalid UTF-8 in a string field, ...
            return Malformed(e)
    return parse


async def parse_or_abort(message_type, data: bytes, context):
    """For a raw method (its handler gets the bytes): the message, or the call ends INVALID_ARGUMENT."""
    try:
        return message_type.FromString(data)
    except Exception as e:  # DecodeError, invalid UTF-8 in a string field, ...
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _msg(Malformed(e)))


def _msg(m: Malformed) -> str:
    return f"request could not be parsed ({type(m.error).__name__}: {m.error}); check field types and UTF-8 strings"


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, raw_methods=()):
        """raw_methods: full names ("/package.Service/Method") of stream-stream methods whose handlers take and
        give the messages' bytes, parsing what they get themselves (parse_or_abort)."""
        self.raw = frozenset(raw_methods)

    async def intercept_service(self, continuation, details):
        h = await continuation(details)
        if h is not None and details.method in self.raw:
            assert h.stream_stream, details.method
            return grpc.stream_stream_rpc_method_handler(h.stream_stream)  # no (de)serializers: bytes
        if h is None or h.request_deserializer is None:
            return h
        des, ser = _safe(h.request_deserializer), h.response_serializer
        if h.unary_unary:
            inner = h.unary_unary

            async def uu(request, context):
                if isinstance(request, Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _msg(request))
                return await inner(request, context)
            return grpc.unary_unary_rpc_method_handler(uu, des, ser)
        if h.unary_stream:
            inner = h.unary_stream

            async def us(request, context):
                if isinstance(request, Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _msg(request))
                async for item in inner(request, context):
                    yield item
            return grpc.unary_stream_rpc_method_handler(us, des, ser)
        return h  # stream-stream: raw (above); stream-unary: none in our services
