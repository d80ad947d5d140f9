"""moe_core.serving: the gRPC options both services share."""
from __future__ import annotations

import queue
import time
from concurrent import futures

import grpc
import pytest

from harness import free_port
from moe_core import serving


@pytest.fixture
def fast_keepalive(monkeypatch):
    monkeypatch.setattr(serving, "KEEPALIVE_MS", 1000)  # grpc clamps a client's ping interval to >= 1 s


@pytest.mark.slow
def test_an_idle_stream_survives_the_clients_keepalive_pings(fast_keepalive):
    """Client and server use the same keepalive policy, so a stream idle for many ping intervals (the
    shared-memory session between layers and requests) is not cut with GOAWAY "too_many_pings"."""
    def echo(requests, context):
        for r in requests:
            yield r

    server = grpc.server(futures.ThreadPoolExecutor(2), options=serving.server_options(1 << 20))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.Echo", {"Chat": grpc.stream_stream_rpc_method_handler(echo)})])
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=serving.message_options(1 << 20)) as ch:
            q: queue.Queue = queue.Queue()
            replies = ch.stream_stream("/t.Echo/Chat")(iter(q.get, None))
            q.put(b"a")
            assert next(replies) == b"a"
            time.sleep(6)  # 6 pings; grpc's default policy strikes out at the 4th
            q.put(b"b")
            assert next(replies) == b"b"
            q.put(None)
    finally:
        server.stop(0)


def test_startup_objects_leave_the_collectors_view():
    """freeze_startup_objects: what exists when a service is ready is out of the collector's generations, and what
    serving allocates afterwards is still collected (a reference cycle made later is freed by a collection)."""
    import gc
    import weakref

    started = [[i] for i in range(5000)]  # a startup's worth of container objects
    try:
        serving.freeze_startup_objects()
        assert gc.get_freeze_count() >= len(started)

        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
