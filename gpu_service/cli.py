"""gpu-service: attention, router, shared experts and sampling of an MoE checkpoint; routed
experts on an expert service. Serves the public GenerateService over gRPC."""
from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import time

import torch

from moe_core import security, serving
from moe_core.edge import MalformedRequestInterceptor
from moe_core import gguf_model
from moe_core.config import ModelConfigError, load_config
from moe_core.fingerprint import fingerprint
from moe_kernels.formats import NAMES as WEIGHT_FORMATS
from protos import generate_pb2, generate_pb2_grpc

from moe_exchange.dispatch import ExpertServiceError, RemoteExperts
from gpu_service.engine.scheduler import Engine
from gpu_service.experts.connection import connect_remote, in_shard_order, load_local
from gpu_service.experts.health import ExpertHealth
from gpu_service.experts.local import LocalExperts
from gpu_service import metrics
from gpu_service.experts import hot, gpu_prefill
from gpu_service.model.model import DTYPES, Model, compute_dtype, dense_format, pick_device
from gpu_service.api.reasoning import PARSERS as REASONING_PARSERS
from gpu_service.engine.kv_pool import BLOCK, KVPool, pool_block_bytes, window_pool_blocks
from gpu_service.model.compressed_attention import state_bytes
from gpu_service.api.tool_formats import PARSERS as TOOL_PARSERS
from gpu_service.api.grpc_api import GenerateServicer, prompt_bytes_limit
from gpu_service.api.text import TextCodec
from moe_experts.packed_cache import default_dir
from moe_kernels import native
from moe_experts.kernels import kernel_path

