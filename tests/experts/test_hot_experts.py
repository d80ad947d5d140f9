"""Hot experts on the GPU side (gpu-service --gpu-experts): the most-used experts of each layer computed on
this side, the rest by the expert service. fp32: greedy tokens equal the all-remote run for every family,
with and without deferral, whatever the placement and while it is swapped under load; quantized formats:
the same numbers as the expert service up to summation order; the usage counts, the placement rule and the
profile file; both services: sharded, deferred, metrics, the profile across a restart, an expert-service
restart, and the options' refusals."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from harness import Services, free_port, greedy, refused_at_start, scrape, wait_healthy
from moe_experts.kernels.native_moe import NativeMoELayer
from moe_experts.store import load_expert_layers
from gpu_service.experts.usage import ExpertUsage, choose, load_profile, save_profile
from gpu_service.experts.local import LocalExperts
from gpu_service.experts.hot import HotExperts
from gpu_service.experts.hot_layers import hot_layer
from gpu_service.model.model import Model, Segment
from moe_core.checkpoint import Checkpoint
from moe_core.config import load_config
from moe_kernels.packing import format_values, stack_rows
import tiny_models
from tiers import some

CPU = torch.device("cpu")
PROMPT = [5, 17, 30, 41, 7, 99, 3, 250, 12]


# -- usage, placement, profile ---------------------------------------------------------------------------------
def test_usage_counts_decay_by_tokens_seen():
    u = ExpertUsage([1, 3], 4, half_life_tokens=2, device=CPU)
    u.observe(1, torch.tensor([[0, 1], [0, 2]], dtype=torch.int32))
    assert u.snapshot()[0].tolist() == [2, 1, 1, 0] and u.snapshot()[1].tolist() == [0] * 4
    u.observe(1, torch.tensor([[3, 1], [3, 1]], dtype=torch.int32))  # two tokens: one half-life
    assert u.snapshot()[0].tolist() == [1, 2.5, 0.5, 2]
    u.observe(3, torch.tensor([[2, 0]], dtype=torch.int32))
    assert u.snapshot()[0].tolist() == [1, 2.5, 0.5, 2]  # a layer decays only with its own tokens


def test_choose_keeps_incumbents_within_the_margin():
    c = torch.tensor([10.0, 9.0, 8.0, 7.0, 0.0])
    assert choose(c, [], 2, 1.25) == [0, 1]
    assert choose(c, [2, 3], 2, 1.25) == [0, 2]   # 10 > 1.25 x 7 replaces 3; 9 is not > 1.25 x 8: 2 stays
    assert choose(c, [2, 3], 2, 1.0) == [0, 1]
    assert choose(c, [4], 3, 1.25) == [0, 1, 2]   # 4 is unused: filled, then 8 > 1.25 x 0 replaces it
    assert choose(c, [0, 1, 2, 3, 4], 9, 1.25) == [0, 1, 2, 3, 4]  # n >= E: every expert


def test_profile_roundtrip_and_refusals(tmp_path):
    p = str(tmp_path / "hot.json")
    assert load_profile(p, "fp", [1, 2], 4) == ({}, {})
    save_profile(p, "fp", {1: [0, 2], 2: [3, 1]}, torch.tensor([[4.0, 0, 3, 1], [0, 2, 0, 5]]), [1, 2])
    hot, counts = load_profile(p, "fp", [1, 2], 4)
    assert hot == {1: [0, 2], 2: [3, 1]} and counts[2] == [0, 2, 0, 5]
    with pytest.raises(ValueError, match="saved for the model with fingerprint fp, this one is other"):
        load_profile(p, "other", [1, 2], 4)
    with pytest.raises(ValueError, match="4 counts .* model of 8 experts"):
        load_profile(p, "fp", [1, 2], 8)
    with pytest.raises(ValueError, match="layer 2 is not an MoE layer"):
        load_profile(p, "fp", [1], 4)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="malformed"):
        load_profile(str(tmp_path / "bad.json"), "fp", [1], 4)


# -- in process: HotExperts around the experts' own operators -------------------------------------------------
def model_and_layers(d, fmt):
    cfg, ckpt = load_config(d), Checkpoint(d)
    return cfg, ckpt, Model(cfg, ckpt, CPU, torch.float32), load_expert_layers(cfg, ckpt, fmt, 1)


def hot_experts(cfg, ckpt, layers, fmt, placement):
    usage = ExpertUsage(list(cfg.moe_layers), cfg.n_routed_experts, 64, CPU)
    return HotExperts(LocalExperts(layers), usage, lambda L, ex, old: hot_layer(cfg, ckpt, L, ex, fmt, CPU, 1, old),
                      placement, CPU)


def generate(model, experts, n, defer=0, between=None):
    """Greedy tokens and every step's logits, stepping the model by hand; between(step) runs after each."""
    cache, toks, logits = model.new_cache(), [], []
    seg = Segment(cache, torch.tensor(PROMPT), 0)
    for step in range(n):
        out = model.forward([seg], experts, step=step, defer=defer)
        logits.append(out[-1])
        toks.append(int(out[-1].argmax()))
        seg = Segment(cache, torch.tensor([toks[-1]]), seg.start + seg.tokens.shape[0])
        if between is not None:
            between(step)
    return toks, torch.stack(logits)


