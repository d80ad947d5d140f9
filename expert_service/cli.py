"""expert-service: serve the routed experts of a Hugging Face MoE checkpoint over gRPC."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import torch

from moe_core import gguf_model
from moe_core.config import ModelConfigError, load_config
from moe_core.fingerprint import fingerprint
from moe_core import security, serving
from moe_core.edge import MalformedRequestInterceptor
from moe_core.shards import Shard
from protos import expert_pb2, expert_pb2_grpc

from moe_experts import kernels, packed_cache
from expert_service.server import RAW_METHODS, ExpertServicer
from moe_experts.loading import open_cache, weight_format
from moe_experts.store import load_expert_layers

log = logging.getLogger("expert_service")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="expert-service", description=__doc__,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint directory (config.json + *.safetensors), "
                    "or a GGUF file (the first of a split set; README: GGUF files)")
    ap.add_argument("--listen", default="127.0.0.1:50061", help="host:port to serve on")
    ap.add_argument("--threads", type=int, default=serving.physical_cores(),
                    help="CPU threads for the expert kernels (default: physical cores). Sharing a host with "
                         "gpu-service on the CPU or with other programs is fine with the defaults: waits yield the core "
                         "while the machine is ours and spin only while a CPU is free beside other programs "
                         "(MOE_SPIN=yield|always|never overrides) and torch's OpenMP threads wait "
                         "passively (OMP_WAIT_POLICY)")
    ap.add_argument("--weight-format", default="auto",
                    choices=["auto", "bf16", "fp16", "fp32", *kernels.NATIVE_FORMATS[1:], gguf_model.PER_MATRIX],
                    help="format the expert weights are held in (int8: per-channel scales, int4: per-64 group "
                         "scales, quantized at load; mxfp4: e2m1 with a power-of-two scale per 32, gpt-oss's "
                         "published experts kept bit for bit, others quantized at load; fp8: e4m3 with a scale "
                         "per 128 x 128 block, published FP8 experts kept bit for bit, others quantized at load; "
                         "int4g32 / uint4g32: 4-bit with a scale (and a min) per 32, int4 checkpoints and GGUF's "
                         "Q4_0 / Q4_1 / Q4_K kept; q4k: GGUF's Q4_K as stored, a 6-bit scale and min per 32 under "
                         "an fp32 one per 256; q5k: GGUF's Q5_K as stored, q4k's with 5 bits; q3k: GGUF's Q3_K as stored, q6k's "
                         "with 3 bits; q2k: GGUF's Q2_K as stored, a 4-bit scale and min per 16 under fp32 ones per 256; "
                         "q6k: GGUF's Q6_K as stored, 6 bits with an int8 scale per 16 under an "
                         "fp32 one per 256; iq4nl: GGUF's IQ4_NL / IQ4_XS kept; iq4xs: GGUF's IQ4_XS as stored, an "
                         "int8 scale per 32 under an fp32 one per 256; iq2xxs, iq2xs, iq2s, iq3xxs, iq3s, iq1s, iq1m: GGUF's grid types "
                         "as stored, the file's bytes (GGUF files only); gguf: each matrix of a GGUF in the format that keeps its "
                         "block type, the default for mixes such as Q4_K_M); auto = the checkpoint's own "
                         "(its dtype, mxfp4 for published gpt-oss, fp8 for FP8 releases, the int4 and GGUF block "
                         "formats above, other GGUF types requantized to about their size)")
    ap.add_argument("--shard", default="0/1", metavar="I/N",
                    help="hold only shard I of N of every MoE layer's routed experts (expert e on shard e %% N): "
                         "N expert services, one per shard, together serve the model; gpu-service --experts "
                         "lists them all")
    ap.add_argument("--max-tokens", type=int, default=8192,
                    help="most tokens accepted in one layer request (bounds message size)")
    ap.add_argument("--shm-max-mb", type=int, default=1024,
                    help="largest shared-memory region a co-located GPU service may register (0: gRPC only)")
    ap.add_argument("--cache-dir", default=str(packed_cache.default_dir()),
                    help="packed-weight cache: experts packed in the chosen format are written here once and "
                         "read back on later starts ('off' to disable; $MOE_CACHE_DIR sets the default)")
    serving.add_server_args(ap)
    security.add_server_args(ap)
    return ap.parse_args(argv)


async def serve(args, stop: asyncio.Event) -> None:
    try:
        model_dir = gguf_model.resolve(args.model, packed_cache.default_dir())  # a GGUF file: its prepared folder
        cfg = load_config(model_dir)
        ckpt = gguf_model.open_checkpoint(model_dir)
    except ModelConfigError as e:
        serving.fail(str(e))
    try:
        sec = security.ServerSecurity.from_args(args)
    except (OSError, ValueError) as e:
        serving.fail(f"security settings: {e}")
    torch.set_num_threads(args.threads)
    try:
        shard = Shard.parse(args.shard)
    except ValueError as e:
        serving.fail(f"--shard: {e}")
    if shard.count > cfg.n_routed_experts:
        serving.fail(f"--shard {shard}: {cfg.n_routed_experts} experts cannot be split into {shard.count} shards")
    try:
        fmt = weight_format(args.weight_format, cfg)
    except ModelConfigError as e:
        serving.fail(str(e))
    held = gguf_model.dequantized_experts(cfg, fmt)
    if held:
        log.warning("%s", held)
    max_msg = args.max_tokens * (cfg.hidden_size * 4 + cfg.n_routed_experts * 8) + (1 << 16)
    if not 1 <= args.max_tokens or max_msg > serving.GRPC_MAX_MESSAGE:
        serving.fail(f"--max-tokens {args.max_tokens}: must be >= 1, and a layer request of that many tokens of "
                     f"hidden size {cfg.hidden_size} must fit gRPC's 2 GiB message limit")
    servicer = ExpertServicer(cfg, fmt, kernels.kernel_path(fmt), args.threads, args.max_tokens,
                               shm_max_bytes=args.shm_max_mb << 20, shard=shard)
    name = expert_pb2.DESCRIPTOR.services_by_name["ExpertService"].full_name
    svc = await serving.start_service(
        sec, args.listen, serving.server_options(max_msg), [*sec.interceptors, MalformedRequestInterceptor(RAW_METHODS)],
        [(expert_pb2_grpc.add_ExpertServiceServicer_to_server, servicer, name)], args.reflection, args.metrics_port,
        args.metrics_host)
    log.info("listening on %s; loading experts of %s", args.listen, args.model)
    try:
        # off the event loop, so health checks are answered (NOT_SERVING) while loading
        fp = await asyncio.to_thread(fingerprint, ckpt)
        cache = open_cache(args.cache_dir, ckpt, fp, fmt, shard)
        layers = await serving.unless_stopped(stop, lambda cancel: load_expert_layers(
            cfg, ckpt, fmt, args.threads, cancel=cancel, cache=cache, shard=shard))
    except ValueError as e:  # ModelConfigError, or expert tensors of the wrong shape
        serving.fail(str(e))
    except serving.Stopped:
        log.info("stopped while loading")
        await svc.stop(grace=0)
        return
    servicer.attach(layers, fp)
    serving.freeze_startup_objects()
    await svc.serving(True)
    log.info("ready: %s fingerprint %s, %d MoE layers, %d experts%s, format %s, kernel %s, %d threads",
             cfg.architecture, fp, len(layers), len(shard.experts(cfg.n_routed_experts)),
             f" (shard {shard} of {cfg.n_routed_experts})" if shard.count > 1 else "", fmt, kernels.kernel_path(fmt),
             args.threads)
    try:
        await stop.wait()
    finally:
        log.info("draining (grace %.0fs)", args.grace)
        await svc.stop(grace=args.grace)


def convert_main(argv) -> None:
    """expert-service convert: pack once, offline."""
    ap = argparse.ArgumentParser(
        prog="expert-service convert", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Pack a checkpoint's routed experts into a packed-weight cache directory, offline; then "
                    "`expert-service --model MODEL --cache-dir OUT` starts from it without re-quantizing.")
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    ap.add_argument("--weight-format", default="auto", choices=["auto", *kernels.NATIVE_FORMATS, gguf_model.PER_MATRIX],
                    help="auto = the checkpoint's dtype, bf16 for fp32/fp16 ones")
    ap.add_argument("--out", required=True, help="the cache directory to write (created if needed)")
    ap.add_argument("--threads", type=int, default=serving.physical_cores())
    ap.add_argument("--log-level", default="INFO")
    a = ap.parse_args(argv)
    serving.setup_logging(a.log_level)
    try:
        model_dir = gguf_model.resolve(a.model, packed_cache.default_dir())
        cfg, ckpt = load_config(model_dir), gguf_model.open_checkpoint(model_dir)
        fmt = weight_format(a.weight_format, cfg)
        fmt = fmt if fmt in kernels.NATIVE_FORMATS else "bf16"
        cache = open_cache(a.out, ckpt, fingerprint(ckpt), fmt)
        if cache is None:
            serving.fail(f"the native kernels are not available here: {fmt} cannot be packed")
        load_expert_layers(cfg, ckpt, fmt, a.threads, cache=cache)
    except ValueError as e:
        serving.fail(str(e))
    print(f"packed {len(cfg.moe_layers)} MoE layers as {fmt} into {cache.dir}")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert"]:
        return convert_main(argv[1:])
    args = parse_args(argv)
    serving.setup_logging(args.log_level)
    serving.run(lambda stop: serve(args, stop))


if __name__ == "__main__":
    main()
