"""Metrics fed in batches against prometheus_client's own: BatchHistogram's exposition equals a Histogram's fed the
same values one by one, and the step metrics from a decode-loop record equal those from the same run's spans; the
engine records its steps' metrics a batch at a time, and every step of a request once it ends; the waits' policy is
exported as the native sampler states it, once a process."""
from __future__ import annotations

import importlib
import random
import threading
import time

import torch
from prometheus_client import REGISTRY, CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpu_service.model import native_loop
from gpu_service.engine.scheduler import record_step_metrics
from harness import local_engine
from moe_core.metrics import BatchHistogram, WaitPolicy

BUCKETS = (25e-6, 50e-6, 1e-3, 2.5e-3, .1)


def exposition(registry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_batch_histogram_exposes_what_a_histogram_does():
    rng = random.Random(3)
    ref, mine = CollectorRegistry(), CollectorRegistry()
    h = Histogram("t_seconds", "doc", ["layer", "part"], buckets=BUCKETS, registry=ref)
    b = BatchHistogram("t_seconds", "doc", ("layer", "part"), buckets=BUCKETS, registry=mine)
    plain_ref = Histogram("u_seconds", "doc", buckets=BUCKETS, registry=ref)
    plain = BatchHistogram("u_seconds", "doc", buckets=BUCKETS, registry=mine)
    for _ in range(30):  # values on the bounds too: le is inclusive
        vals = [rng.choice([rng.random() * 0.01, rng.choice(BUCKETS), 1.0]) for _ in range(rng.randrange(0, 40))]
        labels = [(rng.randrange(12), rng.choice(["immediate", "deferred"])) for _ in vals]
        for v, lab in zip(vals, labels):
            h.labels(*lab).observe(v)
            plain_ref.observe(v)
        b.observe_each(vals, labels)
        plain.observe_many(vals)
    one = (3, "immediate")
    h.labels(*one).observe(0.5)
    b.observe_many([0.5], one)
    got, want = exposition(mine), exposition(ref)
    assert len(got) > 100
    sums = [(a, b) for a, b in zip(got, want) if "_sum" in a]  # summed in another order: the last bits
    assert [a for a in got if "_sum" not in a] == [a for a in want if "_sum" not in a]
    for a, b in sums:
        assert a.rsplit(" ", 1)[0] == b.rsplit(" ", 1)[0]
        assert abs(float(a.rsplit(" ", 1)[1]) - float(b.rsplit(" ", 1)[1])) < 1e-12


def samples() -> dict:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        if fam.name in ("moe_expert_wait_seconds", "moe_exchange_overhead_seconds", "moe_remote_expert_compute_seconds",
                        "moe_expert_blocked_seconds"):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_step_metrics_from_a_record_equal_those_from_its_spans():
    g = torch.Generator().manual_seed(0)
    L, t = 5, 1_000_000_000_000
    rows = []
    # a dense first layer (attention end, its MLP's end), then MoE layers: attention end, submit end, wait end,
    # queued, compute us, expert start, expert end, the previous layer's deferred part, the shared experts' end
    a = t + 500_000
    rows.append([a, 0, 0, 0, 0, 0, 0, 0, 0, a + 300_000])
    t = a + 300_000
    for i in range(L):
        a = t + int(torch.randint(10_000, 900_000, (1,), generator=g))
        s = a + int(torch.randint(1_000, 9_000, (1,), generator=g))
        start = s + int(torch.randint(1_000, 50_000, (1,), generator=g))
        end = start + int(torch.randint(10_000, 4_000_000, (1,), generator=g))
        w = end + int(torch.randint(1_000, 80_000, (1,), generator=g))
        late = (start - 900_000, start - 100_000) if i else (0, 0)  # the previous layer's deferred part
        rows.append([a, s, w, 3, (end - start) // 1000, start, end, *late, s + 5_000 if i % 2 else 0])
        t = w
    rec = native_loop.Record(7, 1_000_000_000_000, torch.tensor(rows, dtype=torch.int64))
    deltas = []
    for how in ("spans", "record"):
        before = samples()
        if how == "spans":
            record_step_metrics([(native_loop.spans_of(rec), 0.02, None)])
        else:
            record_step_metrics([([], 0.02, [rec])])
        after = samples()
        deltas.append({k: round(v - before.get(k, 0.0), 12) for k, v in after.items() if v != before.get(k, 0.0)})
    assert deltas[0] == deltas[1]
    assert deltas[0][("moe_exchange_overhead_seconds_count", ())] == L
    assert sum(v for (n, lab), v in deltas[0].items() if n == "moe_expert_wait_seconds_count") == L
    assert deltas[0][("moe_remote_expert_compute_seconds_count", (("part", "deferred"), ("service", "expert")))] == L - 1


def test_the_engine_records_its_steps_a_batch_at_a_time(checkpoints, monkeypatch):
    from gpu_service.engine import scheduler as engine_mod
    from gpu_service.engine.scheduler import Request
    from gpu_service.engine.sampling import SamplingParams

    monkeypatch.setattr(engine_mod, "METRICS_EVERY_S", 1e9)  # only when a request ends, or idle
    def steps():
        return REGISTRY.get_sample_value("moe_step_seconds_count") or 0.0

    e = local_engine(checkpoints["qwen3_moe"])
    try:
        before, seen, done = steps(), [], threading.Event()

        def emit(ev):
            seen.append(steps())
            if ev.finish_reason:
                done.set()
        e.submit(Request(prompt_ids=[5, 9, 17], emit=emit, max_tokens=6, sampling=SamplingParams(temperature=0),
                         ignore_eos=True))
        assert done.wait(60)
        assert seen == [before] * 6  # none of its steps recorded one by one while it ran
        deadline = time.monotonic() + 10
        while steps() < before + 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert steps() == before + 6  # the prompt's step and five decodes, once it ended
    finally:
        e.stop()


def test_the_wait_policy_is_exported_as_the_native_sampler_states_it():
    """Each scrape reads native.contention_stats(); both services' metrics modules register it, once a process."""
    from moe_kernels import native

    for both in ("expert_service.metrics", "gpu_service.metrics"):  # in one process: no duplicate registration
        importlib.import_module(both)

    names = [line.split(" ")[0] for line in generate_latest(REGISTRY).decode().splitlines()
             if line.startswith("moe_cpu_") or line.startswith("moe_foreign_cpus")]
    assert sorted(names) == ["moe_cpu_foreign_windows_total", "moe_cpu_shared", "moe_cpu_shared_turns_total",
                             "moe_foreign_cpus"]
    reg = CollectorRegistry()
    reg.register(WaitPolicy())
    got = {m.name: m.samples[0].value for m in text_string_to_metric_families(generate_latest(reg).decode())}
    now = native.contention_stats()
    assert got["moe_cpu_shared"] in (0.0, 1.0)
    assert got["moe_cpu_shared_turns"] <= now["turned_shared"] and got["moe_cpu_foreign_windows"] <= now["foreign_windows"]
    assert got["moe_cpu_foreign_windows"] <= now["windows"]