@pytest.mark.parametrize("family", sorted(tiny_models.FAMILIES))
def test_fp32_tokens_equal_the_all_remote_run(family, checkpoints):
    """Every family, fp32: half of each layer's experts hot (a different half per layer), with and without
    deferral: the same greedy tokens, logits equal up to fp32 summation order."""
    cfg, ckpt, model, layers = model_and_layers(checkpoints[family], "fp32")
    E = cfg.n_routed_experts
    placement = {L: [e for e in range(E) if (e + i) % 2 == 0] for i, L in enumerate(cfg.moe_layers)}
    for defer in sorted({0, min(1, cfg.top_k - 1)}):
        want, want_logits = generate(model, LocalExperts(layers), 12, defer)
        hot = hot_experts(cfg, ckpt, layers, "fp32", placement)
        got, got_logits = generate(model, hot, 12, defer)
        assert got == want, (family, defer)
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
        pairs = sum(hot.usage.snapshot().sum(1).tolist())
        assert pairs == (len(PROMPT) + 11) * cfg.top_k * len(cfg.moe_layers)  # every choice counted


def test_every_expert_hot_and_none_hot(checkpoints):
    """All hot: the expert service is never asked; none hot: it gets every pair, and the answer is the same."""
    cfg, ckpt, model, layers = model_and_layers(checkpoints["qwen3_moe"], "fp32")
    want, _ = generate(model, LocalExperts(layers), 8, defer=1)

    class Counting(LocalExperts):
        asked = 0

        def submit(self, *a):
            Counting.asked += 1
            super().submit(*a)

    for hot_set, asked in ((list(range(cfg.n_routed_experts)), False), ([], True)):
        Counting.asked = 0
        usage = ExpertUsage(list(cfg.moe_layers), cfg.n_routed_experts, 64, CPU)
        hot = HotExperts(Counting(layers), usage, lambda L, ex, old: hot_layer(cfg, ckpt, L, ex, "fp32", CPU, 1, old),
                         {L: hot_set for L in cfg.moe_layers}, CPU)
        assert generate(model, hot, 8, defer=1)[0] == want
        assert (Counting.asked > 0) == asked


