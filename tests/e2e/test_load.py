"""32 concurrent Generate streams on the default model: all complete, each equals its solo run
(greedy), nothing lost or mixed; memory returns to its baseline; disconnecting clients leave no state."""
import concurrent.futures
import time

import grpc
import pytest

from harness import ROOT, Services, greedy, status_mib
from protos import expert_pb2, expert_pb2_grpc, generate_pb2

N = 32


@pytest.mark.slow
def test_32_concurrent_streams(tmp_path):
    s = Services(ROOT / "models" / "default", tmp_path, gpu_args=("--max-batch", "32"))
    try:
        prompts = [f"def f{i}(x):\n    return x * {i}" for i in range(N)]
        solo = [greedy(s.stub, p) for p in prompts]
        base_gpu, base_exp = status_mib(s.gpu.pid), status_mib(s.expert.pid)
        for _ in range(2):  # twice: the second round must not grow memory further
            with concurrent.futures.ThreadPoolExecutor(N) as ex:
                together = list(ex.map(lambda p: greedy(s.stub, p), prompts))
            assert together == solo
        time.sleep(0.5)
        assert status_mib(s.gpu.pid) < base_gpu + 64, (base_gpu, status_mib(s.gpu.pid))
        assert status_mib(s.expert.pid) < base_exp + 64, (base_exp, status_mib(s.expert.pid))
        # clients that disconnect mid-stream leave nothing behind
        streams = [s.stub.Generate(generate_pb2.GenerateRequest(prompt=p, max_tokens=200, ignore_eos=True), timeout=60)
                   for p in prompts[:8]]
        for st in streams:
            next(st)
        for st in streams:
            st.cancel()
        deadline = time.monotonic() + 10
        while s.stub.Info(generate_pb2.ServerInfoRequest(), timeout=5).running_requests and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s.stub.Info(generate_pb2.ServerInfoRequest(), timeout=5).running_requests == 0
        with grpc.insecure_channel(f"127.0.0.1:{s.expert_port}") as ch:
            info = expert_pb2_grpc.ExpertServiceStub(ch).Info(expert_pb2.ExpertInfoRequest(), timeout=5)
            assert info.active_streams + info.shm_sessions == 1  # the engine's one exchange session, nothing else
        assert greedy(s.stub, prompts[0]) == solo[0]
    finally:
        s.stop()
