"""Process plumbing both services share: logging, uvloop, gRPC options, health and reflection,
the fingerprint metadata key, and the CLI error convention (clear message, exit code 2)."""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import gc
import logging
import os
import pathlib
import signal
import sys
import threading
from typing import Callable, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
import uvloop

from moe_core.metrics import serve_metrics

FINGERPRINT_KEY = "x-model-fingerprint"
KEEPALIVE_MS = 30_000  # both ends ping an idle connection this often (a dead peer is noticed within ~40 s)


def keepalive_options() -> list[tuple[str, int]]:
    """Keepalive for clients and servers alike. A server must accept its clients' pings: grpc's default lets
    a client ping an idle stream only every 5 minutes and answers more with GOAWAY "too_many_pings" (the
    shared-memory session, an idle stream, was cut every 90-120 s), so it allows twice our own rate."""
    return [("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.keepalive_permit_without_calls", 1),
            # on a server: the shortest interval between a client's pings it accepts (grpc's
            # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS has this name)
            ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2)]


# Client side: after the peer restarts, try again soon (gRPC's default backoff grows to 2 minutes).
RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def physical_cores() -> int:
    """Physical cores available to this process (threads per core counted once)."""
    try:
        cpus = os.sched_getaffinity(0)
        cores = set()
        for c in cpus:
            p = f"/sys/devices/system/cpu/cpu{c}/topology/"
            with open(p + "core_id") as f1, open(p + "physical_package_id") as f2:
                cores.add((f1.read().strip(), f2.read().strip()))
        return max(1, len(cores))
    except OSError:
        return max(1, (os.cpu_count() or 2) // 2)


def add_server_args(ap) -> None:
    """Flags every service has: reflection, drain, metrics, logging."""
    ap.add_argument("--reflection", action="store_true", help="enable gRPC server reflection (for grpcurl)")
    ap.add_argument("--grace", type=float, default=10.0,
                    help="on SIGTERM: seconds work in flight may take to finish before it is cancelled")
    ap.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this HTTP port (0 = off)")
    ap.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
    ap.add_argument("--log-level", default="INFO")


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


GRPC_MAX_MESSAGE = 2**31 - 1  # grpcio refuses larger message limits (OverflowError at server creation)


def message_options(max_bytes: int, max_receive: int | None = None) -> list[tuple[str, int]]:
    """Send and receive limits, never above what grpcio accepts."""
    send = min(max_bytes, GRPC_MAX_MESSAGE)
    receive = min(max_bytes if max_receive is None else max_receive, GRPC_MAX_MESSAGE)
    return [("grpc.max_send_message_length", send), ("grpc.max_receive_message_length", receive)] + keepalive_options()


def server_options(max_bytes: int, max_receive: int | None = None) -> list[tuple[str, int]]:
    """A server's options. SO_REUSEPORT off: with grpc's default a second service started on a taken port binds
    too and the kernel splits the connections between the two; it must fail to start instead."""
    return message_options(max_bytes, max_receive) + [("grpc.so_reuseport", 0)]


def add_health(server: grpc.aio.Server) -> health.aio.HealthServicer:
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    return hs


async def set_health(hs, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await hs.set(name, status)


def add_reflection(server: grpc.aio.Server, service_full_names: list[str]) -> None:
    reflection.enable_server_reflection([*service_full_names, reflection.SERVICE_NAME], server)


class Service:
    """One service's gRPC server through its life, the same for both services: it listens at once with its
    health NOT_SERVING (probes see it while the weights load), ready() makes it SERVING, stop() drains it."""

    def __init__(self, server: grpc.aio.Server, health_servicer, names: list[str]):
        self.server, self.health, self.names = server, health_servicer, names

    async def serving(self, up: bool) -> None:
        await set_health(self.health, self.names, up)

    async def stop(self, grace: float) -> None:
        """Health NOT_SERVING, then the server closes once its handlers end (at most `grace` seconds)."""
        await self.serving(False)
        await self.server.stop(grace=grace)


async def start_service(sec, listen: str, options: list, interceptors: list, servicers: list[tuple],
                        reflection: bool, metrics_port: int, metrics_host: str) -> Service:
    """Listen on `listen` with these servicers ((add_X_to_server, servicer, full service name) each), the health
    service (NOT_SERVING until Service.serving(True)), reflection if asked for, and the Prometheus endpoint.
    A port it cannot take ends the process with a clear message."""
    server = grpc.aio.server(options=options, interceptors=interceptors)
    for add, servicer, _ in servicers:
        add(servicer, server)
    names = [name for _, _, name in servicers]
    svc = Service(server, add_health(server), names)
    if reflection:
        add_reflection(server, [*names, "grpc.health.v1.Health"])
    try:
        sec.add_port(server, listen)
    except RuntimeError as e:
        fail(f"cannot listen on {listen}: {e}")
    await svc.serving(False)
    await server.start()
    serve_metrics(metrics_port, metrics_host)
    return svc


def run(main) -> None:
    """Run `main(stop)` on uvloop; SIGTERM/SIGINT set the asyncio.Event `stop`, and main drains
    and returns (exit 0). A second signal cancels it outright."""
    tune_malloc()

    async def wrapper():
        stop = asyncio.Event()
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()

        def on_signal():
            if stop.is_set():
                task.cancel()
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        try:
            await main(stop)
        except asyncio.CancelledError:
            logging.getLogger("serving").info("stopped")

    uvloop.run(wrapper())


@functools.cache
def _libc():
    """glibc, its malloc/free prototyped for pointers; None elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
KEEP_FREED = 1 << 30  # the heap's free top kept for reuse up to this (trim_heap returns it after a long context)


def tune_malloc() -> None:
    """Tensors up to 32 MiB come from the heap, and what they free stays there for the next step: as fresh
    mappings, a prefill's tensors were faulted in and unmapped page by page every layer (docs/performance/kernels.md, "Prefill's
    temporaries kept on the heap"). The heap keeps what one step used at most; trim_heap() returns it after a long
    context. Fixed values also turn glibc's dynamic adjustment off. No-op without glibc."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)  # glibc's largest
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED)


def freeze_startup_objects() -> None:
    """Move what starting left on the Python heap (modules, the model's tensors and tables: a few hundred thousand
    objects) out of the garbage collector's view: its full collections, which the per-token allocations of a
    decode trigger every so often, walk only what serving allocates since (docs/performance/decode_step.md, "The garbage
    collector at decode"). Called once, when a service is ready."""
    gc.collect()
    gc.freeze()


def advise_huge_pages(addr: int, nbytes: int) -> None:
    """Ask for transparent huge pages over the whole 2 MiB pages inside [addr, addr + nbytes) (THP in "madvise"
    mode, the usual default): before they are touched, so the faults map huge pages. Best effort: no-op without
    glibc or THP."""
    huge = 2 << 20
    start, end = -(-addr // huge) * huge, (addr + nbytes) // huge * huge
    libc = _libc()
    if libc is not None and end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 14)  # MADV_HUGEPAGE


def trim_heap() -> None:
    """Give the heap's free pages back to the OS (after a long context ended), the calling thread's own arena's top
    included: malloc_trim leaves a thread arena's top chunk mapped (glibc's mtrim shrinks the main arena's only),
    but a free there with the trim threshold at 0 returns it. No-op without glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return
    libc.malloc_trim(0)
    libc.mallopt(M_TRIM_THRESHOLD, 0)
    libc.free(libc.malloc(1 << 17))  # >= 64 KiB: a free that large tries to trim its arena
    libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED)


def mem_available() -> int:
    """Bytes of memory the kernel says new work can have (MemAvailable; a container's cgroup limit when lower)."""
    avail = None
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = pathlib.Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(pathlib.Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            avail = min(avail or 1 << 62, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail if avail is not None else 8 << 30


T = TypeVar("T")


class Stopped(Exception):
    """SIGTERM/SIGINT arrived while the service was still starting."""


async def unless_stopped(stop: asyncio.Event, work: Callable[[threading.Event], T]) -> T:
    """Run work(cancel) in a thread (loading, connecting). If `stop` is set first, set `cancel` (work
    checks it between steps and returns or raises soon), wait for it, and raise Stopped: a service
    told to stop while loading exits promptly instead of finishing the load first."""
    cancel = threading.Event()
    task = asyncio.ensure_future(asyncio.to_thread(work, cancel))
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        waiter.cancel()
        return task.result()
    cancel.set()
    with contextlib.suppress(Exception):
        await task
    raise Stopped


def fail(msg: str) -> NoReturn:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)
