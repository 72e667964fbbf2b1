#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, for a machine that has one (CI has none): the CUDA-marked
# tests, end-to-end tests that run on the default device (CUDA there) against transformers, and
# bench/gpu_e2e.py. Logs and JSON go to $OUT (default /tmp/gpu_check).
#
# Uses the machine's own python3 with torch and Triton; packages it lacks can be put as wheels
# in .whl/ (installed with --no-deps into /tmp/site).
set -u
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
unset TRITON_INTERPRET
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
PYTEST=(python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors -rfE
        --timeout 120 -W ignore::DeprecationWarning)
echo "== CUDA-marked tests"
# Only the files that carry the mark: the others may import server packages the machine lacks.
mapfile -t MARKED < <(grep -rlE "mark\.cuda" tests)
timeout "${T_MARKED:-150}" "${PYTEST[@]}" -m cuda "${MARKED[@]}" bench/test_sampler.py -n 4 2>&1 \
    | tee "$OUT/cuda_marked.log" | tail -60
echo "== end to end on the default device"
timeout "${T_E2E:-180}" "${PYTEST[@]}" -n 6 tests/entrypoints/test_llm.py tests/test_runner.py \
    tests/test_worker.py tests/entrypoints/test_llm_logprobs.py tests/entrypoints/test_beam_search.py \
    tests/entrypoints/test_llm_features.py tests/sampler 2>&1 | tee "$OUT/e2e.log" | tail -60
echo "== bench/gpu_e2e.py"
timeout "${T_BENCH:-150}" python3 bench/gpu_e2e.py --rounds "${ROUNDS:-3}" --json "$OUT/gpu_e2e.json" \
    2>&1 | tee "$OUT/gpu_e2e.log" | tail -30
