#!/usr/bin/env bash
# GPU checks for extract, one script: CUDA tests + the hook/throughput benchmarks on the GPU.
#
#   bash benchmarks/gpu_check.sh [OUTDIR]             (default: $OUT, else ./gpu-check)
#   bash benchmarks/gpu_check.sh --dry-run [OUTDIR]   (any machine: shows that every step starts)
#
# Expects Python 3.12 with torch (CUDA) and accelerate. Where a module a step imports is missing
# (benchmarks/check_imports.py), installs the wheels in $EXTRACT_WHEELS (default .whl; the list is in
# benchmarks/README.md) into /tmp/site without the network.
# Fails (exit 1) without a CUDA device: nothing here would check the GPU. Every step has a timeout of at
# most 60 s, and the whole run a budget of $GPU_CHECK_BUDGET seconds (590): a step the budget cannot
# start is reported as not run, and fails the check.
#
# --dry-run: no CUDA needed. pytest steps collect their tests (--collect-only), a script with a CPU mode
# runs it (`--device cpu` where it has one) and the others print their --help; each for at most 60 s
# (one still running then has started: past its imports and its arguments). What it shows: every step's
# command starts, and what it imports is there.
set -uo pipefail

cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY=1
  shift
fi
OUTDIR="${1:-${OUT:-$PWD/gpu-check}}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
PY="${PYTHON:-python}"
export PY
export PYTHONUNBUFFERED=1  # a step cut by its timeout still shows how far it got
WHEELS="${EXTRACT_WHEELS:-.whl}"
BUDGET="${GPU_CHECK_BUDGET:-590}"
export EXTRACT_GPU_CHECK_OUT="$OUTDIR"  # where tests record measured deviations (deviations.jsonl)
status=0

