"""Prometheus metrics of the expert service (served over HTTP by --metrics-port).

The figures of each layer request (its parts' compute, its queueing, its tokens) are recorded in a
queue and published in batches: every observe() or inc() of prometheus_client takes a lock and
costs microseconds, and a layer request has several, on the path every token waits for. A batch goes
out every FLUSH_EVERY records and before each scrape, so a scrape always sees every request served; its
histograms are BatchHistograms (one numpy call a batch), its counters one inc() a label.
"""
import collections

from prometheus_client import REGISTRY, Counter, Gauge

from moe_core.metrics import BatchHistogram, busy_fraction_gauge, register_wait_policy

FAST = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, .1, .25, 1)
FLUSH_EVERY = 256
_pending: collections.deque = collections.deque()  # appends and pops are atomic: any thread may record


class _FlushBeforeScrape:
    """Registered before the metrics below, so the registry collects it, and publishes the queue, first."""

    def describe(self):  # no metrics of its own (without it, register() would call collect())
        return []

    def collect(self):
        flush()
        return []


REGISTRY.register(_FlushBeforeScrape())

LAYER_REQUESTS = Counter("moe_expert_layer_requests_total", "Layer requests served", ["rpc"])
TOKENS = Counter("moe_expert_tokens_total", "Tokens whose routed experts were computed")
COMPUTE = BatchHistogram("moe_expert_compute_seconds", "Routed-expert compute per layer part", ("layer", "part"),
                         buckets=FAST)
QUEUED = BatchHistogram("moe_expert_queue_seconds", "Receipt to compute start", buckets=FAST)
ERRORS = Counter("moe_expert_errors_total", "Requests refused or failed, by gRPC status", ["code"])
STREAMS = Gauge("moe_expert_active_streams", "Open Exchange streams")
SHM_SESSIONS = Gauge("moe_expert_shm_sessions", "Shared-memory sessions being served")
BUSY = Counter("moe_expert_busy_seconds_total", "Time the CPU kernels were running")


busy_fraction_gauge("moe_expert_busy_fraction", "Share of wall time the CPU kernels ran, since the last read", BUSY)


def record_part(layer: int, part: int, seconds: float) -> None:
    """One part (0 immediate, 1 deferred) of a layer request computed in `seconds`."""
    _record((layer, part, seconds))


def record_request(rpc: str, tokens: int, queued_seconds: float) -> None:
    """A layer request served over `rpc` (Exchange, RunLayer, Shm): its tokens, receipt to compute start."""
    _record((rpc, tokens, queued_seconds))


def _record(item: tuple) -> None:
    _pending.append(item)
    if len(_pending) >= FLUSH_EVERY:
        flush()


def flush() -> None:
    """Publish what is pending: the histograms in one numpy call each, the counters once a label."""
    parts, requests = [], []
    while True:
        try:
            item = _pending.popleft()
        except IndexError:
            break
        (requests if isinstance(item[0], str) else parts).append(item)
    if parts:
        _, _, secs = zip(*parts)
        BUSY.inc(sum(secs))
        COMPUTE.observe_each(secs, [(layer, "deferred" if part else "immediate") for layer, part, _ in parts])
    if requests:
        rpcs, tokens, queued = zip(*requests)
        for rpc, n in collections.Counter(rpcs).items():
            LAYER_REQUESTS.labels(rpc).inc(n)
        TOKENS.inc(sum(tokens))
        QUEUED.observe_many(queued)


register_wait_policy()  # how the native waits use the CPUs (moe_core/metrics.py WaitPolicy)
