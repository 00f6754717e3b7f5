# Sourced by the device scripts: install the gguf wheel, assemble the target, unpack prompts.
set -euo pipefail
# Sourced once per call, and again by scripts started from it: install and assemble only once.
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/m /tmp/prompts
if [ -d .dev/b ] && [ ! -s /tmp/m/smol.gguf ]; then cp .dev/b/* /tmp/m/; fi
if [ ! -s /tmp/m/smol.gguf ]; then cat /tmp/m/part_* > /tmp/m/smol.gguf; fi
sha=$(sha256sum /tmp/m/smol.gguf | cut -c1-8)
[ "$sha" = b179c952 ] || { echo "GGUF checksum $sha != b179c952"; exit 3; }
if [ -f .dev/p/prompts.tgz ]; then tar xzf .dev/p/prompts.tgz -C /tmp/prompts; fi
export DRAFTLING_SHARED_PROMPTS=/tmp/prompts
T=/tmp/m/smol.gguf
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || echo "no nvidia-smi"
