"""Each service holds only its share of the weights; the expert layer requests are validated."""
import grpc
import pytest
import torch

from moe_core.routing import split_deferred
from moe_experts.store import load_expert_layers
from gpu_service.model.model import Model
from moe_exchange import codec
from moe_core.checkpoint import Checkpoint
from moe_core.config import is_routed_expert_tensor, load_config
from protos import expert_pb2, expert_pb2_grpc


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
def test_weights_are_split(family, checkpoints):
    d = checkpoints[family]
    cfg, ckpt = load_config(d), Checkpoint(d)
    model = Model(cfg, ckpt, torch.device("cpu"), torch.float32)
    assert model.W and not any(is_routed_expert_tensor(n) for n in model.W)
    layers = load_expert_layers(cfg, ckpt, "fp32", 1)
    assert sorted(layers) == list(cfg.moe_layers)
    expert_bytes = sum(ckpt.get(n).nbytes for n in ckpt.names(is_routed_expert_tensor))
    assert sum(op.nbytes for op in layers.values()) == expert_bytes  # exactly the routed experts, nothing else


def test_split_deferred_takes_lowest_weights():
    ids = torch.tensor([[5, 1, 7, 3]], dtype=torch.int32)
    w = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
    i_ids, i_w, d_ids, d_w = split_deferred(ids, w, 2)
    assert i_ids.tolist() == [[1, 3]] and d_ids.tolist() == [[7, 5]]
    assert torch.equal(torch.cat([i_w, d_w], 1).sort().values, w.sort().values)


@pytest.fixture(scope="module")
def expert_stub(checkpoints, tmp_path_factory):
    from harness import free_port, start, wait_healthy
    port = free_port()
    p = start("expert_service", "--model", str(checkpoints["deepseek_v3"]), "--listen", f"127.0.0.1:{port}",
              "--threads", "1", "--max-tokens", "64", log=tmp_path_factory.mktemp("es") / "log")
    wait_healthy(port, p)
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield expert_pb2_grpc.ExpertServiceStub(ch)
    ch.close()
    p.terminate()
    p.wait(10)


def layer_req(T=2, H=64, k=4, layer=1, ids=None, w=None, hidden_dtype=torch.float32, defer=0):
    ids = ids if ids is not None else torch.randint(0, 16, (T, k), dtype=torch.int32)
    w = w if w is not None else torch.rand(T, k)
    return expert_pb2.LayerRequest(layer=layer, hidden=codec.encode(torch.randn(T, H).to(hidden_dtype)),
                                   topk_ids=codec.encode(ids), topk_weights=codec.encode(w), defer=defer)


def test_run_layer_matches_local_operator(expert_stub, checkpoints):
    d = checkpoints["deepseek_v3"]
    cfg, ckpt = load_config(d), Checkpoint(d)
    op = load_expert_layers(cfg, ckpt, "fp32", 1)[2]
    req = layer_req(T=5, layer=2, defer=1)
    r = expert_stub.RunLayer(req, timeout=10)
    x, ids, w = (codec.decode(t, "t") for t in (req.hidden, req.topk_ids, req.topk_weights))
    want = op.forward(x, ids, w)
    got = codec.decode(r.immediate, "i") + codec.decode(r.deferred, "d")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("req, needle", [
    (lambda: layer_req(layer=0), "not an MoE layer"),
    (lambda: layer_req(layer=99), "not an MoE layer"),
    (lambda: layer_req(H=63), "hidden size"),
    (lambda: layer_req(T=65), "exceed"),
    (lambda: layer_req(ids=torch.tensor([[0, 1, 2, 16]], dtype=torch.int32), T=1), "expert ids"),
    (lambda: layer_req(ids=torch.tensor([[0, 1, 2, -2]], dtype=torch.int32), T=1), "expert ids"),  # -1: none
    (lambda: layer_req(w=torch.tensor([[0.1, float("nan"), 0.1, 0.1]]), T=1), "non-finite"),
    (lambda: layer_req(hidden_dtype=torch.int32), "not allowed"),
    (lambda: layer_req(defer=4), "defer"),
])
def test_bad_layer_requests(expert_stub, req, needle):
    with pytest.raises(grpc.RpcError) as e:
        expert_stub.RunLayer(req(), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()
    expert_stub.RunLayer(layer_req(), timeout=10)  # still serving