# step NAME SECONDS [--dry ARG... --] CMD...: run CMD with a timeout (at most what is left of the budget),
# log to $OUTDIR/NAME.log, remember a failure. Under --dry-run: pytest (or cuda_tests.sh) collects only; a
# script runs with the --dry arguments instead of its own where given (after the program and the script),
# else with --help.
step() {
  local name=$1 seconds=$2
  shift 2
  local dry=()
  if [ "${1:-}" = "--dry" ]; then
    shift
    while [ "$1" != "--" ]; do dry+=("$1"); shift; done
    shift
  fi
  if [ "$DRY" = 1 ]; then
    seconds=60
    if [[ " $* " == *" -m pytest "* || " $* " == *"cuda_tests.sh "* ]]; then
      set -- env EXTRACT_REQUIRE_CUDA=0 "$@" --collect-only
    elif [ "${#dry[@]}" -gt 0 ]; then
      set -- "$1" "$2" "${dry[@]}"
    else
      set -- "$1" "$2" --help
    fi
  fi
  local left=$((BUDGET - SECONDS))
  if [ "$DRY" = 0 ] && [ "$left" -lt 10 ]; then
    echo "== $name: NOT RUN, the ${BUDGET}s budget is spent" | tee -a "$OUTDIR/summary.txt"
    status=1
    return 1
  fi
  [ "$DRY" = 0 ] && [ "$seconds" -gt "$left" ] && seconds=$left
  echo "== $name (timeout ${seconds}s): $*" | tee -a "$OUTDIR/summary.txt"
  local start=$SECONDS
  timeout --kill-after=10 "$seconds" "$@" >"$OUTDIR/$name.log" 2>&1
  local rc=$?
  if [ "$DRY" = 1 ] && [ "$rc" -eq 124 ]; then  # still running at the cut: past its imports and arguments
    echo "   -> started; still running when the dry run cut it after $((SECONDS - start)) s" | tee -a "$OUTDIR/summary.txt"
    tail -n 5 "$OUTDIR/$name.log"
    return 0
  fi
  echo "   -> exit $rc after $((SECONDS - start)) s" | tee -a "$OUTDIR/summary.txt"
  tail -n 25 "$OUTDIR/$name.log"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

: >"$OUTDIR/summary.txt"
[ "$DRY" = 1 ] && echo "DRY RUN: each step only shown to start" | tee -a "$OUTDIR/summary.txt"
# no CUDA: said at once, before the imports' check (a minute of imports); a torch that does not import goes on
# to that check, which names it
if [ "$DRY" = 0 ] && [ "$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null)" = 0 ]; then
  echo "gpu_check: no CUDA device (torch.cuda.is_available() is False): nothing here would check the GPU;" \
    "--dry-run shows that every step starts" | tee -a "$OUTDIR/summary.txt"
  exit 1
fi
if ! "$PY" benchmarks/check_imports.py >/dev/null 2>&1 && compgen -G "$WHEELS/*.whl" >/dev/null; then
  echo "modules missing (benchmarks/check_imports.py): installing the wheels in $WHEELS" | tee -a "$OUTDIR/summary.txt"
  step install 60 "$PY" -m pip install --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

step environment 30 "$PY" benchmarks/check_imports.py
command -v nvidia-smi >/dev/null && nvidia-smi >"$OUTDIR/nvidia-smi.txt" 2>&1
if [ "$DRY" = 0 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device (torch.cuda.is_available() is False): nothing here would check the GPU;" \
    "--dry-run shows that every step starts" | tee -a "$OUTDIR/summary.txt"
  exit 1
fi

# -- issue 49: the GPU paths as a GPU runs them ------------------------------------------------------------
# The CUDA tests go through benchmarks/cuda_tests.sh: no pytest-xdist needed, and no CUDA is a failure.
# Pinned-slot reuse, side-stream copy ordering, the in-place ReLU hazard, event waits in the writer.
step tests 45 bash benchmarks/cuda_tests.sh tests/test_cuda.py -k "not full_pipeline and not fp32_as_users" \
  --junitxml="$OUTDIR/test_cuda.xml"

# record_stream held behind a sleep on the copy stream (and the same check seeing the corruption without it);
# float16 overflow refused on the device, the model's own inf kept; the writer thread's device; --sae
# statistics in pinned memory with the slot; a text batch up from pinned memory, its mask once.
step staging 45 bash benchmarks/cuda_tests.sh tests/test_cuda_paths.py \
  -k "record_stream or overflow or writer_thread or sae_statistics or block_statistics or text_batch" --junitxml="$OUTDIR/test_cuda_staging.xml"

# resnet18 through the CLI's runner on CUDA against the CPU float32 reference: fp32 (TF32 off) and bf16
# compute; float16 and bfloat16 storage, NCHW and channels_last.
step pipeline 60 bash benchmarks/cuda_tests.sh tests/test_cuda.py -k "full_pipeline" \
  --junitxml="$OUTDIR/test_cuda_pipeline.xml"

# --precision fp32 as users get it (torch's defaults: TF32 convolutions): the deviation from the CPU goes to
# $OUTDIR/deviations.jsonl.
step tf32 40 bash benchmarks/cuda_tests.sh tests/test_cuda.py -k "fp32_as_users" -s \
  --junitxml="$OUTDIR/test_cuda_tf32.xml"

# nvjpeg: sums queued behind a sleep over freed blocks of the decoded images' size must survive the decode;
# EXIF orientations 6, 8 and 3 under --exif-transpose as the PIL path turns them.
step nvjpeg_race 45 bash benchmarks/cuda_tests.sh tests/test_cuda_paths.py -k "nvjpeg" \
  --junitxml="$OUTDIR/test_cuda_nvjpeg_race.xml"

# The tensor-parallel stop flag over NCCL: a world of 1 and a group of 1.
step stop_flag 30 bash benchmarks/cuda_tests.sh tests/test_cuda_paths.py -k "stop_flag" \
  --junitxml="$OUTDIR/test_cuda_stop_flag.xml"

# --tensor-parallel 2 over NCCL (one group of 2 GPUs, and 2 groups with 4 or more) against one GPU: gathered
# o_proj@input / down_proj@input and the residual within 1e-3 of scale, verify clean, and each process on its
# own GPU only (nvidia-smi --query-compute-apps); skipped on one GPU.
step tensor_parallel 60 --dry --workdir /tmp/extract-gpu-tp -- "$PY" benchmarks/gpu_tensor_parallel.py --workdir /tmp/extract-gpu-tp \
  --json "$OUTDIR/gpu_tensor_parallel.json"

# --sae on CUDA against the same job on the CPU: latents, values and each chunk's statistics.
step sae 60 --dry --device cpu --documents 8 --workdir /tmp/extract-gpu-sae -- \
  "$PY" benchmarks/gpu_sae.py --workdir /tmp/extract-gpu-sae --json "$OUTDIR/gpu_sae.json"

# -- the decode, the benchmarks and the sources --------------------------------------------------------------
# --decode nvjpeg against the CPU path: pixels within 0.5 (mean 0.03) after normalization, stored
# features within 5% (tolerances documented in tests/test_cuda_decode.py); then nvjpeg img/s.
step nvjpeg 45 bash benchmarks/cuda_tests.sh tests/test_cuda_decode.py --junitxml="$OUTDIR/test_cuda_decode.xml"
step decode 40 --dry --small 4 --large 1 --repeats 1 --no-e2e --no-results \
  --workdir /tmp/extract-decode-bench -- \
  "$PY" benchmarks/decode_throughput.py --small 240 --large 48 --repeats 2 --no-e2e --no-results \
  --workdir /tmp/extract-decode-bench --json "$OUTDIR/decode_throughput_cuda.json"

# resnet50 layer3+layer4, batch 256, bf16 autocast, channels_last; side-stream (HostStaging) vs
# compute-stream (value.to('cpu')) copies for (d) and (e); (f) is the CLI end to end.
step benchmark 60 --dry --device cpu --model resnet18 --image-size 32 --batch-size 4 \
  --batches 1 --repeats 1 --warmup 0 --cli-samples 8 --workdir /tmp/extract-gpu-bench -- \
  "$PY" benchmarks/hook_overhead.py --model resnet50 --layers layer3 layer4 \
  --batch-size 256 --precision bf16 --channels-last --batches 8 --repeats 2 --warmup 2 \
  --copy both --cli-samples 1024 --workdir /tmp/extract-gpu-bench --json "$OUTDIR/hook_overhead_cuda.json"

# (e) alone with more writer threads: on a GPU the writer (encode + write on the CPU) is the limit.
step writer_threads 40 --dry --device cpu --model resnet18 --image-size 32 \
  --batch-size 4 --batches 1 --repeats 1 --warmup 0 --variants be --writer-threads 2 --no-micro -- \
  "$PY" benchmarks/hook_overhead.py --model resnet50 --layers layer3 layer4 \
  --batch-size 256 --precision bf16 --channels-last --batches 8 --repeats 2 --warmup 1 --variants be \
  --writer-threads 8 --no-micro --workdir /tmp/extract-gpu-bench --json "$OUTDIR/hook_overhead_cuda_writer8.json"

# timm and Hugging Face models through the CLI: CUDA bf16 vs CPU fp32 features, img/s.
step sources 60 "$PY" benchmarks/gpu_sources.py --samples 1024 --compare 64 --json "$OUTDIR/gpu_sources.json"

# A per-token job of a GPT-2-width LM (transformer.h.1, context 128) on CUDA in bf16 against the fp32 CPU
# run of its first documents: token ids/offsets identical, rows within 5e-2 of their scale; tok/s.
step tokens 45 --dry --device cpu --tokens 200 --compare-tokens 100 \
  --workdir /tmp/extract-gpu-tokens -- \
  "$PY" benchmarks/gpu_tokens.py --tokens 50000 --compare-tokens 4096 \
  --workdir /tmp/extract-gpu-tokens --json "$OUTDIR/gpu_tokens.json"

step tokens_mapped 45 --dry --device cpu --device-map --tokens 200 --compare-tokens 100 \
  --workdir /tmp/extract-gpu-tokens -- \
  "$PY" benchmarks/gpu_tokens.py --device-map --tokens 20000 --compare-tokens 4096 \
  --workdir /tmp/extract-gpu-tokens --json "$OUTDIR/gpu_tokens_mapped.json"

# Expert parallel (issue 48): a Qwen3-MoE under --tensor-parallel 2 over NCCL, its experts split over the
# group (transformers' expert plan, all-to-all dispatch), against one GPU: residual, MoE block output and
# gathered heads within 1e-3 of scale, router logits within 1e-3, the same top-k experts for >= 99% of
# tokens, each rank <= 0.52 of the parameter bytes; 2 groups of 2 with 4 GPUs; skipped on one GPU.
step expert_parallel 40 --dry --workdir /tmp/extract-gpu-ep -- "$PY" benchmarks/gpu_expert_parallel.py \
  --workdir /tmp/extract-gpu-ep --json "$OUTDIR/gpu_expert_parallel.json"
rm -rf /tmp/extract-gpu-ep

# Issue 45: the writer alone at width 8192 in bfloat16 (a 70B model's residual stream), its batches staged
# from the GPU (pinned slots, side-stream copies, the statistics of whole blocks computed on the device),
# with 1, 2, 4 and 8 writer threads, against zarr alone on the same rows: the GB/s one process sustains.
# A GPU that produces more per process than the writer's GB/s waits on it.
step writer_gpu 50 --dry --device cpu --variants zarr,writer --dtypes bfloat16 --widths 8192 --threads 1 2 \
  --repeats 1 --megabytes 16 --workdir /tmp/extract-writer-gpu -- \
  "$PY" benchmarks/writer_cost.py --device cuda --variants zarr,writer --dtypes bfloat16 \
  --widths 8192 --threads 1 2 4 8 --repeats 1 --megabytes 512 --workdir /tmp/extract-writer-gpu \
  --json "$OUTDIR/writer_cost_cuda.json"
rm -rf /tmp/extract-writer-gpu

step rss 45 --dry --device cpu --rss-check --rss-n 16 32 --batch-size 8 -- \
  "$PY" benchmarks/hook_overhead.py --rss-check --rss-n 256 2048 --batch-size 64 \
  --workdir /tmp/extract-gpu-rss --json "$OUTDIR/rss_cuda.json"

rm -rf /tmp/extract-gpu-tp /tmp/extract-gpu-bench /tmp/extract-gpu-rss /tmp/extract-decode-bench /tmp/extract-gpu-tokens \
  /tmp/extract-gpu-sae
echo "logs and JSON in $OUTDIR ($SECONDS s)" | tee -a "$OUTDIR/summary.txt"
exit "$status"
