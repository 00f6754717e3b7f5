#!/usr/bin/env bash
# Device call (one GPU): the tests that skip without CUDA (CUDA graphs on both engine paths,
# bf16 identity, flex's backward; then compile with graphs, the slow ones). Writes
# $OUT/cuda-tests/{log.txt,graphs.xml,compile.xml}. TESTS_S caps each half's wall time (300 s);
# HALVES picks them (default: graphs compile). One call, nothing carried but .whl.
NEED_TARGET=${NEED_TARGET:-0} source lab/gpu/common.sh  # tiny random models: no GGUF staged
dir=$OUT/cuda-tests
mkdir -p $dir
FILES="tests/engine/test_architectures.py tests/engine/test_engine.py tests/train/test_train_memory.py"
for half in "graphs:(cuda or host_sync or bf16_padded) and not compile_and" "compile:compile_and"; do
  [[ " ${HALVES:-graphs compile} " == *" ${half%%:*} "* ]] || continue
  timeout ${TESTS_S:-300} python3 -m pytest -q -rs -p no:cacheprovider --durations=10 \
    --junitxml=$dir/${half%%:*}.xml $FILES -k "${half#*:}" 2>&1 | tee -a $dir/log.txt || true
done