def test_placement_swapped_under_load(checkpoints):
    """Refreshes from another thread while tokens are generated, each moving every layer to another hot set:
    the swaps happen at step boundaries only, the tokens stay those of the all-remote run, and a refresh that
    keeps experts copies them from the old operator (not read again)."""
    cfg, ckpt, model, layers = model_and_layers(checkpoints["deepseek_v3"], "fp32")
    E = cfg.n_routed_experts
    want, _ = generate(model, LocalExperts(layers), 24, defer=2)
    hot = hot_experts(cfg, ckpt, layers, "fp32", {L: [0, 1, 2, 3] for L in cfg.moe_layers})
    built, real = [], hot.build

    def build(L, experts, old):
        built.append((L, experts, old[0] if old else None))
        return real(L, experts, old)

    hot.build = build
    installed, install = [], hot._install

    def spy(L, experts, op):
        installed.append((L, hot.step, hot.out.copy()))
        install(L, experts, op)

    hot._install = spy
    gen = torch.Generator().manual_seed(0)
    stop, swaps = threading.Event(), [0]

    def churn():
        while not stop.is_set():
            with hot.usage.lock:  # a new, random favourite set every time
                hot.usage.fresh += torch.rand(hot.usage.fresh.shape, generator=gen) * 1000
            swaps[0] += hot.refresh(4, 1.0)

    t = threading.Thread(target=churn)
    t.start()
    try:
        got, _ = generate(model, hot, 24, defer=2, between=lambda step: stop.wait(0.02))
    finally:
        stop.set()
        t.join()
    assert got == want
    assert swaps[0] > 0 and installed, "no placement was swapped during the run"
    assert all(not out for _, _, out in installed), "installed with a layer in flight"
    assert any(old is not None and set(old) & set(ex) for _, ex, old in built)
    for L in cfg.moe_layers:  # the tables agree with the hot lists
        assert [int(e) for e in (hot.table[L] >= 0).nonzero()[:, 0]] == sorted(hot.hot[L])
        assert len(hot.hot[L]) == 4 and max(hot.hot[L]) < E


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "fp8"])
def test_quantized_hot_experts_run_the_expert_services_numbers(fmt, checkpoints):
    """On the CPU the hot operator is the expert service's own kernels and format: a layer's output with a
    hot half equals the all-remote output up to summation order (every pair's product is the same)."""
    d = checkpoints["qwen3_moe"]
    cfg, ckpt = load_config(d), Checkpoint(d)
    layers = load_expert_layers(cfg, ckpt, fmt, 1)
    L = cfg.moe_layers[0]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, cfg.hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[:cfg.top_k] for _ in range(6)]).int()
    w = torch.rand(6, cfg.top_k, generator=gen)
    want = layers[L].forward(x, ids, w)
    hot = hot_experts(cfg, ckpt, layers, fmt, {M: [1, 2, 5, 6] for M in cfg.moe_layers})
    assert isinstance(hot.ops[L], NativeMoELayer) and hot.ops[L].fmt == fmt
    hot.submit(0, L, x, ids, w, 0)
    torch.testing.assert_close(hot.result(L, False), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "fp8", "int4g32", "mxfp4"])
def test_format_values_are_the_packed_weights(fmt, checkpoints):
    """What the torch operator computes with on CUDA (packing.format_values) is exactly what the native kernels
    hold for the same expert (their packed weights, unpacked by the kernel tests' reference)."""
    from moe_experts.store import expert_weights
    from moe_core.config import FP8_BLOCK
    from unpacked import dequantized

    d = checkpoints["qwen3_moe"]
    cfg, ckpt = load_config(d), Checkpoint(d)
    L, I, H = cfg.moe_layers[0], cfg.moe_intermediate_size, cfg.hidden_size
    op = load_expert_layers(cfg, ckpt, fmt, 1)[L]
    if fmt == "fp8":  # bytes widened to e4m3 values, times the block's scale (packed x 256)
        def unpack(packed, K):
            data, scale = packed[0], packed[1] / 256
            s = scale.repeat_interleave(FP8_BLOCK, 1)[:, :data.shape[1]].repeat_interleave(FP8_BLOCK, 2)
            return (data.view(torch.float8_e4m3fn).float() * s[:, :, :data.shape[2]])[..., :K]
        gu = unpack(op.gu, H)
        packed = gu[:, :I], gu[:, I:], unpack(op.dn, I)
    else:
        packed = dequantized(op)
    for e in range(cfg.n_routed_experts):
        g, u, dn = expert_weights(cfg, ckpt, L, e, fmt)
        gu = format_values(stack_rows([g, u], fmt), fmt)  # gate and up quantized as one, as the kernels pack them
        for want, got in zip(packed, (gu[:I], gu[I:], format_values(dn, fmt))):
            assert torch.equal(got, want[e]), (fmt, e)


# -- both services -------------------------------------------------------------------------------------------
def metric(port, name, **labels):
    for fam in scrape(port).values():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


