"""Greedy runs of an in-process engine against transformers' own model, for the families' equality tests."""
from __future__ import annotations

import queue

import torch

import tiny_models
from gpu_service.engine.sampling import SamplingParams
from gpu_service.engine.scheduler import Failure, Request, Scores

N_NEW = 24


def prompt_of(n: int, seed: int) -> list[int]:
    torch.manual_seed(seed)
    return torch.randint(2, tiny_models.VOCAB, (n,)).tolist()


def reference(d, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' N_NEW greedy tokens after the prompt, and its logits at every prompt position."""
    ref = tiny_models.reference_model(d)
    with torch.no_grad():
        toks = ref.generate(torch.tensor([prompt]), max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        return toks, ref(torch.tensor([prompt])).logits[0]


def submit(engine, ids, score=False, defer=0) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    engine.submit(Request(prompt_ids=list(ids), emit=q.put, max_tokens=N_NEW, sampling=SamplingParams(temperature=0),
                          ignore_eos=True, score_only=score, defer=defer))
    return q


def collect(q: queue.Queue):
    """-> the greedy tokens and the prompt tokens the prefix cache gave, or a score request's logits."""
    toks = []
    while True:
        ev = q.get(timeout=300)
        assert not isinstance(ev, Failure), ev.message
        if isinstance(ev, Scores):
            return ev.logits
        toks += ev.token_ids
        if ev.finish_reason:
            return toks, ev.cached_tokens


def deferred_both_ways(d, prompt: list[int], services_factory):
    """The prompt's N_NEW greedy tokens with defer=1 in one process and through the two services -> (in process,
    through the services, the services (still up))."""
    from harness import local_engine
    from protos import generate_pb2

    e = local_engine(d)
    try:
        local = collect(submit(e, prompt, defer=1))[0]
    finally:
        e.stop()
    s = services_factory(d)
    got = [t for c in s.stub.Generate(generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=N_NEW, ignore_eos=True, defer=1,
        sampling=generate_pb2.SamplingParams(temperature=0)), timeout=120) for t in c.token_ids]
    return local, got, s


def twice_with_a_prefix_cache(d, prompt: list[int]) -> list[tuple]:
    """The prompt's greedy run twice on an engine whose pool caches prefixes -> [(tokens, cached positions)] of each:
    the second run hits the first's full blocks."""
    from gpu_service.engine.kv_pool import KVPool
    from harness import local_engine
    from moe_core.config import load_config

    e = local_engine(d, kv_pool=KVPool(load_config(d), torch.float32, torch.device("cpu"), 64, 1 << 30))
    try:
        return [collect(submit(e, prompt)), collect(submit(e, prompt))]
    finally:
        e.stop()


def teacher_forced(model, experts, prompts: list[list[int]], feed: list[int], native: bool) -> list[torch.Tensor]:
    """The prompts prefilled one by one, then feed's tokens decoded by all of them in each step (teacher-forced) ->
    each decode step's logits; native: the model's native decode attention (else torch's)."""
    from gpu_service.model.model import Segment

    model.native_attention = native
    caches = [model.new_cache() for _ in prompts]
    for c, p in zip(caches, prompts):
        c.reserve(len(p) + len(feed))
        model.forward([Segment(c, torch.tensor(p), 0)], experts)
    return [model.forward([Segment(c, torch.tensor([tok]), len(p) + i) for c, p in zip(caches, prompts)], experts)
            for i, tok in enumerate(feed)]


def native_against_torch(model_dir, refs: dict, counted: tuple[str, ...], monkeypatch):
    """refs' 70- and 21-token prompts prefilled, then N_NEW tokens decoded by both in each step (teacher-forced), on
    the torch path and on the native kernels, the model's dense layers on torch's fp32 matmuls (the native ones round
    activations to bf16, where a one-ulp flip would hide what this compares) -> (the torch path's logits, the native
    path's, the names of the `counted` moe_kernels.attention functions in the order the native path called them)."""
    import moe_kernels.attention as kernels
    from gpu_service.experts.local import LocalExperts
    from gpu_service.model.model import Model
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config
    from moe_experts.store import load_expert_layers

    cfg, ckpt = load_config(model_dir), Checkpoint(model_dir)
    model = Model(cfg, ckpt, torch.device("cpu"), torch.float32)
    experts = LocalExperts(load_expert_layers(cfg, ckpt, "fp32", 1))
    calls: list[str] = []
    for name in counted:
        monkeypatch.setattr(kernels, name, lambda *a, f=getattr(kernels, name), n=name, **k: calls.append(n) or f(*a, **k))
    prompts, feed = [refs[70][0], refs[21][0]], prompt_of(N_NEW, 9)
    torch_path, calls[:] = teacher_forced(model, experts, prompts, feed, False), []
    return torch_path, teacher_forced(model, experts, prompts, feed, True), calls
