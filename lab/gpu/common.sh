# Sourced by the device scripts: install the gguf wheel, assemble the target, unpack prompts.
set -euo pipefail
# Sourced once per call, and again by scripts started from it: install and assemble only once.
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/m /tmp/prompts
T=/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf  # the package's file name, which results show
if [ "${NEED_TARGET:-1}" = 1 ]; then  # NEED_TARGET=0: a script that never loads it (cuda_tests.sh)
  if [ -d .dev/b ] && [ ! -s $T ]; then cp .dev/b/* /tmp/m/; fi
  if [ ! -s $T ]; then cat /tmp/m/part_* > $T; fi
  sha=$(sha256sum $T | cut -c1-8)
  [ "$sha" = b179c952 ] || { echo "GGUF checksum $sha != b179c952"; exit 3; }
fi
# prompts.tgz, or prompts.txz (xz: 3.1 MB against 7.6, room for a GGUF part in one carry)
for f in .dev/p/prompts.tgz .dev/p/prompts.txz; do [ ! -f $f ] || tar xf $f -C /tmp/prompts; done
export DRAFTLING_SHARED_PROMPTS=/tmp/prompts
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || echo "no nvidia-smi"
subset_data() {  # subset_data DIR LOGDIR [ARGS]: gpu_smollm2's prompts, 200 per file, regenerated
  # by the target, and the vocab, once; for ddp_scaling.sh and train_fixed_cost.sh (same data)
  local d=$1 log=$2; shift 2
  [ ! -f $d/vocab.safetensors ] || return 0
  python3 -m draftling data --config lab/configs/gpu_smollm2.yaml --target $T --out $d data.max_prompts_per_file=200 "$@" 2>&1 \
    | grep --line-buffered -v "^regenerate: " | tee $log/data_log.txt
  python3 -m draftling vocab --data $d --config lab/configs/gpu_smollm2.yaml --target $T | tee -a $log/data_log.txt
  cp $d/summary.json $log/data_summary.json
}