log = logging.getLogger("gpu_service")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="gpu-service", description=__doc__,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json), "
                    "or a GGUF file (the first of a split set; README: GGUF files)")
    ap.add_argument("--experts", default="127.0.0.1:50061",
                    help="host:port of the expert service; or, for routed experts sharded over several expert "
                         "services (expert-service --shard I/N), all of them, comma-separated, in any order: at "
                         "connect they must cover every shard exactly once and serve the same model; or 'local': "
                         "the routed experts in this process, on the same native thread pool (one CPU-only host, "
                         "no second service; --weight-format and --cache-dir as the expert service's)")
    ap.add_argument("--weight-format", default="auto",
                    choices=["auto", "bf16", "fp16", "fp32", *WEIGHT_FORMATS[1:], gguf_model.PER_MATRIX],
                    help="--experts local: the routed experts' format (as expert-service --weight-format)")
    ap.add_argument("--cache-dir", default=None,
                    help="--experts local: the packed-weight cache (as expert-service --cache-dir; default the same)")
    ap.add_argument("--listen", default="127.0.0.1:50051", help="host:port to serve GenerateService on")
    ap.add_argument("--http-listen", default="",
                    help="host:port to serve the OpenAI-compatible HTTP API on (/v1/models, /v1/completions, "
                         "/v1/chat/completions, /health), beside the gRPC API and on the same engine; empty = off. "
                         "Same auth token (Authorization: Bearer) and TLS settings as gRPC")
    ap.add_argument("--served-model-name", default="",
                    help="the model id the HTTP API lists and accepts (default: the --model folder's name)")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                    help="compute dtype; auto = the checkpoint's dtype, but fp32 on a CPU without bf16 arithmetic "
                         "(AVX2 and older: torch's bf16 ops are several times slower there)")
    ap.add_argument("--dense-format", default="auto", choices=["auto", "torch", "bf16", "int8", "int4", "fp8"],
                    help="on the CPU: attention projections, dense MLPs, shared experts and lm_head run on the native "
                         "kernels with weights packed in this format (int8/int4: quantized at load, like the experts; "
                         "fp8: an FP8 checkpoint's FP8 weights kept as published, its others bf16); torch = torch's "
                         "own matmuls. auto = bf16 for a bf16 checkpoint (fp8 for an FP8 one) when this CPU has a "
                         "SIMD kernel path and --dtype is auto or bf16, else torch (an explicit --dtype fp32 stays "
                         "exact); on CUDA always torch")
    ap.add_argument("--cuda-graphs", default="auto", choices=["auto", "off"],
                    help="on CUDA, decode steps as captured graphs, one per segment between two expert exchanges and "
                         "per bucket of batch size and context length (auto: where the model's layers allow: full "
                         "attention, no sinks); off = torch's ops one by one")
    ap.add_argument("--cuda-graphs-capture", type=int, default=1024, metavar="POSITIONS",
                    help="with --cuda-graphs: at start-up, capture the graphs of every batch bucket up to --max-batch "
                         "and every context bucket up to this many positions (with --defer's deferral), so that no "
                         "step in them pauses to capture; later buckets are captured by their first step; 0 = none")
    ap.add_argument("--max-batch", type=int, default=8, help="most sequences decoded together in one step")
    ap.add_argument("--max-context", type=int, default=0,
                    help="context limit in tokens (prompt + completion); 0 = the model's max_position_embeddings")
    ap.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask for")
    ap.add_argument("--max-step-tokens", type=int, default=2048,
                    help="token budget of one engine step (vLLM's max_num_batched_tokens): running decodes first, "
                         "then prompts in chunks of what is left; also capped by the expert service's --max-tokens")
    ap.add_argument("--defer", type=int, default=0,
                    help="expert deferral: per token, this many lowest-weighted experts are merged one layer later (0 = exact)")
    ap.add_argument("--threads", type=int, default=serving.physical_cores(), help="CPU threads for torch on this side; on one host with the expert service both default to every "
                         "core, which is fine: they compute in turn and neither spins while the other needs the "
                         "cores (see expert-service --threads)")
    ap.add_argument("--transport", default="auto", choices=["grpc", "shm", "auto"],
                    help="data path to the expert service: gRPC bytes, shared memory (same host only), or auto = "
                         "shared memory when the expert service can map it, else gRPC")
    ap.add_argument("--shm-mb", type=int, default=64,
                    help="size of the shared-memory region; layer requests that do not fit a quarter of it go over gRPC")
    ap.add_argument("--connect-timeout", type=float, default=120.0,
                    help="seconds to wait at start for an expert service that does not answer; one that answers "
                         "and is still loading its experts (minutes, cold, for a large model) is waited for")
    ap.add_argument("--expert-timeout", type=float, default=30.0,
                    help="seconds one layer's expert results may take (plus 10 ms per token in the step) before the "
                         "expert service counts as stuck: its requests end with UNAVAILABLE and the next ones "
                         "reconnect")
    ap.add_argument("--expert-wait", type=float, default=120.0,
                    help="seconds to hold requests, running and new, while the expert service is unreachable "
                         "(restarting, loading, crashed): they resume where they stopped, with the same tokens, "
                         "once it is back serving the same model, shard, weight format and kernel path; after "
                         "that, they fail with UNAVAILABLE. 0 = fail at once (and refuse new requests while it "
                         "is down). A client's own deadline always wins")
    ap.add_argument("--reasoning-parser", default="auto", choices=list(REASONING_PARSERS),
                    help="chat answers of reasoning models: think = <think>...</think> goes to reasoning_content "
                         "(gRPC: GenerateChunk.reasoning), apart from the answer; harmony = gpt-oss's analysis "
                         "channel; none = all in the text; auto = harmony or think when the checkpoint's chat "
                         "template or vocabulary shows them")
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="GiB of the paged KV cache's pool (gpu_service/engine/kv_pool.py), shared by every request; when it "
                         "is full, requests wait or are set aside and resume later, never failed; default: room for "
                         "--max-batch requests of --max-context tokens, at most 25%% of the host's available memory "
                         "(the pool's untouched pages cost nothing there; it touches its first 512 blocks, those "
                         "every request uses first, when it starts) or 80%% of the GPU's free memory after "
                         "loading. --max-context is lowered to what the pool holds unless given")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16", "int8", "fp8"],
                    help="the KV cache's element type; auto = the compute dtype (--dtype). fp16 halves an fp32 "
                         "model's cache (--dtype auto on a CPU without bf16 arithmetic), and with it the bytes decode "
                         "attention reads a token, as llama.cpp's default f16 cache does; not bit-exact to an fp32 "
                         "reference (docs/performance/decode_step.md, 'The KV cache in fp16'). int8 and fp8 (e4m3) "
                         "store each position's row of each KV head (MLA: its latent, its rotary key) as 8-bit codes "
                         "and a power-of-two scale, ~1.95-1.99x the positions of a bf16 cache in the same bytes, read "
                         "in place by the native decode kernels (docs/performance/kv_cache.md)")
    ap.add_argument("--prefix-cache-gb", type=float, default=None,
                    help="most GiB of KV blocks that no request uses kept for reuse, so that a request starting with "
                         "the same tokens (a chat's next turn, a shared system prompt) computes only the rest "
                         "(gpu_service/engine/prefix_cache.py); least recently used dropped first; 0 = off; default: all of "
                         "the pool (a cached block is evicted as soon as a request needs the room)")
    ap.add_argument("--prefix-cache-scope", choices=("tenant", "global"), default="tenant",
                    help="tenant: each tenant (--tenants-file) caches prefixes in its own namespace, so no client learns "
                         "from a hit what another sent; global: tenants share cached blocks. Requests share blocks only "
                         "with the same cache_salt either way")
    ap.add_argument("--prefix-cache-host-gb", type=float, default=0,
                    help="CUDA: GiB of pinned host memory that evicted cached KV blocks spill to and come back from "
                         "by copy (gpu_service/engine/kv_pool.py); 0 = none. On the CPU path the pool is host memory already: "
                         "raise --kv-cache-gb instead")
    ap.add_argument("--tool-call-parser", default="auto", choices=list(TOOL_PARSERS),
                    help="the syntax the model writes tool calls in: hermes (Qwen2/Qwen3), deepseek_v3 (V3, R1), "
                         "deepseek_v31 (V3.1), deepseek_v32 (V3.2's DSML), glm45 (GLM-4.5/4.6), glm47 (GLM-4.7, GLM-5), "
                         "minimax_m2, kimi_k2, harmony (gpt-oss); auto = the one "
                         "the checkpoint's chat template writes; none = chat requests with tools are refused")
    hot.add_args(ap)
    gpu_prefill.add_args(ap)
    serving.add_server_args(ap)
    security.add_server_args(ap)
    security.add_tenant_args(ap)
    security.add_client_args(ap, prefix="experts-", what="the expert service (the auth token is the same one)")
    return ap.parse_args(argv)


