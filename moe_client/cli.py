"""moe-client: stream a completion from a gpu-service, or ask a service what it serves."""
from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import time

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_core import security
from protos import expert_pb2, expert_pb2_grpc, generate_pb2, generate_pb2_grpc

FINISH = {v: k.lower() for k, v in generate_pb2.FinishReason.items()}


class Parser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr and exit code 2 (argparse's usage block goes to --help)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _number(kind, lo=None, hi=None, lo_open=False, what=""):
    """An argparse type: `kind` within [lo, hi] (lo excluded with lo_open), finite."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if isinstance(v, float) and not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo)) \
                or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{text} is out of range: {what}")
        return v
    return parse


MAX_TOKENS = _number(int, 1, 2**32 - 1, what="must be in [1, 4294967295]")
TEMPERATURE = _number(float, 0.0, what="must be a finite number >= 0 (0 = greedy)")
TOP_P = _number(float, 0.0, 1.0, lo_open=True, what="must be in (0, 1]")
TOP_K = _number(int, 0, 2**31 - 1, what="must be in [0, 2147483647] (0 = off)")
SEED = _number(int, 0, 2**64 - 1, what="must be in [0, 2**64 - 1]")
DEFER = _number(int, 0, 2**32 - 1, what="must be >= 0")
SECONDS = _number(float, 0.0, lo_open=True, what="must be > 0")
WAIT = _number(float, 0.0, what="must be >= 0")


def parse_args(argv=None):
    ap = Parser(prog="moe-client", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="stream a completion", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    g.add_argument("--server", default="127.0.0.1:50051", help="gpu-service host:port")
    g.add_argument("--max-tokens", type=MAX_TOKENS, default=64)
    g.add_argument("--temperature", type=TEMPERATURE, default=0.0, help="0 = greedy (so is anything below 1e-5)")
    g.add_argument("--top-p", type=TOP_P, default=1.0)
    g.add_argument("--top-k", type=TOP_K, default=0, help="0 = off")
    g.add_argument("--seed", type=SEED, default=None, help="makes sampling reproducible")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    g.add_argument("--system", default=None, help="with --chat: a system message")
    g.add_argument("--defer", type=DEFER, default=None, help="override the server's expert deferral")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object per chunk (token ids, timings)")
    g.add_argument("--timeout", type=SECONDS, default=None, help="deadline in seconds")
    p = sub.add_parser("profile", help="run one prompt with profiling: per-layer table, optional Chrome/Perfetto trace",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("prompt")
    p.add_argument("--server", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=MAX_TOKENS, default=16)
    p.add_argument("--defer", type=DEFER, default=None)
    p.add_argument("--trace", default=None, help="write a Chrome trace JSON here (open in chrome://tracing or Perfetto)")
    h = sub.add_parser("health", help="exit 0 once a service reports SERVING (grpc.health.v1), 1 on timeout")
    h.add_argument("--server", default="127.0.0.1:50051")
    h.add_argument("--wait", type=WAIT, default=0.0, help="keep trying for this many seconds")
    h.add_argument("--alive", action="store_true",
                   help="exit 0 if the health service answers at all, SERVING or NOT_SERVING (a liveness probe: "
                        "a gpu-service waiting for an expert service, or loading, is alive)")
    i = sub.add_parser("info", help="print a service's Info (gpu-service or expert-service)")
    i.add_argument("--server", default="127.0.0.1:50051")
    i.add_argument("--expert", action="store_true", help="the server is an expert service")
    for sp in (g, p, h, i):
        security.add_client_args(sp)
    return ap.parse_args(argv)


def md(a) -> tuple:
    return security.ClientSecurity.from_args(a).metadata


def build_request(a) -> generate_pb2.GenerateRequest:
    sp = generate_pb2.SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
    if a.seed is not None:
        sp.seed = a.seed
    req = generate_pb2.GenerateRequest(max_tokens=a.max_tokens, sampling=sp, stop=a.stop, ignore_eos=a.ignore_eos)
    if a.defer is not None:
        req.defer = a.defer
    if a.chat:
        msgs = ([generate_pb2.ChatMessage(role="system", content=a.system)] if a.system else [])
        msgs.append(generate_pb2.ChatMessage(role="user", content=a.prompt))
        req.chat.messages.extend(msgs)
    else:
        req.prompt = a.prompt
    return req


def generate(a) -> int:
    with security.ClientSecurity.from_args(a).channel(a.server) as ch:
        stub = generate_pb2_grpc.GenerateServiceStub(ch)
        last = None
        for chunk in stub.Generate(build_request(a), timeout=a.timeout, metadata=md(a)):
            last = chunk
            if a.json:
                print(json.dumps({"text": chunk.text, "token_ids": list(chunk.token_ids),
                                  "finish_reason": FINISH[chunk.finish_reason] if chunk.finish_reason else None,
                                  "prompt_tokens": chunk.usage.prompt_tokens,
                                  "completion_tokens": chunk.usage.completion_tokens,
                                  "time_to_first_token_s": round(chunk.time_to_first_token_s, 6),
                                  "elapsed_s": round(chunk.elapsed_s, 6)}, ensure_ascii=False), flush=True)
            else:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        if not a.json and last is not None:
            n, dt = last.usage.completion_tokens, last.elapsed_s
            rate = (n - 1) / (dt - last.time_to_first_token_s) if n > 1 and dt > last.time_to_first_token_s else 0.0
            print(f"\n[{FINISH[last.finish_reason]}: {last.usage.prompt_tokens} prompt + {n} completion tokens, "
                  f"first token {last.time_to_first_token_s * 1e3:.0f} ms, {rate:.1f} tok/s]", file=sys.stderr)
    return 0


def info(a) -> int:
    with security.ClientSecurity.from_args(a).channel(a.server) as ch:
        if a.expert:
            msg = expert_pb2_grpc.ExpertServiceStub(ch).Info(expert_pb2.ExpertInfoRequest(), timeout=10, metadata=md(a))
        else:
            msg = generate_pb2_grpc.GenerateServiceStub(ch).Info(generate_pb2.ServerInfoRequest(), timeout=10, metadata=md(a))
    print(json_format.MessageToJson(msg, preserving_proto_field_name=True))
    return 0


def chrome_trace(spans) -> dict:
    """Both services' spans on one timeline: a process per service, a thread per kind of work."""
    t0 = min(sp.start_unix_ns for sp in spans)
    pids = {"gpu": 1}  # then each expert service (expert, or expert-I per shard) as it first appears
    for sp in spans:
        pids.setdefault(sp.service, len(pids) + 1)
    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{svc}-service"}}
              for svc, pid in pids.items()]
    for sp in spans:
        events.append({"name": sp.name + (f" L{sp.layer}" if sp.layer >= 0 else ""), "cat": sp.service, "ph": "X",
                       # a shard's lane: its compute (2), and the GPU side's wait on it (3)
                       "pid": pids[sp.service], "tid": 1 if sp.service == "gpu" else 3 if sp.name == "shard_wait" else 2,
                       "ts": (sp.start_unix_ns - t0) / 1e3, "dur": max(0, sp.end_unix_ns - sp.start_unix_ns) / 1e3,
                       "args": {"step": sp.step, "layer": sp.layer}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def profile_table(spans) -> str:
    """Milliseconds per layer and kind of work, summed over the request's steps."""
    per = collections.defaultdict(lambda: collections.defaultdict(float))
    kinds = []
    for sp in spans:
        key = f"{sp.service}:{sp.name}"
        if key not in kinds:
            kinds.append(key)
        per[sp.layer][key] += (sp.end_unix_ns - sp.start_unix_ns) / 1e6
    head = ["layer", *kinds]
    rows = [head] + [[("-" if layer < 0 else str(layer))] + [f"{per[layer].get(k, 0):.2f}" for k in kinds]
                     for layer in sorted(per)]
    rows.append(["total"] + [f"{sum(per[layer].get(k, 0) for layer in per):.2f}" for k in kinds])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def profile(a) -> int:
    req = generate_pb2.GenerateRequest(prompt=a.prompt, max_tokens=a.max_tokens, profile=True, ignore_eos=True,
                                       sampling=generate_pb2.SamplingParams(temperature=0))
    if a.defer is not None:
        req.defer = a.defer
    with security.ClientSecurity.from_args(a).channel(a.server) as ch:
        chunks = list(generate_pb2_grpc.GenerateServiceStub(ch).Generate(req, metadata=md(a)))
    spans = chunks[-1].profile.spans
    steps = len({sp.step for sp in spans})
    u = chunks[-1].usage
    print(f"prompt {u.prompt_tokens} tokens, {u.cached_tokens} of them from the prefix cache "
          f"({u.cached_tokens / max(1, u.prompt_tokens):.0%}, not computed)")
    print(f"{len(chunks)} tokens in {chunks[-1].elapsed_s * 1e3:.1f} ms over {steps} steps; "
          f"milliseconds per layer (summed over steps):")
    print(profile_table(spans))
    if a.trace:
        with open(a.trace, "w") as f:
            json.dump(chrome_trace(spans), f)
        print(f"trace: {a.trace}", file=sys.stderr)
    return 0


def health(a) -> int:
    deadline = time.monotonic() + a.wait
    with security.ClientSecurity.from_args(a).channel(a.server) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                detail = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
                if status == health_pb2.HealthCheckResponse.SERVING or a.alive:
                    print(detail)
                    return 0
            except grpc.RpcError as e:
                detail = f"{e.code().name}: {e.details()}"
            if time.monotonic() >= deadline:
                print(f"not serving: {detail}", file=sys.stderr)
                return 1
            time.sleep(0.2)


def main(argv=None) -> None:
    a = parse_args(argv)
    try:
        sys.exit({"generate": generate, "info": info, "health": health, "profile": profile}[a.cmd](a))
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        sys.exit(1)
    except (ValueError, OSError) as e:  # a value the checks above let through, an unreadable token file
        print(f"moe-client: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
