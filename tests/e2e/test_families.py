"""Both services as real processes over real gRPC: tokens and logits equal transformers' own
implementation on the same weights, for every supported family (fp32)."""
import grpc
import pytest
import torch

import tiny_models
from harness import DEVICE_ARGS, free_port, greedy, start, terminate_all, wait_healthy
from moe_exchange import codec
from protos import generate_pb2, generate_pb2_grpc
from tiers import some

N_NEW = 32


def transformers_reference(d) -> tuple[list[int], list[int], torch.Tensor]:
    """-> (a prompt, transformers' N_NEW greedy tokens after it, its logits at every prompt position)."""
    ref = tiny_models.reference_model(d)
    torch.manual_seed(1)
    prompt = torch.randint(2, tiny_models.VOCAB, (9,)).tolist()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        return prompt, want, ref(torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("family", list(tiny_models.FAMILIES))
def test_matches_transformers(family, checkpoints, services_factory):
    d = checkpoints[family]
    prompt, want, ref_logits = transformers_reference(d)
    s = services_factory(d)
    got = greedy(s.stub, prompt, N_NEW)
    assert got == want, s.logs()
    resp = s.stub.Score(generate_pb2.ScoreRequest(token_ids=generate_pb2.TokenIds(ids=prompt)), timeout=60)
    logits = codec.decode(resp.logits, "logits")
    assert logits.shape == ref_logits.shape
    assert (logits[-1] - ref_logits[-1]).abs().max().item() < 1e-4   # the first generation step
    assert (logits - ref_logits).abs().max().item() < 1e-4           # and every prompt position
    info = s.stub.Info(generate_pb2.ServerInfoRequest(), timeout=10)
    assert info.architecture == family


@pytest.fixture
def local_gpu_service(tmp_path):
    """gpu-service --experts local (the routed experts in its own process), alone."""
    procs = []

    def make(model_dir, *args):
        port = free_port()
        p = start("gpu_service", "--model", str(model_dir), "--experts", "local", "--listen", f"127.0.0.1:{port}",
                  "--threads", "1", *DEVICE_ARGS, *args, log=tmp_path / f"local{len(procs)}.log")
        procs.append(p)
        wait_healthy(port, p)
        return generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    yield make
    terminate_all(procs)


@pytest.mark.parametrize("family", some(["qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next", "deepseek_v32",
                                         "glm_moe_dsa"], fast=["deepseek_v3"]))
def test_local_experts_match_transformers(family, checkpoints, local_gpu_service):
    """--experts local: one process, the same tokens as transformers (and so as the two services)."""
    d = checkpoints[family]
    prompt, want, _ = transformers_reference(d)
    stub = local_gpu_service(d)
    assert greedy(stub, prompt, N_NEW) == want
    assert stub.Info(generate_pb2.ServerInfoRequest(), timeout=10).transport == "local"


@pytest.mark.slow
def test_local_experts_equal_the_two_services_with_deferral(checkpoints, services_factory, local_gpu_service):
    d = checkpoints["deepseek_v3"]
    prompt = list(range(3, 14))
    req = lambda stub: [t for c in stub.Generate(generate_pb2.GenerateRequest(  # noqa: E731
        token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=24, ignore_eos=True, defer=2,
        sampling=generate_pb2.SamplingParams(temperature=0)), timeout=120) for t in c.token_ids]
    assert req(local_gpu_service(d)) == req(services_factory(d).stub)
