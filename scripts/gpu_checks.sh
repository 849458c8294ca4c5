#!/usr/bin/env bash
# The GPU checks in one run on a CUDA machine: the `gpu` tests, then W8A8 fp8 and CUDA-graph
# benchmarks on random-weight models of real shapes; logs and JSON go to $OUT.
# Each part has its own time limit, so one that hangs leaves the others their time.
set -u
OUT=${OUT:-/tmp/kiln-gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# Packages the machine lacks, as wheels in .whl (git-ignored; README's Tests section).
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
TESTS_S=${TESTS_S:-210} BENCH_S=${BENCH_S:-90} PROMPTS=${PROMPTS:-32} LEN=${LEN:-128}

{ nvidia-smi -L; nproc; python3 -c "import torch, transformers; print('torch', torch.__version__,
  'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"; } 2>&1 \
  | tee "$OUT/env.txt"

timeout -s INT "$TESTS_S" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu \
  --durations=12 2>&1 | tee "$OUT/gpu_tests.log"

# Random weights in the shapes of SmolLM2-135M (the default model) and Llama-3.2-1B.
mk() {  # dir hidden inter layers heads kv_heads vocab tie
  mkdir -p "$1" && cat >"$1/config.json" <<JSON
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": $2,
 "intermediate_size": $3, "num_hidden_layers": $4, "num_attention_heads": $5,
 "num_key_value_heads": $6, "vocab_size": $7, "tie_word_embeddings": $8,
 "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
 "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
JSON
}
mk /tmp/smollm2-shape 576 1536 30 9 3 49152 true
mk /tmp/llama1b-shape 2048 8192 16 32 8 128256 true
bench() {  # name args...
  local name=$1; shift
  timeout -s INT "$BENCH_S" python3 -m kiln.entrypoints.cli.main bench "$@" --load-format dummy \
    --skip-tokenizer-init --dtype bfloat16 --max-model-len 1024 >"$OUT/$name.json" \
    2>"$OUT/$name.log"
  echo "== $name (rc $?)"; tail -c 1500 "$OUT/$name.json"
  grep -E "Error|error" "$OUT/$name.log" | tail -5
}
# BENCHES picks which run, in order (all by default).
for b in ${BENCHES:-fp8_1b ptpc_fp8_1b graphs_smol}; do
  case $b in
    fp8_1b|ptpc_fp8_1b)
      bench "throughput_$b" throughput --model /tmp/llama1b-shape --quantization "${b%_1b}" \
        --compare-unquantized --rounds 3 --kv-cache-memory 16 --num-prompts "$PROMPTS" \
        --input-len "$LEN" --output-len "$LEN" ;;
    graphs_smol)
      bench latency_smol_graphs latency --model /tmp/smollm2-shape --batch-sizes 1 32 \
        --input-len 32 --num-steps 32 --compare '{"mode":3,"cudagraph_mode":"NONE"}' \
        '{"mode":3,"cudagraph_mode":"FULL_AND_PIECEWISE"}' ;;
  esac
done
