"""Metric helpers both services use: the HTTP endpoint and busy-fraction gauges."""
import logging
import time

from prometheus_client import Counter, Gauge, start_http_server

log = logging.getLogger("metrics")


def busy_fraction_gauge(name: str, doc: str, busy_seconds: Counter) -> Gauge:
    """A gauge whose value is the share of wall time `busy_seconds` grew since the previous read."""
    state = {"v": 0.0, "t": time.monotonic()}

    def read() -> float:
        v, t = busy_seconds._value.get(), time.monotonic()
        frac = (v - state["v"]) / (t - state["t"]) if t > state["t"] else 0.0
        state.update(v=v, t=t)
        return max(0.0, min(1.0, frac))

    g = Gauge(name, doc)
    g.set_function(read)
    return g


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    if port:
        start_http_server(port, addr=host)
        log.info("metrics on http://%s:%d/metrics", host, port)
