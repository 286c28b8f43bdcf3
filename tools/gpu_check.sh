#!/usr/bin/env bash
# The one prepared GPU check, for one CUDA GPU in under 8 minutes, run blind in one shot:
#   1. the CUDA-only tests (draws equal CPU's; steps never wait for the device),
#   2. `prunepipe bench throughput` at a realistic size in bf16 (MAE ViT-B/16 at 224 px, the base
#      latent-diffusion UNet on 4x32x32 latents), project loop against a bare loop,
#   3. kill-and-resume exactness on CUDA with InfoBatch on: final weights, EMA and pruner state,
#   4. gradient all-reduces per optimizer step with grad_accum 4 under DDP on NCCL (world size 1, then
#      two processes sharing the one GPU, which NCCL may refuse: reported either way),
#   5. parallel.strategy=fsdp at world 1 through the loop, and `bench memory`'s prediction beside
#      torch.cuda.max_memory_allocated for DiT-XL/2 and MAE ViT-L/16 (memory.jsonl),
# then writes docs/gpu.md (and everything under $OUT when set).
# Usage: tools/gpu_check.sh            (on the GPU machine)
#        tools/gpu_check.sh --cpu-smoke (every step at the smallest size on a CPU; writes only under $OUT)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
SMOKE=0
if [ "${1:-}" = "--cpu-smoke" ]; then SMOKE=1; fi
OUT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
START=$(date +%s)
say() { echo "[gpu_check $(( $(date +%s) - START ))s] $*"; }
export HF_HUB_OFFLINE=1

if [ "$SMOKE" = 1 ]; then
  SIZE=smoke; PASSES=2; REPEATS=1; BENCH_SIZE=(data.batch_size=16); RESUME_SIZE=(num_passes=2 data.batch_size=32 mae.embed_dim=32 mae.depth=1
    mae.num_heads=2 mae.decoder_embed_dim=32 mae.decoder_depth=1 mae.decoder_num_heads=2)
  REPORT="$OUT_DIR/gpu.md"
else
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: use --cpu-smoke')"
  SIZE=gpu; PASSES=3; REPEATS=2; BENCH_SIZE=(); RESUME_SIZE=(num_passes=4)
  REPORT=docs/gpu.md
fi
say "python $("$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")')"

say "1/5 CUDA-only tests"
set +e
timeout 180 "$PY" -m pytest -q -m "not slow" -k cuda tests/test_randomness.py tests/test_deferred_updates.py \
  tests/test_text_features.py \
  > "$OUT_DIR/cuda_tests.log" 2>&1
TESTS_RC=$?
set -e
TESTS=$(tail -n 1 "$OUT_DIR/cuda_tests.log")
say "tests (exit $TESTS_RC): $TESTS"

say "2/5 throughput, size $SIZE"
timeout 330 "$PY" -m prunepipe.launch.cli bench throughput --task all --size "$SIZE" --passes "$PASSES" \
  --repeats "$REPEATS" --json "$OUT_DIR/throughput.json" "${BENCH_SIZE[@]}" > "$OUT_DIR/throughput.log" 2>&1 \
  || say "throughput FAILED (exit $?)"
grep -E "repeat|project/bare" "$OUT_DIR/throughput.log" || tail -n 20 "$OUT_DIR/throughput.log"

say "3/5 kill-and-resume with InfoBatch (weights, EMA, pruner)"
DATA="$OUT_DIR/digits"
[ -f "$DATA/train/index.json" ] || "$PY" -m prunepipe.launch.cli shards write --out "$DATA" > /dev/null
timeout 240 "$PY" -m prunepipe.tools.benchmarks.resume_check configs/mae_tiny_infobatch.yaml --out "$OUT_DIR/resume" \
  --json "$OUT_DIR/resume.json" "data.train=$DATA/train" "data.val=$DATA/val" "${RESUME_SIZE[@]}" \
  > "$OUT_DIR/resume.log" 2>&1 || { cat "$OUT_DIR/resume.log"; say "resume check FAILED"; }
