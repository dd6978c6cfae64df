#!/usr/bin/env bash
# GPU checks for extract, one script: CUDA tests + the hook/throughput benchmark on the GPU.
#
#   bash benchmarks/gpu_check.sh [OUTDIR]      (default: $OUT, else ./gpu-check)
#
# Expects Python with torch (CUDA) and accelerate. If `import zarr` fails, installs zarr and its
# dependencies from the wheels in $EXTRACT_WHEELS (default .whl; see benchmarks/README.md) into
# /tmp/site without the network. Every step has a timeout; their sum (595 s) keeps the script under 10 minutes.
set -uo pipefail

cd "$(dirname "$0")/.."
OUTDIR="${1:-${OUT:-$PWD/gpu-check}}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python}"
WHEELS="${EXTRACT_WHEELS:-.whl}"
status=0

step() {  # step NAME SECONDS CMD...: run with a timeout, log to $OUTDIR/NAME.log, remember failures
  local name=$1 seconds=$2
  shift 2
  echo "== $name (timeout ${seconds}s): $*" | tee -a "$OUTDIR/summary.txt"
  local start=$SECONDS
  timeout --kill-after=10 "$seconds" "$@" >"$OUTDIR/$name.log" 2>&1
  local rc=$?
  echo "   -> exit $rc after $((SECONDS - start)) s" | tee -a "$OUTDIR/summary.txt"
  tail -n 25 "$OUTDIR/$name.log"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

: >"$OUTDIR/summary.txt"
if ! "$PY" -c 'import zarr' 2>/dev/null; then
  echo "zarr missing: installing from $WHEELS" | tee -a "$OUTDIR/summary.txt"
  step install 30 "$PY" -m pip install --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

step environment 15 "$PY" -c '
import torch, zarr, numcodecs, accelerate, torchvision
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
print("torchvision", torchvision.__version__, "zarr", zarr.__version__, "numcodecs", numcodecs.__version__,
      "accelerate", accelerate.__version__)
'
command -v nvidia-smi >/dev/null && nvidia-smi >"$OUTDIR/nvidia-smi.txt" 2>&1

step tests 90 "$PY" -m pytest -m cuda -q -p no:cacheprovider tests/test_cuda.py --junitxml="$OUTDIR/test_cuda.xml"

# --decode nvjpeg against the CPU path: pixels within 0.5 (mean 0.03) after normalization, stored
# features within 5% (tolerances documented in tests/test_cuda_decode.py); then nvjpeg img/s.
step nvjpeg 45 "$PY" -m pytest -m cuda -q -p no:cacheprovider tests/test_cuda_decode.py --junitxml="$OUTDIR/test_cuda_decode.xml"
step decode 40 "$PY" benchmarks/decode_throughput.py --small 240 --large 48 --repeats 2 --no-e2e --no-results \
  --workdir /tmp/extract-decode-bench --json "$OUTDIR/decode_throughput_cuda.json"

# resnet50 layer3+layer4, batch 256, bf16 autocast, channels_last; side-stream (HostStaging) vs
# compute-stream (value.to('cpu')) copies for (d) and (e); (f) is the CLI end to end.
step benchmark 110 "$PY" benchmarks/hook_overhead.py --model resnet50 --layers layer3 layer4 \
  --batch-size 256 --precision bf16 --channels-last --batches 8 --repeats 3 --warmup 2 \
  --copy both --cli-samples 2048 --workdir /tmp/extract-gpu-bench --json "$OUTDIR/hook_overhead_cuda.json"

# (e) alone with more writer threads: on a GPU the writer (encode + write on the CPU) is the limit.
step writer_threads 40 "$PY" benchmarks/hook_overhead.py --model resnet50 --layers layer3 layer4 \
  --batch-size 256 --precision bf16 --channels-last --batches 8 --repeats 2 --warmup 1 --variants be \
  --writer-threads 8 --no-micro --workdir /tmp/extract-gpu-bench --json "$OUTDIR/hook_overhead_cuda_writer8.json"

# timm and Hugging Face models through the CLI: CUDA bf16 vs CPU fp32 features, img/s. Needs timm and
# transformers importable (carry their wheels in $EXTRACT_WHEELS with zarr's; see benchmarks/README.md).
step sources 95 "$PY" benchmarks/gpu_sources.py --samples 2048 --compare 64 --json "$OUTDIR/gpu_sources.json"

# A per-token job of a GPT-2-width LM (transformer.h.1, context 128) on CUDA in bf16 against the fp32 CPU
# run of its first documents: token ids/offsets identical, rows within 5e-2 of their scale; tok/s.
step tokens 45 "$PY" benchmarks/gpu_tokens.py --tokens 50000 --compare-tokens 4096 \
  --workdir /tmp/extract-gpu-tokens --json "$OUTDIR/gpu_tokens.json"

step tokens_mapped 45 "$PY" benchmarks/gpu_tokens.py --device-map --tokens 20000 --compare-tokens 4096 \
  --workdir /tmp/extract-gpu-tokens --json "$OUTDIR/gpu_tokens_mapped.json"

# --tensor-parallel 2 over NCCL (one group of 2 GPUs, and 2 groups with 4 or more) against one GPU: gathered
# o_proj@input / down_proj@input and the residual within 1e-3 of scale, verify clean; skipped on one GPU.
step tensor_parallel 40 "$PY" benchmarks/gpu_tensor_parallel.py --workdir /tmp/extract-gpu-tp \
  --json "$OUTDIR/gpu_tensor_parallel.json"

step rss 45 "$PY" benchmarks/hook_overhead.py --rss-check --rss-n 256 2048 --batch-size 64 \
  --workdir /tmp/extract-gpu-rss --json "$OUTDIR/rss_cuda.json"

# Issue 45: the writer alone at width 8192 in bfloat16 (a 70B model's residual stream), its batches staged
# from the GPU (pinned slots, side-stream copies, the statistics of whole blocks computed on the device),
# with 1, 2, 4 and 8 writer threads, against zarr alone on the same rows: the GB/s one process sustains.
# A GPU that produces more per process than the writer's GB/s waits on it. (Adds 50 s to the sum above.)
step writer_gpu 50 "$PY" benchmarks/writer_cost.py --device cuda --variants zarr,writer --dtypes bfloat16 \
  --widths 8192 --threads 1 2 4 8 --repeats 1 --megabytes 512 --workdir /tmp/extract-writer-gpu \
  --json "$OUTDIR/writer_cost_cuda.json"
rm -rf /tmp/extract-writer-gpu

rm -rf /tmp/extract-gpu-tp /tmp/extract-gpu-bench /tmp/extract-gpu-rss /tmp/extract-decode-bench /tmp/extract-gpu-tokens
echo "logs and JSON in $OUTDIR" | tee -a "$OUTDIR/summary.txt"
exit "$status"