@pytest.mark.slow
def test_services_hot_experts_profile_and_restarts(checkpoints, tmp_path):
    """gpu-service --gpu-experts 3 with deferral: the tokens of a run without hot experts; the metrics count
    hot and remote pairs and each layer's usage; the placement refreshes and is saved; an expert-service
    restart mid-run changes nothing; a GPU side restarted with the profile starts from it."""
    d = checkpoints["deepseek_v3"]
    for sub in ("plain", "hot", "again"):
        (tmp_path / sub).mkdir()
    plain = Services(d, tmp_path / "plain", gpu_args=("--defer", "1"))
    try:
        want = greedy(plain.stub, PROMPT, 40)
    finally:
        plain.stop()
    profile = tmp_path / "hot.json"
    port = free_port()
    s = Services(d, tmp_path / "hot", gpu_args=("--defer", "1", "--gpu-experts", "3", "--gpu-experts-refresh", "0.2",
                                                "--gpu-experts-profile", str(profile), "--metrics-port", str(port)))
    try:
        assert greedy(s.stub, PROMPT, 40) == want
        assert metric(port, "moe_expert_pairs_total", where="hot") > 0
        assert metric(port, "moe_expert_pairs_total", where="remote") > 0
        import time
        deadline = time.monotonic() + 20
        saved = None
        while time.monotonic() < deadline:  # a refresh before the first token saves a placement of no usage
            saved = json.loads(profile.read_text()) if profile.exists() else None
            if saved and all(sum(v["usage"]) > 0 for v in saved["layers"].values()):
                break
            time.sleep(0.1)
        assert sorted(saved["layers"]) == ["1", "2"] and all(len(v["hot"]) == 3 for v in saved["layers"].values())
        assert metric(port, "moe_expert_usage", layer="1", expert=str(saved["layers"]["1"]["hot"][0])) > 0
        share = metric(port, "moe_hot_experts_usage_share", layer="1")
        assert 3 / 16 < share <= 1  # the most used 3 of 16 cover more than their share
        s.expert.kill()
        s.expert.wait()
        s.expert = s.start_expert()
        assert greedy(s.stub, PROMPT, 40) == want
        assert "Traceback" not in s.logs()
    finally:
        s.stop()
    again = Services(d, tmp_path / "again", gpu_args=("--defer", "1", "--gpu-experts", "3", "--gpu-experts-refresh",
                                                      "0", "--gpu-experts-profile", str(profile)))
    try:
        assert greedy(again.stub, PROMPT, 40) == want
        assert "the profile's placement" in again.logs()
    finally:
        again.stop()


@pytest.mark.slow
def test_sharded_with_hot_experts(checkpoints, sharded):
    d = checkpoints["qwen3_moe"]
    one = sharded(d, n=2, gpu_args=("--defer", "1"))
    wait_healthy(one.gpu_port, one.gpu)
    want = greedy(one.stub, PROMPT, 24)
    one.stop()
    s = sharded(d, n=2, gpu_args=("--defer", "1", "--gpu-experts-gb", "0.0002", "--gpu-experts-refresh", "0.1"))
    wait_healthy(s.gpu_port, s.gpu)
    assert greedy(s.stub, PROMPT, 24) == want
    assert "hot experts: 2 of 8 a layer" in s.logs()  # 0.0002 GiB over 3 layers of 24 KiB experts


@pytest.mark.parametrize("args, message", some([
    (("--gpu-experts", "-1"), "--gpu-experts must be >= 0"),
    (("--gpu-experts", "2", "--gpu-experts-gb", "1"), "give one of them"),
    (("--gpu-experts", "2", "--gpu-experts-half-life", "0"), "--gpu-experts-half-life must be > 0"),
    (("--gpu-experts", "2", "--experts", "local"), "--experts local computes every routed expert"),
], fast=[(("--gpu-experts", "-1"), "--gpu-experts must be >= 0")]))
def test_bad_options_are_refused(args, message, checkpoints):
    err = refused_at_start("gpu_service", "--model", str(checkpoints["qwen3_moe"]), *args)
    assert message in err, err[-2000:]


@pytest.mark.slow
def test_a_profile_of_another_model_is_refused(checkpoints, tmp_path):
    p = tmp_path / "hot.json"
    save_profile(str(p), "another-model", {}, torch.zeros(0, 8), [])
    (tmp_path / "svc").mkdir()
    s = Services(checkpoints["qwen3_moe"], tmp_path / "svc", gpu_args=("--gpu-experts", "2", "--gpu-experts-profile",
                                                                         str(p)), gpu=False)
    try:
        s.gpu = s.start_gpu()
        assert s.gpu.wait(120) != 0
        assert "was saved for the model with fingerprint another-model" in s.logs()
    finally:
        s.stop()


def test_hot_part_computed_at_submit_agrees(checkpoints):
    """On a GPU the hot part runs at submit (overlapping the expert service), on the CPU after the remote part:
    the same tokens and logits either way."""
    cfg, ckpt, model, layers = model_and_layers(checkpoints["glm4_moe"], "fp32")
    placement = {L: [0, 5, 6, 11] for L in cfg.moe_layers}
    runs = []
    for overlap in (False, True):
        hot = hot_experts(cfg, ckpt, layers, "fp32", placement)
        hot.overlap = overlap
        runs.append(generate(model, hot, 10, defer=1))
        assert [s.name for s in hot.drain_spans()].count("hot_experts") > 0
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1])
