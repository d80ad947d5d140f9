"""Prometheus metrics of the expert service (served over HTTP by --metrics-port)."""
from prometheus_client import Counter, Gauge, Histogram

from moe_core.metrics import busy_fraction_gauge

FAST = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, .1, .25, 1)

LAYER_REQUESTS = Counter("moe_expert_layer_requests_total", "Layer requests served", ["rpc"])
TOKENS = Counter("moe_expert_tokens_total", "Tokens whose routed experts were computed")
COMPUTE = Histogram("moe_expert_compute_seconds", "Routed-expert compute per layer part", ["layer", "part"],
                    buckets=FAST)
QUEUED = Histogram("moe_expert_queue_seconds", "Receipt to compute start", buckets=FAST)
ERRORS = Counter("moe_expert_errors_total", "Requests refused or failed, by gRPC status", ["code"])
STREAMS = Gauge("moe_expert_active_streams", "Open Exchange streams")
SHM_SESSIONS = Gauge("moe_expert_shm_sessions", "Shared-memory sessions being served")
BUSY = Counter("moe_expert_busy_seconds_total", "Time the CPU kernels were running")


busy_fraction_gauge("moe_expert_busy_fraction", "Share of wall time the CPU kernels ran, since the last read", BUSY)
