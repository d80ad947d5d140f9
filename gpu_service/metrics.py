"""Prometheus metrics of the GPU service (served over HTTP by --metrics-port)."""
from prometheus_client import Counter, Gauge, Histogram

from moe_core.metrics import BatchHistogram, busy_fraction_gauge, register_wait_policy

LAT = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30)
FAST = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, .1, .25, 1)

REQUESTS = Counter("moe_requests_total", "Generate/Score requests by final gRPC status", ["rpc", "code"])
HTTP_REQUESTS = Counter("moe_http_requests_total", "OpenAI-compatible HTTP API requests by route and HTTP status",
                        ["route", "status"])
PROMPT_TOKENS = Counter("moe_prompt_tokens_total", "Prompt tokens processed")
GENERATED_TOKENS = Counter("moe_generated_tokens_total", "Tokens generated")
RUNNING = Gauge("moe_running_requests", "Requests in the engine's running batch")
WAITING = Gauge("moe_waiting_requests", "Requests queued for the engine")
TTFT = Histogram("moe_time_to_first_token_seconds", "Request arrival to first token", buckets=LAT)
ITL = Histogram("moe_inter_token_latency_seconds", "Time between consecutive tokens of a request", buckets=LAT)
STEP = Histogram("moe_step_seconds", "One engine step (all layers, all running sequences)", buckets=LAT)
# per layer, a few a step: fed a step at a time (BatchHistogram)
EXPERT_WAIT = BatchHistogram("moe_expert_wait_seconds", "Time the GPU side blocked on the expert service, per MoE "
                             "layer", ("layer",), buckets=FAST)
EXCHANGE = BatchHistogram("moe_exchange_overhead_seconds",
                          "Expert round trip minus the expert compute it contained (wire, codec, scheduling)", buckets=FAST)
EXPERT_COMPUTE = BatchHistogram("moe_remote_expert_compute_seconds", "Expert compute per layer part, as the expert "
                                "service reports it (service: expert, or expert-I for shard I)", ("part", "service"),
                                buckets=FAST)
GPU_BUSY = Counter("moe_gpu_busy_seconds_total", "Engine time not spent waiting for the expert service")
EXPERT_BLOCKED = Counter("moe_expert_blocked_seconds_total", "Engine time spent waiting for the expert service")
PREFIX_QUERY_TOKENS = Counter("moe_prefix_cache_query_tokens_total", "Prompt tokens looked up in the prefix cache")
PREFIX_HIT_TOKENS = Counter("moe_prefix_cache_hit_tokens_total", "Prompt tokens found in the prefix cache (not computed)")
PREFIX_EVICTIONS = Counter("moe_prefix_cache_evictions_total", "Cached KV blocks (and linear-attention snapshots) dropped "
                           "for room or beyond --prefix-cache-gb")
PREFIX_BYTES = Gauge("moe_prefix_cache_bytes", "Bytes of cached KV blocks no request uses, and of kept linear-attention "
                     "states (--prefix-cache-gb)")
KV_POSITION_BYTES = Gauge("moe_kv_cache_bytes_per_token", "Bytes of KV cache one position of context takes over every "
                          "attention layer (--kv-cache-dtype; an 8-bit cache's scales included)")
KV_BLOCKS = Gauge("moe_kv_cache_blocks", "KV pool blocks (--kv-cache-gb) by state: used by a request, cached (a prefix "
                  "kept for reuse, evicted when needed), free", ["state"])
PREFIX_HOST_SPILLS = Counter("moe_prefix_cache_host_spills_total", "Evicted cached KV blocks copied to the host tier "
                             "(--prefix-cache-host-gb)")
PREFIX_HOST_RESTORES = Counter("moe_prefix_cache_host_restores_total", "Cached KV blocks copied back from the host tier "
                               "for a hit")
PREFIX_HOST_BLOCKS = Gauge("moe_prefix_cache_host_blocks", "KV blocks the host tier holds")
PREEMPTIONS = Counter("moe_kv_cache_preemptions_total", "Running requests set aside for KV blocks (they resume later, "
                      "recomputing what the prefix cache no longer holds)")
EXPERT_PAIRS = Counter("moe_expert_pairs_total", "Routed (token, expert) pairs by where they were computed: hot (this "
                       "side's hot experts, --gpu-experts) or remote (the expert service)", ["where"])
HOT_SHARE = Gauge("moe_hot_experts_usage_share", "Share of a MoE layer's recent (decayed) expert choices that its hot "
                  "experts cover, at the last placement refresh", ["layer"])
EXPERT_USAGE = Gauge("moe_expert_usage", "Decayed count of tokens routed to each expert (--gpu-experts-half-life), "
                     "at the last placement refresh", ["layer", "expert"])
PREFILL_EXPERT_TOKENS = Counter("moe_gpu_prefill_expert_tokens_total", "Tokens whose routed experts this side computed "
                                "itself from the mapped packed cache (--gpu-prefill-tokens), summed over MoE layers")
HOT_SWAPS = Counter("moe_hot_experts_swaps_total", "Layers whose hot experts were replaced at a step boundary")
EXPERT_UP = Gauge("moe_expert_service_up", "1 while the expert service (every shard) answers health checks")
SHARD_UP = Gauge("moe_expert_shard_up", "1 while this expert service (one of --experts) answers health checks", ["target"])


busy_fraction_gauge("moe_gpu_busy_fraction", "Share of wall time the engine computed (not waiting), since the last read",
                    GPU_BUSY)


register_wait_policy()  # how the native waits use the CPUs (moe_core/metrics.py WaitPolicy)