def check_args(args, cfg) -> tuple[torch.device, torch.dtype, torch.dtype, str | None, list[str]]:
    """Every setting checked before a server starts (serving.fail names the bad one) -> (device, compute dtype, KV
    cache dtype, dense weight format or None, expert service targets (["local"] for --experts local))."""
    if not 0 <= args.defer < cfg.top_k:
        serving.fail(f"--defer must be in [0, top_k - 1 = {cfg.top_k - 1}]")
    if args.max_step_tokens < args.max_batch:
        serving.fail(f"--max-step-tokens {args.max_step_tokens} must be >= --max-batch {args.max_batch} "
                     "(every running decode takes one token of each step)")
    if args.cuda_graphs_capture < 0:
        serving.fail(f"--cuda-graphs-capture must be >= 0 positions, got {args.cuda_graphs_capture}")
    if not args.expert_timeout > 0:
        serving.fail(f"--expert-timeout must be > 0, got {args.expert_timeout}")
    if args.prefix_cache_gb is not None and not 0 <= args.prefix_cache_gb < float("inf"):
        serving.fail(f"--prefix-cache-gb must be a number >= 0, got {args.prefix_cache_gb}")
    if args.kv_cache_gb is not None and not 0 < args.kv_cache_gb < float("inf"):
        serving.fail(f"--kv-cache-gb must be a number > 0, got {args.kv_cache_gb}")
    if not 0 <= args.prefix_cache_host_gb < float("inf"):
        serving.fail(f"--prefix-cache-host-gb must be a number >= 0, got {args.prefix_cache_host_gb}")
    if not 0 <= args.expert_wait < float("inf"):
        serving.fail(f"--expert-wait must be a number of seconds >= 0, got {args.expert_wait}")
    targets = [t.strip() for t in args.experts.split(",") if t.strip()]
    if not targets or len(set(targets)) != len(targets) or ("local" in targets and len(targets) > 1):
        serving.fail(f"--experts {args.experts!r}: 'local', or one or more distinct host:port, comma-separated")
    bad = hot.check_args(args, targets == ["local"]) or gpu_prefill.check_args(args, targets)
    if bad:
        serving.fail(bad)
    try:
        device = pick_device(args.device)
        dtype = compute_dtype(args.dtype, cfg, device)
        dense = dense_format(args.dense_format, device, DTYPES[cfg.torch_dtype], args.dtype, cfg.fp8_block)
    except ValueError as e:
        serving.fail(str(e))
    if args.prefix_cache_host_gb and device.type != "cuda":
        serving.fail(f"--prefix-cache-host-gb: a host tier is for a KV pool on CUDA; on {device} the pool is host memory "
                     "already (raise --kv-cache-gb and --prefix-cache-gb instead)")
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else KV_DTYPES.get(args.kv_cache_dtype) or DTYPES[args.kv_cache_dtype]
    return device, dtype, kv_dtype, dense, targets


KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}  # --kv-cache-dtype's 8-bit rows (moe_kernels/kv_quant.py)


def kv_pool(args, cfg, device: torch.device, dtype: torch.dtype, max_context: int,
            compute: torch.dtype = torch.float32) -> tuple[KVPool, int]:
    """--kv-cache-gb and --prefix-cache-gb resolved, after loading (CUDA's free memory is known then) -> (the pool
    of `dtype` elements, the context limit it holds: --max-context, or without it what the pool holds if less).
    compute: the model's dtype (DeepSeek-V4's window states hold its keys in it)."""
    per_block, ring_block = pool_block_bytes(cfg, dtype)  # (window layers: their own pool, kv_pool.py)
    ring = window_pool_blocks(cfg, args.max_batch, args.max_step_tokens, args.prefix_cache_gb != 0) \
        if ring_block else 0
    want = args.max_batch * -(-max_context // BLOCK) * per_block + ring * ring_block
    if args.kv_cache_gb is not None:
        budget = args.kv_cache_gb * 2**30
    elif device.type == "cuda":
        budget = min(want, 0.8 * torch.cuda.mem_get_info(device)[0])
    else:
        budget = min(want, 0.25 * serving.mem_available())
    blocks = max(1, int((budget - ring * ring_block) // per_block)) if per_block else -(-max_context // BLOCK)
    if blocks * BLOCK < max_context:
        if args.max_context:
            serving.fail(f"--max-context {max_context} needs {-(-max_context // BLOCK) * per_block / 2**20:.1f} MiB of "
                         f"KV cache; the pool has {blocks * per_block / 2**20:.1f} MiB"
                         + (f" beside the window layers' {ring * ring_block / 2**20:.1f} MiB" if ring else "")
                         + ": raise --kv-cache-gb or lower --max-context")
        log.warning("the KV pool (%.2f GiB) holds %d tokens: the context limit is lowered to that from %d "
                    "(--kv-cache-gb, --max-context)", blocks * per_block / 2**30, blocks * BLOCK, max_context)
        max_context = blocks * BLOCK
    prefix = blocks * per_block if args.prefix_cache_gb is None else min(int(args.prefix_cache_gb * 2**30),
                                                                            blocks * per_block)
    log.info("KV pool: %d blocks of %d tokens (%s, %.1f KiB a token, %.2f GiB, %.1f requests of %d tokens), prefix "
             "cache up to %.2f GiB", blocks, BLOCK, str(dtype).replace("torch.", ""), per_block / BLOCK / 1024,
             blocks * per_block / 2**30, blocks * BLOCK / max_context, max_context, prefix / 2**30)
    if ring:
        log.info("window layers' pool: %d blocks (%.1f KiB a token, %.2f GiB): each running sequence's last window, a "
                 "step's new tokens%s", ring, ring_block / BLOCK / 1024, ring * ring_block / 2**30,
                 ", and as many again for prefix hits" if prefix else "")
    if cfg.attention == "compressed":  # DeepSeek-V4: the pool holds the entries; windows are each sequence's own
        state = state_bytes(cfg, compute)
        log.info("DeepSeek-V4's windows: up to %.1f MiB of state a sequence beside the pool (%.2f GiB at --max-batch "
                 "%d), and a snapshot of it where a prefix hit may start", state / 2**20,
                 args.max_batch * state / 2**30, args.max_batch)
    metrics.KV_POSITION_BYTES.set(per_block / BLOCK)
    return KVPool(cfg, dtype, device, blocks, prefix, int(args.prefix_cache_host_gb * 2**30) if prefix else 0,
                  window_blocks=ring or None), max_context


def namespace(fp: str, dtype: torch.dtype, kv_dtype: torch.dtype, dense: str | None, expert_desc: tuple) -> str:
    """What the prefix chain's root names besides each request's settings: whatever changes the numbers."""
    return f"{fp}|{dtype}|kv {kv_dtype}|{dense or 'torch'}|{'|'.join(map(str, expert_desc))}"


async def serve(args, stop: asyncio.Event) -> None:
    try:
        model_dir = gguf_model.resolve(args.model, default_dir())  # a GGUF file: its prepared folder
        cfg = load_config(model_dir)
        ckpt = gguf_model.open_checkpoint(model_dir)
        text = TextCodec(model_dir)
        fp = fingerprint(ckpt)
    except ModelConfigError as e:
        serving.fail(str(e))
    try:
        sec = security.ServerSecurity.from_args(args)
        expert_sec = security.ClientSecurity.from_args(args, prefix="experts-")
    except (OSError, ValueError) as e:
        serving.fail(f"security settings: {e}")
    device, dtype, kv_dtype, dense, targets = check_args(args, cfg)
    torch.set_num_threads(args.threads)
    max_context = min(args.max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
    max_msg = max(max_context, 8192) * (cfg.hidden_size * 4 + cfg.top_k * 8) + (1 << 16)
    server_info = generate_pb2.ServerInfo(
        model_fingerprint=fp, architecture=cfg.architecture, device=str(device), dtype=str(dtype).replace("torch.", ""),
        num_layers=cfg.num_layers, moe_layers=list(cfg.moe_layers), vocab_size=cfg.vocab_size,
        max_context=max_context, expert_service=args.experts, defer=args.defer, max_batch=args.max_batch)
    # sent: at most Score's logits (refused past grpcio's 2 GiB: logprobs_only then); received: a request, whose
    # prompt can have no more bytes than the context holds (token ids: up to 5 bytes each), plus its settings
    prompt_bytes = prompt_bytes_limit(max_context, text)
    servicer = GenerateServicer(cfg, server_info, args.defer, args.max_tokens_limit, args.expert_wait,
                                args.reasoning_parser, args.tool_call_parser)
    servicer.tenant_of, servicer.prefix_scope = sec.tenant_of, args.prefix_cache_scope
    svc = await serving.start_service(
        sec, args.listen, serving.server_options(max_context * cfg.vocab_size * 4 + (1 << 20),
                                                 prompt_bytes + max_context * 6 + (1 << 20)),
        [*sec.interceptors, MalformedRequestInterceptor()],
        [(generate_pb2_grpc.add_GenerateServiceServicer_to_server, servicer,
          generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name)],
        args.reflection, args.metrics_port, args.metrics_host)
    http = None
    if args.http_listen:
        from gpu_service.api import openai_api  # FastAPI and uvicorn load only when the HTTP API is asked for
        # a JSON string spells a byte in up to 6 characters (\u00XX)
        api = openai_api.Api(servicer, args.served_model_name or pathlib.Path(args.model).resolve().name, sec,
                             max_body=6 * prompt_bytes + (1 << 20))
        sec.warn_if_open(args.http_listen)
        try:
            http = await openai_api.start(api, args.http_listen, sec.ssl_context)
        except (OSError, ValueError) as e:
            serving.fail(f"cannot listen on --http-listen {args.http_listen}: {e}")
        log.info("OpenAI-compatible HTTP API on %s (model id %r)", args.http_listen, api.model_name)
    if dense:
        native.init_pool(args.threads)
    log.info("dense layers: %s", f"native kernels, {dense} weights" if dense else "torch")

    def load_model(cancel):
        return Model(cfg, ckpt, device, dtype, cancel=cancel, dense_format=dense, kv_dtype=kv_dtype,
                     cuda_graphs=args.cuda_graphs == "auto")

    async def stopped_while_starting(remotes=()) -> None:
        log.info("stopped while starting")
        if http:
            await openai_api.stop(api, http, 0)
        await svc.stop(grace=0)
        for r in remotes:
            r.close()

    if targets == ["local"]:
        try:
            model, layers, fmt = await serving.unless_stopped(stop, lambda c: load_local(
                args, cfg, ckpt, fp, lambda: load_model(c), c))
        except serving.Stopped:
            return await stopped_while_starting()
        except ModelConfigError as e:
            serving.fail(str(e))
        experts = LocalExperts(layers)
        server_info.transport = transport = "local"
        step_tokens, experts_up, watchers = args.max_step_tokens, (lambda: True), []
        expert_desc = (fmt, kernel_path(fmt))
        pool, max_context = kv_pool(args, cfg, device, kv_dtype, max_context, dtype)
        engine = Engine(model, experts, text, args.max_batch, max_context, step_tokens=step_tokens,
                        kv_pool=pool, namespace=namespace(fp, dtype, kv_dtype, dense, expert_desc))
        await svc.serving(True)
    else:
        remotes = [RemoteExperts(t, fp, max_msg, expert_sec, args.transport, args.shm_mb << 20, args.expert_timeout)
                   for t in targets]
        log.info("waiting for the expert service%s at %s (loading this side's weights meanwhile)",
                 "s" if len(targets) > 1 else "", args.experts)
        try:
            infos, model = await serving.unless_stopped(stop, lambda c: connect_remote(
                remotes, fp, args.model, args.connect_timeout, lambda: load_model(c), c))
        except serving.Stopped:
            return await stopped_while_starting(remotes)
        except (ConnectionError, ModelConfigError) as e:
            serving.fail(str(e))
        experts, remotes = in_shard_order(remotes, infos)
        try:
            transport = await asyncio.to_thread(experts.start_transport)
        except ExpertServiceError as e:
            serving.fail(f"--transport {args.transport}: {e}")
        server_info.transport = transport
        try:
            experts = await asyncio.to_thread(hot.from_args, args, experts, cfg, ckpt, fp,
                                              infos[0].weight_format, device)
            experts = await asyncio.to_thread(gpu_prefill.from_args, args, experts, cfg, ckpt, fp,
                                              infos[0].weight_format, device)
        except ValueError as e:
            serving.fail(str(e))
        step_tokens = min([args.max_step_tokens] + [i.max_tokens for i in infos if i.max_tokens])
        health = ExpertHealth(remotes, on_change=svc.serving)
        expert_desc = (infos[0].weight_format, infos[0].kernel_path)
        pool, max_context = kv_pool(args, cfg, device, kv_dtype, max_context, dtype)
        engine = Engine(model, experts, text, args.max_batch, max_context, step_tokens=step_tokens,
                        expert_wait=args.expert_wait, experts_ready=health.up, experts_why=health.why_down,
                        kv_pool=pool, namespace=namespace(fp, dtype, kv_dtype, dense, expert_desc))
        experts_up, watchers = health.up, health.watchers()
    if model.graphs != "off" and args.cuda_graphs_capture:
        t0 = time.monotonic()
        buckets, graphs = await asyncio.to_thread(model.prepare_decode_graphs, engine.pool, args.max_batch,
                                                  min(args.cuda_graphs_capture, max_context), args.defer > 0)
        log.info("decode graphs: %d buckets (%d graphs) prepared at start-up in %.1f s", buckets, graphs,
                 time.monotonic() - t0)
    server_info.max_context = max_context
    serving.freeze_startup_objects()
    engine.start()
    servicer.attach(engine, experts_up)
    log.info("ready on %s: %s (fingerprint %s) on %s/%s, experts at %s (%s, %s, via %s), %d tokens per step, "
             "defer=%d", args.listen, cfg.architecture, fp, device, dtype, args.experts, *expert_desc, transport,
             step_tokens, args.defer)
    if cfg.text_only:
        log.info("%s is a vision-language checkpoint: its text model is served (text in, text out); the vision tower "
                 "and projector are not loaded", cfg.architecture)
    try:
        await stop.wait()
    finally:
        await drain(args.grace, servicer, engine, svc, watchers, (api, http) if http else None)
        engine.stop()
        experts.close()


async def drain(grace: float, servicer: GenerateServicer, engine: Engine, svc: serving.Service, watchers,
                http) -> None:
    """SIGTERM: nothing new starts (new requests get UNAVAILABLE / 503, queued ones fail now), the running
    ones get `grace` seconds to finish, then every one still running, gRPC or HTTP, ends with a clear
    UNAVAILABLE error; the servers close once their handlers have sent it."""
    log.info("draining (grace %gs)", grace)
    for w in watchers:
        w.cancel()
    servicer.draining = True
    engine.close("the service is shutting down")
    await svc.serving(False)
    deadline = time.monotonic() + grace
    while engine.busy() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if engine.busy():
        log.info("grace period over: ending the requests still running")
        engine.abort(f"the service shut down before this request finished (--grace {grace:g}s)")
    flush = 2.0  # for the handlers to send what the engine emitted
    if http:
        from gpu_service.api import openai_api  # (as above)
    await asyncio.gather(svc.stop(grace=flush), *([openai_api.stop(*http, flush)] if http else []))


def main(argv=None) -> None:
    args = parse_args(argv)
    serving.setup_logging(args.log_level)
    serving.run(lambda stop: serve(args, stop))


if __name__ == "__main__":
    main()
