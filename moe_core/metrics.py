"""Metric helpers both services use: the HTTP endpoint, busy-fraction gauges, histograms fed in batches, the native
waits' policy."""
import logging
import threading
import time

import numpy as np
from prometheus_client import REGISTRY, Counter, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

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


class WaitPolicy:
    """How this process's native waits use the CPUs (native/runtime/contention.h), read at each scrape: while only our
    services run, a wait gives its core away between polls (fast hand-overs); while other programs use more CPU
    than a threshold it spins only while a CPU is free and otherwise sleeps, and a hand-over may pay a wake-up
    (docs/performance/decode_step.md, "Waits that yield the core while the machine is ours"). Where decode slows on a shared
    host, these say whether that is why."""

    def collect(self):
        from moe_kernels import native  # at a scrape: moe_core itself does not load the native library

        s = native.contention_stats()
        win = f"{s['window_s'] * 1e3:.0f} ms"
        yield GaugeMetricFamily("moe_cpu_shared", "1 while this process's waits treat the host as shared with other "
                                "programs (no yielding spin: spin while a CPU is free, else sleep)",
                                value=float(s["shared"]))
        yield GaugeMetricFamily("moe_foreign_cpus", f"CPU use of programs other than our services over the last "
                                f"sample window ({win}), in CPUs", value=s["foreign_cpus"])
        yield CounterMetricFamily("moe_cpu_foreign_windows", f"Sample windows ({win}) in which other programs used "
                                  f"more than {s['foreign_threshold']:g} CPUs", value=s["foreign_windows"])
        yield CounterMetricFamily("moe_cpu_shared_turns", "Times this process's waits turned from the quiet policy "
                                  "to the shared one", value=s["turned_shared"])


_wait_policy_registered = False


def register_wait_policy() -> None:
    """WaitPolicy on the default registry, once a process (both services' metrics call it; a process may hold both)."""
    global _wait_policy_registered
    if not _wait_policy_registered:
        REGISTRY.register(WaitPolicy())
        _wait_policy_registered = True


class BatchHistogram:
    """A Prometheus histogram (the same exposition as prometheus_client's Histogram) that takes a step's values at
    once: a decode step yields a few figures per layer, and prometheus_client's labels() + observe() cost ~10 us a
    value, which at 48 layers is a millisecond a token; here one numpy bucketing a call."""

    def __init__(self, name: str, doc: str, labelnames: tuple = (), buckets: tuple = (), registry=REGISTRY):
        self.name, self.doc, self.labelnames = name, doc, tuple(labelnames)
        self.bounds = np.array([*buckets, np.inf])
        self._lock = threading.Lock()
        self._names: dict[tuple, int] = {}  # label values as str -> row of the arrays below
        self._rows: dict[tuple, int] = {}   # label values as given (and as str) -> row
        self._counts = np.zeros((0, len(self.bounds)), np.int64)  # per row and bucket, not cumulative
        self._sums = np.zeros(0)
        if registry is not None:
            registry.register(self)

    def observe_many(self, values, labels: tuple = ()) -> None:
        """values (seconds, any sequence), all of the series `labels` (label values)."""
        v = np.asarray(values, dtype=np.float64)
        if v.size:
            with self._lock:
                r = self._row(labels)
                self._counts[r] += np.bincount(self._bucket(v), minlength=len(self.bounds))
                self._sums[r] += v.sum()

    def observe_each(self, values, labels) -> None:
        """values (seconds), labels: one tuple of label values per value."""
        v = np.asarray(values, dtype=np.float64)
        if v.size:
            with self._lock:
                rows = np.fromiter((self._row(k) for k in labels), np.intp, len(v))
                np.add.at(self._counts, (rows, self._bucket(v)), 1)
                np.add.at(self._sums, rows, v)

    def _bucket(self, v: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.bounds, v, side="left")  # the first bound >= v: Prometheus' le

    def _row(self, key: tuple) -> int:
        r = self._rows.get(key)
        if r is None:  # the key as given and as its str values (the exposition's) name one row
            name = tuple(str(k) for k in key)
            r = self._names.setdefault(name, len(self._names))
            self._rows[key] = self._rows[name] = r
            if r >= len(self._sums):
                n = max(8, 2 * r)
                self._counts = np.concatenate([self._counts, np.zeros((n - len(self._sums), len(self.bounds)),
                                                                      np.int64)])
                self._sums = np.concatenate([self._sums, np.zeros(n - len(self._sums))])
        return r

    def collect(self):
        h = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        with self._lock:
            series = sorted((r, k) for k, r in self._names.items())
            cum, sums = self._counts.cumsum(1), self._sums.copy()
        for r, key in series:
            h.add_metric(list(key), [(_le(b), int(n)) for b, n in zip(self.bounds, cum[r])], float(sums[r]))
        yield h

    def describe(self):
        return [HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)]


def _le(bound: float) -> str:
    return "+Inf" if bound == np.inf else repr(float(bound))


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    if port:
        start_http_server(port, addr=host)
        log.info("metrics on http://%s:%d/metrics", host, port)
