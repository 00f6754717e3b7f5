"""Move a trained draft between device calls: a device call returns files of at most 16 MiB.

    python lab/gpu/draft_transport.py pack DRAFT_DIR OUT_DIR     # bf16, split in parts
    python lab/gpu/draft_transport.py unpack PARTS_DIR DRAFT_DIR

The weights travel in bfloat16 (the engine runs the draft in the target's dtype anyway);
the vocab maps keep their integer and bool dtypes.
"""

import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PART = 15 * 2**20
WEIGHTS, CONFIG = "draft.safetensors", "draft_config.json"


def pack(draft_dir: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(str(draft_dir / WEIGHTS)).items()
    }
    tmp = out / "weights.tmp"
    save_file(state, str(tmp))
    data = tmp.read_bytes()
    tmp.unlink()
    for i in range(0, len(data), PART):
        (out / f"part_{i // PART:02d}").write_bytes(data[i : i + PART])
    shutil.copy(draft_dir / CONFIG, out / CONFIG)


def unpack(parts: Path, draft_dir: Path) -> None:
    draft_dir.mkdir(parents=True, exist_ok=True)
    data = b"".join(p.read_bytes() for p in sorted(parts.glob("part_*")))
    (draft_dir / WEIGHTS).write_bytes(data)
    shutil.copy(parts / CONFIG, draft_dir / CONFIG)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("pack", "unpack"):
        sys.exit(__doc__)
    (pack if sys.argv[1] == "pack" else unpack)(Path(sys.argv[2]), Path(sys.argv[3]))
