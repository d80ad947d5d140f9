"""Routed experts sharded over several expert services (expert-service --shard I/N, gpu-service
--experts A,B,...): the same greedy tokens as one expert service, with and without deferral; a shard
that is missing, doubled, of another split or another model refused at connect, naming it; a shard
killed mid-stream fails the request within seconds naming it, and serves again once restarted."""
from __future__ import annotations

import time

import pytest
import torch
from grpc_health.v1 import health_pb2

from harness import free_port, greedy, health, scrape, wait_for, wait_healthy
from moe_core.shards import Shard, check_coverage, owner_and_local
from protos import generate_pb2


# -- the split and its checks ----------------------------------------------------------------------
def test_round_robin_split_and_local_ids():
    ids = torch.tensor([[0, 5, 7, 2], [15, 4, 9, 10]])
    owner, local = owner_and_local(ids, 3)
    assert owner.tolist() == [[0, 2, 1, 2], [0, 1, 0, 1]]
    assert local.tolist() == [[0, 1, 2, 0], [5, 1, 3, 3]]
    assert list(Shard(1, 3).experts(16)) == [1, 4, 7, 10, 13]
    assert all(int(e) in Shard(int(o), 3).experts(16) for e, o in zip(ids.flatten(), owner.flatten()))


@pytest.mark.parametrize("text", ["2/2", "1", "a/b", "-1/2", "0/0"])
def test_bad_shard_specs_are_refused(text):
    with pytest.raises(ValueError):
        Shard.parse(text)


@pytest.mark.parametrize("shards, message", [
    ({"a": Shard(0, 2)}, "no expert service serves shard 1/2"),
    ({"a": Shard(0, 2), "b": Shard(0, 2)}, "a and b both serve shard 0/2"),
    ({"a": Shard(0, 2), "b": Shard(1, 3)}, "b serves shard 1/3, but a serves shard 0/2"),
    ({"a": Shard(0, 3), "b": Shard(2, 3)}, "shard 1/3"),
])
def test_coverage_names_what_is_wrong(shards, message):
    with pytest.raises(ValueError, match=message):
        check_coverage(shards)


def test_full_coverage_passes():
    check_coverage({"a": Shard(1, 3), "b": Shard(0, 3), "c": Shard(2, 3)})
    check_coverage({"a": Shard()})


# -- both services, sharded --------------------------------------------------------------------------
PROMPTS = [[5, 17, 30, 41, 7, 99, 3], [200, 11, 9, 45, 18, 2, 77, 81, 6, 120, 33]]


@pytest.mark.slow
@pytest.mark.parametrize("family, n, defer", [("deepseek_v3", 2, 0), ("deepseek_v3", 3, 2), ("qwen3_moe", 2, 1),
                                              ("gpt_oss", 3, 1)])
def test_sharded_tokens_equal_one_expert_service(family, n, defer, checkpoints, services_factory, sharded):
    """Greedy tokens over n shards equal one expert service's, for a batch of two prompts of different
    lengths (one step holds tokens some shards have no expert for), with deferral across shards."""
    d = checkpoints[family]
    one = services_factory(d, gpu_args=("--defer", str(defer)))
    want = [greedy(one.stub, p, 24) for p in PROMPTS]
    one.stop()
    s = sharded(d, n=n, gpu_args=("--defer", str(defer)))
    wait_healthy(s.gpu_port, s.gpu)
    got = [None, None]

    def run(i):
        got[i] = greedy(s.stub, PROMPTS[i], 24)
    import threading
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want, s.logs()
    info = s.stub.Info(generate_pb2.ServerInfoRequest(), timeout=10)
    assert info.expert_service == ",".join(f"127.0.0.1:{p}" for p in s.ports)


