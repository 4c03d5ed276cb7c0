#!/usr/bin/env bash
# `make demo`: batch decoding of the committed prompts with HiSparse on, then one streamed
# request through the gRPC server. Uses the embedded default model (generated on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
mkdir -p out

echo "== 1. batch decoding: examples/prompts.jsonl (3 public-domain passages, 237-337 tokens each with BOS)"
echo "   HiSparse: top_k 32, hot buffer 64 slots/request/layer, host pool 4x the device rows"
$PY -m hisparse_jax.generate --prompts examples/prompts.jsonl --max-new-tokens 24 \
    --enable-hisparse --output out/demo_outputs.jsonl
$PY - <<'PYEOF'
import json
total = 0
for i, line in enumerate(open("out/demo_outputs.jsonl")):
    r = json.loads(line)
    total += r["misses"]
    print(f"   prompt {i}: {r['prompt_tokens']} tokens -> {len(r['output_ids'])} new tokens, "
          f"swap-in hits {r['hits']}, misses {r['misses']}")
    print(f"     text: {r['text'][:100]!r}")
assert total > 0, "expected swap-in misses: the prompts are longer than the hot buffer"
print(f"   total misses: {total} (> 0: rows really came from the host pool)")
PYEOF

echo "== 2. gRPC server + streaming client"
$PY run_server.py --enable-hisparse --port 0 > out/demo_server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 240); do
  PORT=$(sed -n 's/.*listening on 127.0.0.1:\([0-9]*\).*/\1/p' out/demo_server.log)
  [ -n "$PORT" ] && break
  kill -0 $SERVER 2>/dev/null || { cat out/demo_server.log; exit 1; }
  sleep 0.5
done
[ -n "$PORT" ] || { echo "server did not start"; cat out/demo_server.log; exit 1; }
echo "   server up on port $PORT"
PROMPT=$(head -n 2 examples/prompts.jsonl | tail -n 1 | $PY -c 'import json,sys; print(json.load(sys.stdin)["text"])')
$PY -m hisparse_jax.serving.client --target 127.0.0.1:$PORT --wait-for-ready-s 60 --max-new-tokens 24 \
    --text "$PROMPT" | tee out/demo_client.txt
grep -q "swap_in_misses=[1-9]" out/demo_client.txt || { echo "expected misses > 0"; exit 1; }
kill -TERM $SERVER
status=0; wait $SERVER || status=$?
trap - EXIT
[ $status -eq 0 ] || { echo "server exited with status $status"; tail -5 out/demo_server.log; exit 1; }
echo "   server stopped cleanly (SIGTERM -> exit 0)"
echo "== demo done: outputs in out/demo_outputs.jsonl, server log in out/demo_server.log"
