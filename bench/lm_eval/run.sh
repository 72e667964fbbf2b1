#!/usr/bin/env bash
# lm-evaluation-harness against `mrv2 serve`, by hand (not in CI: lm-eval is a large install):
# its `hf` model and its `local-completions` / `local-chat-completions` models on the same
# weights and two small local tasks (multiple-choice log-likelihoods; greedy chat generation).
# The scores must be equal, and the per-sample outputs are compared too.
#
#   bash bench/lm_eval/run.sh MODEL_DIR [LM_EVAL_PYTHON]
#
# MODEL_DIR: a Hugging Face directory (float32 weights). LM_EVAL_PYTHON: a python with
# `lm-eval[api]`, transformers and torch (default: python3). Results under /tmp/mrv2-lm-eval.
set -euo pipefail
MODEL="$(cd "$1" && pwd)"
PY="${2:-python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT=/tmp/mrv2-lm-eval
PORT="${PORT:-8123}"
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OPENAI_API_KEY=EMPTY
rm -rf "$OUT" && mkdir -p "$OUT"
cd "$HERE"  # the tasks read ./mc.jsonl and ./gen.jsonl
"$ROOT/scripts/env.sh" mrv2 serve "$MODEL" --port "$PORT" --served-model-name model \
    --max-model-len 2048 > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
until curl -sf "localhost:$PORT/health" >/dev/null; do sleep 2; done
run() { "$PY" -m lm_eval --include_path "$HERE" --log_samples "$@"; }
run --model hf --model_args "pretrained=$MODEL,dtype=float32" --device cpu --batch_size 1 \
    --tasks mrv2_local_mc --output_path "$OUT/hf_mc"
run --model local-completions --tasks mrv2_local_mc --output_path "$OUT/mrv2_mc" \
    --model_args "model=model,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$MODEL,num_concurrent=4"
run --model hf --model_args "pretrained=$MODEL,dtype=float32" --device cpu --batch_size 1 \
    --tasks mrv2_local_gen --apply_chat_template --output_path "$OUT/hf_gen"
run --model local-chat-completions --tasks mrv2_local_gen --apply_chat_template \
    --output_path "$OUT/mrv2_gen" \
    --model_args "model=model,base_url=http://127.0.0.1:$PORT/v1/chat/completions,num_concurrent=4"
"$PY" "$HERE/compare.py" "$OUT"
