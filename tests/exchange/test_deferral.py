"""Expert deferral through both services against a reference written on transformers' own
model: each MoE layer's `defer` lowest-weighted experts are added one MoE layer later."""
import pytest
import torch
import transformers

import tiny_models
from protos import generate_pb2
from tiers import some


def deferring_reference(model, defer, skip=False):
    """Patch every MoE experts module: return the immediate sum plus the previous MoE layer's
    deferred sum (or, with skip, drop the deferred experts); the last MoE layer defers nothing."""
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    carry = {}
    for i, mod in enumerate(experts):
        orig = mod.forward
        last = i == len(experts) - 1

        def fwd(hidden, ids, w, orig=orig, i=i, last=last):
            prev = carry.pop(i - 1, None)
            if last:
                out = orig(hidden, ids, w)
            else:
                order = torch.argsort(w, dim=1, descending=True, stable=True)
                k = ids.shape[1]
                imm, dfr = order[:, :k - defer], order[:, k - defer:]
                out = orig(hidden, ids.gather(1, imm), w.gather(1, imm))
                if not skip:
                    carry[i] = orig(hidden, ids.gather(1, dfr), w.gather(1, dfr))
            return out if prev is None else out + prev

        mod.forward = fwd
    return model


@pytest.mark.parametrize("family, defer", some([("deepseek_v3", 2), ("qwen3_moe", 1), ("glm4_moe", 2),
                                                ("minimax_m2", 1), ("gpt_oss", 1), ("qwen3_next", 1),
                                                ("qwen3_5_moe", 1)], fast=[("deepseek_v3", 2)]))
def test_deferral_matches_reference(family, defer, checkpoints, services_factory):
    d = checkpoints[family]
    ref = deferring_reference(transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(), defer)
    exact = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    prompt = torch.randint(2, tiny_models.VOCAB, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), **kw)[0, len(prompt):].tolist()
        want_exact = exact.generate(torch.tensor([prompt]), **kw)[0, len(prompt):].tolist()
    s = services_factory(d, gpu_args=("--defer", str(defer)))

    def gen(**extra):
        req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=24, ignore_eos=True,
                                           sampling=generate_pb2.SamplingParams(temperature=0), **extra)
        return [t for c in s.stub.Generate(req, timeout=120) for t in c.token_ids]

    assert gen() == want                 # the server's --defer
    assert gen(defer=0) == want_exact    # per-request override back to exact
    assert want != want_exact            # deferral really changed something on this model


@pytest.mark.slow
def test_skip_mode_matches_reference(checkpoints, services_factory):
    d = checkpoints["deepseek_v3"]
    ref = deferring_reference(transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(), 2,
                              skip=True)
    prompt = torch.randint(2, tiny_models.VOCAB, (12,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0]
    s = services_factory(d)
    from moe_exchange import codec
    resp = s.stub.Score(generate_pb2.ScoreRequest(token_ids=generate_pb2.TokenIds(ids=prompt), defer=2,
                                                  skip_deferred=True), timeout=60)
    assert (codec.decode(resp.logits, "logits") - want).abs().max().item() < 1e-4
    deferred = s.stub.Score(generate_pb2.ScoreRequest(token_ids=generate_pb2.TokenIds(ids=prompt), defer=2),
                            timeout=60)
    assert (codec.decode(deferred.logits, "logits") - want).abs().max().item() > 1e-3  # a different thing


@pytest.mark.parametrize("dtype", some([torch.bfloat16, torch.float32], fast=[torch.bfloat16]))  # native part / torch
def test_exchange_sends_immediate_while_deferred_experts_run(dtype, tmp_path, services_factory):
    """The IMMEDIATE sum of a layer reaches the caller before the expert service has finished the
    layer's DEFERRED experts (the caller's next layer overlaps them)."""
    import time

    import grpc

    from moe_exchange import codec
    from protos import expert_pb2, expert_pb2_grpc

    # wide experts on a narrow model: the deferred part computes for tens of milliseconds (a few on AMX)
    # while the immediate sum is a 128-256 KiB message
    d = tiny_models.build("deepseek_v3", tmp_path / "m", dtype=dtype, moe_intermediate_size=2048)
    s = services_factory(d, gpu=False)
    T, E, k = 1024, 16, 4
    g = torch.Generator().manual_seed(0)
    req = expert_pb2.LayerRequest(  # one immediate expert per token, three deferred: the deferred part is long
        layer=1, defer=3, hidden=codec.encode(torch.randn(T, 64, generator=g).to(dtype)),
        topk_ids=codec.encode(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()),
        topk_weights=codec.encode(torch.rand(T, k, generator=g)))
    with grpc.insecure_channel(f"127.0.0.1:{s.expert_port}") as ch:
        arrived = {}
        for r in expert_pb2_grpc.ExpertServiceStub(ch).Exchange(iter([req]), timeout=60):
            arrived[r.part] = (time.time_ns(), r.timing)
    assert set(arrived) == {expert_pb2.IMMEDIATE, expert_pb2.DEFERRED}
    deferred = arrived[expert_pb2.DEFERRED][1]
    assert deferred.end_unix_ns - deferred.start_unix_ns > 1_000_000  # long enough to tell the order apart
    assert arrived[expert_pb2.IMMEDIATE][0] < deferred.end_unix_ns