@pytest.mark.slow
def test_profile_lanes_and_metrics_per_shard(checkpoints, sharded):
    port = free_port()
    s = sharded(checkpoints["qwen3_moe"], n=2, gpu_args=("--metrics-port", str(port)))
    wait_healthy(s.gpu_port, s.gpu)
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=PROMPTS[0]), max_tokens=3, profile=True,
                                       ignore_eos=True, sampling=generate_pb2.SamplingParams(temperature=0))
    spans = list(s.stub.Generate(req, timeout=60))[-1].profile.spans
    assert {"expert-0", "expert-1"} <= {sp.service for sp in spans}
    waits = {sp.service for sp in spans if sp.name == "shard_wait"}
    assert waits == {"expert-0", "expert-1"}  # the GPU side's wait on each shard, beside its compute
    # the engine records a step's metrics a batch at a time (when a request ends, when idle, every 0.25 s): the
    # stream's last chunk may come before its request's steps are recorded
    def computed(m):
        return {x.labels["service"] for x in m["moe_remote_expert_compute_seconds"].samples if x.value > 0}

    wait_for(lambda: {"expert-0", "expert-1"} <= computed(scrape(port)), 10, "each shard's compute metric")
    m = scrape(port)
    assert {"expert-0", "expert-1"} <= computed(m)
    up = {x.labels["target"]: x.value for x in m["moe_expert_shard_up"].samples}
    assert up == {f"127.0.0.1:{p}": 1.0 for p in s.ports}


@pytest.mark.slow
@pytest.mark.parametrize("shards, message", [
    (("0/2",), "no expert service serves shard 1/2"),
    (("0/2", "0/2"), "both serve shard 0/2"),
    (("0/2", "1/3"), "every shard must split the experts the same way"),
])
def test_bad_shard_sets_are_refused_at_connect(shards, message, checkpoints, sharded):
    s = sharded(checkpoints["qwen3_moe"], n=2, shards=shards)
    assert s.gpu.wait(60) != 0
    assert message in s.logs() and "Traceback" not in s.logs(), s.logs()


@pytest.mark.slow
def test_a_shard_of_another_model_is_refused_naming_it(checkpoints, sharded):
    s = sharded(checkpoints["qwen3_moe"], n=2, models=[checkpoints["qwen3_moe"], checkpoints["qwen2_moe"]])
    assert s.gpu.wait(60) != 0
    assert "model mismatch" in s.logs() and f"127.0.0.1:{s.ports[1]}" in s.logs(), s.logs()


@pytest.mark.slow
def test_killed_shard_holds_the_stream_until_it_is_back(checkpoints, sharded):
    """kill -9 of one shard mid-stream: the stream waits (NOT_SERVING meanwhile) and, once that shard alone
    is restarted, goes on with the tokens of a run without the restart."""
    s = sharded(checkpoints["qwen3_moe"], n=2)
    wait_healthy(s.gpu_port, s.gpu)
    req = generate_pb2.GenerateRequest(prompt="x", max_tokens=300, ignore_eos=True,
                                       sampling=generate_pb2.SamplingParams(temperature=0))
    solo = [t for c in s.stub.Generate(req, timeout=60) for t in c.token_ids]
    stream = s.stub.Generate(req, timeout=120)
    got = list(next(stream).token_ids)
    s.experts[1].kill()
    wait_for(lambda: health(s.gpu_port) == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "gpu NOT_SERVING")
    s.experts[1].wait()
    s.experts[1] = s.start_expert(1)  # the shard alone; nothing else restarted
    got += [t for c in stream for t in c.token_ids]
    assert got == solo
    wait_for(lambda: health(s.gpu_port) == health_pb2.HealthCheckResponse.SERVING, 15, "gpu SERVING again")
    assert s.gpu.poll() is None and s.experts[0].poll() is None


@pytest.mark.slow
def test_a_shard_restarted_as_another_shard_is_not_served(checkpoints, sharded):
    """Shard 1 comes back as shard 0/2 (an operator's slip): the GPU service stays NOT_SERVING, naming it
    in its log, rather than sum one shard twice; back as 1/2, it serves again."""
    s = sharded(checkpoints["qwen3_moe"], n=2)
    wait_healthy(s.gpu_port, s.gpu)
    before = greedy(s.stub, PROMPTS[0], 24)
    s.experts[1].kill()
    s.experts[1].wait()
    s.shards[1] = "0/2"
    s.experts[1] = s.start_expert(1)
    wait_healthy(s.ports[1], s.experts[1])
    time.sleep(3)  # a few of the watcher's probes
    assert health(s.gpu_port) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert f"127.0.0.1:{s.ports[1]} now serves shard 0/2, not 1/2" in s.logs()
    s.experts[1].terminate()
    s.experts[1].wait()
    s.shards[1] = "1/2"
    s.experts[1] = s.start_expert(1)
    wait_healthy(s.ports[1], s.experts[1])
    wait_for(lambda: health(s.gpu_port) == health_pb2.HealthCheckResponse.SERVING, 15, "gpu SERVING again")
    assert greedy(s.stub, PROMPTS[0], 24) == before