say "resume: $(grep -o '"bitwise_equal": [a-z]*' "$OUT_DIR/resume.json" || echo 'no verdict')"

say "4/5 gradient all-reduces per optimizer step, grad_accum 4"
set +e
timeout 120 "$PY" -m prunepipe.tools.benchmarks.allreduce_count --grad-accum 4 --micro-batches 10 --json "$OUT_DIR/allreduce.json" \
  > "$OUT_DIR/allreduce.log" 2>&1
ALLREDUCE_RC=$?
# two ranks on one device: gloo on a CPU; on a GPU, NCCL usually refuses two ranks on one device
timeout 120 "$PY" -m torch.distributed.run --nproc-per-node=2 --master-addr=127.0.0.1 --master-port=29517 \
  -m prunepipe.tools.benchmarks.allreduce_count --grad-accum 4 --micro-batches 10 --json "$OUT_DIR/allreduce_two.json" \
  > "$OUT_DIR/allreduce_two.log" 2>&1
echo $? > "$OUT_DIR/allreduce_two.rc"
set -e
say "all-reduce count: $(grep -o '"one_bucket_set_per_step": [a-z]*' "$OUT_DIR/allreduce.json" || echo 'no verdict') (exit $ALLREDUCE_RC);" \
  "two processes: exit $(cat "$OUT_DIR/allreduce_two.rc")"

say "5/5 fsdp at world 1 (the tiny DiT through the loop), bench memory's prediction beside the measured peak"
timeout 150 "$PY" -m prunepipe.launch.cli train configs/ldm_dit_tiny_infobatch.yaml "data.train=$DATA/train" \
  "data.val=$DATA/val" parallel.strategy=fsdp num_passes=2 "runs_dir=$OUT_DIR/runs" name=fsdp1 > "$OUT_DIR/fsdp1.log" 2>&1 \
  && say "fsdp world 1: $(grep -E '^pass 2/2' "$OUT_DIR/fsdp1.log" | tail -n 1)" || { tail -n 20 "$OUT_DIR/fsdp1.log"; say "fsdp world 1 FAILED"; }
timeout 150 "$PY" -m prunepipe.launch.cli bench memory --presets "DiT-XL/2 256 px" "MAE ViT-L/16 224 px" \
  --measure "${MEMORY_BATCH:-16}" > "$OUT_DIR/memory.jsonl" 2> "$OUT_DIR/memory.log" || say "memory measurement FAILED"
cat "$OUT_DIR/memory.jsonl"

"$PY" -m prunepipe.tools.benchmarks.gpu_report --throughput "$OUT_DIR/throughput.json" --resume "$OUT_DIR/resume.json" \
  --allreduce "$OUT_DIR/allreduce.json" --allreduce-two "$OUT_DIR/allreduce_two.json" \
  --allreduce-two-log "$OUT_DIR/allreduce_two.log" \
  --tests "$TESTS (exit $TESTS_RC)" --command "tools/gpu_check.sh${1:+ $1}" --seconds $(( $(date +%s) - START )) \
  --out "$REPORT"
[ "$REPORT" = "$OUT_DIR/gpu.md" ] || cp "$REPORT" "$OUT_DIR/gpu.md"
say "done: $REPORT"
# the report holds what every step gave; the exit status says whether each step held
FAILED=()
[ "$TESTS_RC" = 0 ] || [ "$TESTS_RC" = 5 ] || FAILED+=("CUDA tests")  # 5: every test deselected or skipped (a CPU)
[ -s "$OUT_DIR/throughput.json" ] || FAILED+=("throughput")
grep -q '"bitwise_equal": true' "$OUT_DIR/resume.json" 2>/dev/null || FAILED+=("resume")
grep -q '"one_bucket_set_per_step": true' "$OUT_DIR/allreduce.json" 2>/dev/null || FAILED+=("all-reduce count")
[ ${#FAILED[@]} = 0 ] || { say "FAILED: ${FAILED[*]}"; exit 1; }
grep -q '"one_bucket_set_per_step": true' "$OUT_DIR/allreduce.json"
