#!/usr/bin/env bash
# Everything that needs a GPU, as one run for a short lease on a GPU machine (the whole thing takes a
# few minutes): build the kernels, the end-to-end tests with the GPU service on CUDA (fp32 tiny
# checkpoints against transformers, deferral, batching, shared memory), the embedded bf16 model's
# tokens on CUDA against the CPU and transformers, and decode/exchange figures on CUDA vs the CPU.
#   bash scripts/gpu_check.sh          results under $OUT (default ./gpu-check), a summary on stdout
#   BENCH=0 bash scripts/gpu_check.sh  the build and the tests only
# Wheels in .whl/ (pip download ... for the machine's Python) are installed first: for what its image
# lacks (grpcio-health-checking) or has too old (grpcio/protobuf the generated code wants).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
step() { echo "=== $1 ($(date +%T))"; }

if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{ nvidia-smi -L; lscpu | grep -E 'Model name|^CPU\(s\)'; $PY -c 'import torch, grpc, google.protobuf as pb, transformers as t
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(), "grpc", grpc.__version__,
      "protobuf", pb.__version__, "transformers", t.__version__)'; } 2>&1 | tee "$OUT/env.txt"

step build
if ! timeout 180 $PY setup.py build_ext --inplace -j "$(nproc)" >"$OUT/build.log" 2>&1; then
  tail -20 "$OUT/build.log"
  ls moe_kernels/_native*.so 2>/dev/null || exit 1  # a carried build, if any
fi
$PY -c "import moe_kernels as m; print(\"kernel path\", m.ISA, m.native.cpu_features())"

step "tests, GPU service on cuda"
MOE_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -q -p no:cacheprovider -n "${WORKERS:-8}" \
  tests/e2e/test_families.py tests/exchange/test_deferral.py tests/api/test_generate.py tests/exchange/test_shm.py \
  tests/model/test_chunked_prefill.py tests/api/test_bad_requests.py tests/core/test_real_configs.py tests/experts/test_hot_experts.py \
  tests/experts/test_prefill_experts.py tests/model/test_prefix_cache.py tests/model/test_kv_dtype.py tests/model/test_graphed_decode.py \
  >"$OUT/pytest.log" 2>&1
echo "pytest exit $?"; tail -25 "$OUT/pytest.log"
[ "${BENCH:-1}" = 0 ] && { step done; exit 0; }

step "the GPU side's decode step a layer, per op against CUDA graphs (#28: <= 100 us a layer outside the weight reads)"
for arch in qwen3-30b-a3b deepseek-v3; do
  # a 32000-token vocabulary: the per-layer figure does not depend on it, and DeepSeek-V3's own would write ~3 GB more
  timeout 150 $PY bench/bench_graphs.py --arch $arch --layers 4 --set vocab_size=32000 --device cuda --batch 1,4 \
    --context 512 --steps 48 --rounds 2 --work /tmp/bench-graphs 2>&1 | grep -E '^\||layers|graphs|Error|failed' | tee "$OUT/graphs-$arch.log"
done

step "Qwen3-30B-A3B width, 2 layers: hot experts (decode with 0, 8, 32 a layer), GPU prefill at 2k tokens"
Q3=/tmp/q3-2layers
timeout 120 $PY tools/synth_checkpoint.py --arch qwen3-30b-a3b --layers 2 --set vocab_size=32000 --out $Q3 \
  >"$OUT/synth.log" 2>&1 || tail -3 "$OUT/synth.log"
timeout 240 $PY bench/bench_hot_experts.py --model $Q3 --device cuda --threads 8 --runs 1 --settle 6 2>&1 \
  | tail -8 | tee "$OUT/hot_experts.log"
timeout 240 $PY bench/bench_gpu_prefill.py --model $Q3 --device cuda --threads 8 --runs 1 --prompt 2048 2>&1 \
  | tail -6 | tee "$OUT/gpu_prefill.log"

step "embedded model: cuda vs cpu vs transformers"
timeout 180 $PY scripts/gpu_agree.py >"$OUT/agree.log" 2>&1; echo "exit $?"; tail -16 "$OUT/agree.log"

step "decode and exchange, GPU side on cpu then cuda"
for dev in cpu cuda; do
  timeout 120 $PY bench/bench_e2e.py --device $dev --runs 3 --exchanges 200 2>&1 | tail -6
done | tee "$OUT/bench_e2e.log"

step "deferral, DeepSeek-V3 shape, GPU side on cuda"
MOE_TEST_DEVICE=cuda timeout 180 $PY bench/bench_deferral.py --family deepseek_v3 --defer 2 --runs 2 2>&1 \
  | tail -12 | tee "$OUT/deferral.log"
step done
