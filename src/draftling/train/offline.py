"""Offline teacher: run the target once over the prepared data, write its outputs to sharded
safetensors, and train later from those shards instead of recomputing the teacher per batch.

Layout of a cache directory::

    CACHE/manifest.json
    CACHE/train/shard_00000.safetensors   rows [0, shard_size) of train.jsonl
    CACHE/train/shard_00001.safetensors   ...
    CACHE/val/shard_00000.safetensors     (when the data dir has val.jsonl)

Each shard holds its sequences concatenated along tokens, unpadded:

    offsets        int64 [n_seq + 1]   sequence j is rows offsets[j]:offsets[j+1]
    example_index  int64 [n_seq]       row index in <split>.jsonl (as load_tokenized numbers them)
    target_argmax  int64 [N_tokens]    argmax over the FULL target vocab
    aux            [N_tokens, 3*H]     low/mid/high aux states, in the target's dtype
    draft_logits   [N_tokens, V_d]     target logits at the draft-vocab ids, in the target's
                                       compute dtype by default (lossless; bf16 for a bf16 target)
    in_draft       bool [N_tokens]

A shard is written to a temporary name beside it and renamed only when complete, so a kill
never leaves a half-written shard under a shard name; rerunning `extract` skips the shards
that exist and recomputes the rest. Shards are streamed to disk batch by batch (the header is
known up front from the token counts), so host memory stays at one batch, not one shard.

The cache is read back by train/offline_teacher.py's OfflineTeacher.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from draftling.config import ExtractConfig, RunConfig
from draftling.data.runs import check_one_run
from draftling.data.tokenized import load_tokenized
from draftling.draft.vocab import hash_dataset_file, load_vocab
from draftling.dtypes import CANONICAL, DTYPES, dtype_name
from draftling.errors import DataError
from draftling.faults import fault_point
from draftling.io import atomic_path, output_dir_in_use, write_json
from draftling.progress import Progress
from draftling.target.load import pin_cpu_layout
from draftling.train.dataset import collate
from draftling.train.settings import compile_teacher as resolve_compile_teacher
from draftling.train.teacher import teacher_forward

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64", torch.bool: "BOOL"}
_DTYPE_NAMES = {n: DTYPES[n] for n in CANONICAL}  # a cache's header names its dtype in full


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.safetensors"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in _DTYPE_NAMES:
        raise DataError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[name]


def bytes_per_token(hidden: int, aux_dtype: torch.dtype, draft_vocab: int, logits_dtype: torch.dtype) -> int:
    """aux (3*H) + draft_logits (V_d) + target_argmax (int64) + in_draft (bool)."""
    return 3 * hidden * _itemsize(aux_dtype) + draft_vocab * _itemsize(logits_dtype) + 8 + 1


class _ShardWriter:
    """Write a safetensors file whose tensor shapes are known in advance, filling the data
    region piecewise (seek + write) so a shard never has to sit in memory whole."""

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, list[int]]], metadata: dict[str, str]):
        header: dict = {}
        self.base: dict[str, int] = {}
        self.row_bytes: dict[str, int] = {}
        self.dtype: dict[str, torch.dtype] = {}
        off = 0
        for name, dtype, shape in specs:
            size = math.prod(shape) * _itemsize(dtype)
            header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [off, off + size]}
            self.base[name] = off
            self.row_bytes[name] = math.prod(shape[1:]) * _itemsize(dtype)
            self.dtype[name] = dtype
            off += size
        header["__metadata__"] = metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data region 8-byte aligned
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(raw)))
        self.f.write(raw)
        self.start = 8 + len(raw)
        self.f.truncate(self.start + off)

    def write(self, name: str, first_row: int, tensor: torch.Tensor) -> None:
        t = tensor.detach().to("cpu", self.dtype[name]).contiguous().reshape(-1)
        if t.numel() == 0:
            return
        self.f.seek(self.start + self.base[name] + first_row * self.row_bytes[name])
        self.f.write(t.view(torch.uint8).numpy().tobytes())

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def _shard_metadata(
    split: str, index: int, n_seq: int, n_tokens: int, data_hash: str, vocab_hash: str
) -> dict[str, str]:
    return {
        "format": str(FORMAT),
        "split": split,
        "shard": str(index),
        "num_sequences": str(n_seq),
        "num_tokens": str(n_tokens),
        "data_hash": data_hash,
        "vocab_data_hash": vocab_hash,
    }


def _shard_ok(path: Path, expected: dict[str, str]) -> bool:
    """A shard under its final name is complete by construction (atomic rename); also check
    it belongs to this data and vocab, so a foreign file is recomputed, not trusted."""
    if not path.is_file():
        return False
    try:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except Exception:  # unreadable: recompute it
        return False
    return meta == expected


def check_cache_dir(out_dir: Path) -> None:
    """A cache directory is new, empty, or an earlier extract's (which this run resumes)."""
    if output_dir_in_use(out_dir) and not (out_dir / MANIFEST).is_file():
        raise DataError(
            f"--out {out_dir}: not empty and not a cache written by `draftling extract`; choose "
            "an empty or new directory (nothing was changed)"
        )


@dataclass(frozen=True)
class ExtractOptions:
    """How ``extract`` runs: rows per shard and per teacher batch; ``dtype``, the storage dtype
    of draft_logits (None keeps the target's compute dtype, which is lossless);
    ``compile_teacher``, ``teacher_forward``'s ``compile`` (``from_config`` follows
    ``train.compile_teacher``: on for CUDA)."""

    shard_size: int = ExtractConfig.shard_size  # the config's defaults, as the CLI's
    batch_size: int = ExtractConfig.batch_size
    dtype: str | torch.dtype | None = None
    compile_teacher: bool | str = False

    def __post_init__(self):
        if self.shard_size < 1 or self.batch_size < 1:
            raise DataError(f"shard_size and batch_size must be >= 1 (got {self.shard_size}, {self.batch_size})")

    @classmethod
    def from_config(cls, cfg: RunConfig, target) -> ExtractOptions:
        """The options of ``cfg.extract`` (the CLI's flags set its keys), with the teacher
        compiled as the trainer's is (``train.compile_teacher``; auto: on CUDA)."""
        e = cfg.extract
        return cls(
            shard_size=e.shard_size,
            batch_size=e.batch_size,
            dtype=e.logits_dtype,
            compile_teacher=resolve_compile_teacher(cfg.train, target.device, target.model),
        )


@dataclass(frozen=True)
class _ShardLayout:
    """The per-token tensors' widths and dtypes, the same in every shard of a cache."""

    hidden: int
    aux_dtype: torch.dtype
    draft_vocab: int
    logits_dtype: torch.dtype

    def specs(self, n_seq: int, n_tok: int) -> list[tuple[str, torch.dtype, list[int]]]:
        return [
            ("offsets", torch.int64, [n_seq + 1]),
            ("example_index", torch.int64, [n_seq]),
            ("target_argmax", torch.int64, [n_tok]),
            ("aux", self.aux_dtype, [n_tok, 3 * self.hidden]),
            ("draft_logits", self.logits_dtype, [n_tok, self.draft_vocab]),
            ("in_draft", torch.bool, [n_tok]),
        ]

    def bytes_per_token(self) -> int:
        return bytes_per_token(self.hidden, self.aux_dtype, self.draft_vocab, self.logits_dtype)


@dataclass(frozen=True)
class _Extraction:
    """One extract run: what every shard is written with, and where."""

    target: object
    layout: _ShardLayout
    options: ExtractOptions
    out_dir: Path
    manifest: dict
    t2d: torch.Tensor
    echo: Callable[[str], None]
    progress: Progress  # over both splits' tokens; echoes each shard's line with the time left


@dataclass(frozen=True)
class _Shard:
    """Shard k of a split: its rows' indices, token counts and offsets."""

    ids: list[int]
    lens: list[int]
    offsets: list[int]

    @classmethod
    def of(cls, rows: list, k: int, shard_size: int) -> _Shard:
        ids = list(range(k * shard_size, min((k + 1) * shard_size, len(rows))))
        lens = [len(rows[i].input_ids) for i in ids]
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        return cls(ids, lens, offsets)


def extract(
    target,
    data_dir: str | Path,
    out_dir: str | Path,
    vocab_path: str | Path | None = None,
    options: ExtractOptions | None = None,
    *,
    echo=None,
    **option_fields,
) -> dict:
    """Run the teacher over <data_dir>/train.jsonl (and val.jsonl) and write the shards.

    ``option_fields``: ExtractOptions' fields by name (shard_size=..., dtype=...), over
    ``options``. Returns {"manifest", "written": {split: [shard ids]}, "skipped": {split:
    [shard ids]}, "estimate_bytes", "bytes"}.
    """
    options = dataclasses.replace(options or ExtractOptions(), **option_fields)
    echo = echo or log.info
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    check_cache_dir(out_dir)
    vocab_path = Path(vocab_path) if vocab_path else data_dir / "vocab.safetensors"
    files, examples = _read_splits(data_dir)
    hashes = {s: hash_dataset_file(files[s]) for s in examples}
    vocab = load_vocab(vocab_path, expect_data_hash=hashes["train"], target_vocab_size=target.config.vocab_size)
    layout = _layout(target, vocab, options)
    splits = _split_infos(files, hashes, examples, options.shard_size)
    manifest = _manifest(target, vocab, layout, options.shard_size, splits)
    resuming = (out_dir / MANIFEST).is_file()
    old = json.loads((out_dir / MANIFEST).read_text()) if resuming else {}
    # A resumed extract lays the target out as the first did (the layouts round differently).
    manifest["cpu_column_major"] = pin_cpu_layout(target, {target.model.dtype}, old.get("cpu_column_major", {}))
    if resuming:
        _resume(out_dir / MANIFEST, old, manifest)
    estimate = _echo_estimate(echo, splits, layout)

    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / MANIFEST, manifest)
    progress = Progress(sum(info["num_tokens"] for info in splits.values()), "extract", emit=echo, bar=False)
    run = _Extraction(target, layout, options, out_dir, manifest, vocab.t2d.to(target.device), echo, progress)
    written = {s: [] for s in splits}
    skipped = {s: [] for s in splits}
    for s, rows in examples.items():
        _extract_split(run, s, rows, written[s], skipped[s])
    actual = sum(p.stat().st_size for s in splits for p in (out_dir / s).glob("shard_*.safetensors"))
    echo(
        f"extract: done, {actual / 2**30:.2f} GiB in {out_dir} "
        f"({sum(map(len, written.values()))} shards written, {sum(map(len, skipped.values()))} "
        "already there)"
    )
    return {"manifest": manifest, "written": written, "skipped": skipped, "estimate_bytes": estimate, "bytes": actual}


def _layout(target, vocab, options: ExtractOptions) -> _ShardLayout:
    aux_dtype = target.output_head().weight.dtype
    return _ShardLayout(
        target.input_embeddings().weight.shape[1], aux_dtype, vocab.size, parse_dtype(options.dtype) or aux_dtype
    )


def _split_infos(files: dict[str, Path], hashes: dict, examples: dict[str, list], shard_size: int) -> dict:
    """The manifest's entry per split, before any shard is complete."""
    return {
        s: {
            "file": files[s].name,
            "data_hash": hashes[s],
            "num_examples": len(rows),
            "num_tokens": sum(len(e.input_ids) for e in rows),
            "num_shards": math.ceil(len(rows) / shard_size),
            "complete": [],
        }
        for s, rows in examples.items()
    }


def _read_splits(data_dir: Path) -> tuple[dict[str, Path], dict[str, list]]:
    """Each split's file (val's may not exist) and the rows of those that do."""
    files = {s: data_dir / f"{s}.jsonl" for s in SPLITS}
    check_one_run(*files.values())
    examples = {"train": load_tokenized(files["train"])}
    if files["val"].is_file():
        examples["val"] = load_tokenized(files["val"])
    return files, examples


# A cache is resumed only if these match; the splits' data hashes are checked one by one.
_MANIFEST_KEYS = (
    "format",
    "target",
    "aux_layer_ids",
    "hidden_size",
    "target_vocab_size",
    "draft_vocab_size",
    "vocab_data_hash",
    "aux_dtype",
    "logits_dtype",
    "shard_size",
)


def _manifest(target, vocab, layout: _ShardLayout, shard_size: int, splits: dict) -> dict:
    return {
        "format": FORMAT,
        "target": target.spec.name,
        "aux_layer_ids": list(target.aux_layer_ids),
        "hidden_size": int(layout.hidden),
        "target_vocab_size": int(target.config.vocab_size),
        "draft_vocab_size": vocab.size,
        "vocab_data_hash": vocab.data_hash,
        "aux_dtype": dtype_name(layout.aux_dtype),
        "logits_dtype": dtype_name(layout.logits_dtype),
        "shard_size": shard_size,
        "splits": splits,
    }


def _resume(manifest_path: Path, old: dict, manifest: dict) -> None:
    """Refuse an earlier extract's cache (its manifest ``old``, read from ``manifest_path``) made
    with other settings or data; take over the list of shards it completed."""
    out_dir = manifest_path.parent
    for key in _MANIFEST_KEYS:
        if old.get(key) != manifest[key]:
            raise DataError(
                f"{manifest_path}: this cache was extracted with {key}={old.get(key)!r}, "
                f"now {manifest[key]!r}; delete {out_dir} or choose another --out"
            )
    for s, info in manifest["splits"].items():
        prev = old.get("splits", {}).get(s)
        if prev is not None and prev.get("data_hash") != info["data_hash"]:
            raise DataError(
                f"{manifest_path}: {info['file']} changed since this cache was "
                f"extracted; delete {out_dir} or choose another --out"
            )
        if prev is not None:
            info["complete"] = sorted(int(i) for i in prev.get("complete", []))


def _echo_estimate(echo, splits: dict, layout: _ShardLayout) -> int:
    """The disk the shards will take, in bytes, said before the hours of extraction."""
    per_token = layout.bytes_per_token()
    tokens = sum(info["num_tokens"] for info in splits.values())
    n_seq = sum(info["num_examples"] for info in splits.values())
    estimate = tokens * per_token + 16 * n_seq
    aux, logits = dtype_name(layout.aux_dtype), dtype_name(layout.logits_dtype)
    logits_kb = layout.draft_vocab * _itemsize(layout.logits_dtype) / 1024
    echo(
        f"extract: estimated disk {estimate / 2**30:.2f} GiB ({estimate} bytes) = {tokens} tokens x "
        f"{per_token} bytes/token [aux 3x{layout.hidden} {aux}, draft_logits {layout.draft_vocab} "
        f"{logits} = {logits_kb:.1f} KB/token]; draft_logits dominate at a large "
        f"draft vocab (32000 x bf16 = 64 KB/token); top-k logit storage is not implemented yet"
    )
    return estimate


def _extract_split(run: _Extraction, split: str, rows: list, written: list, skipped: list) -> None:
    """Write the split's missing shards (appending their ids to ``written``, the others' to
    ``skipped``), marking each complete in the manifest as it is done."""
    info = run.manifest["splits"][split]
    split_dir = run.out_dir / split
    split_dir.mkdir(parents=True, exist_ok=True)
    for tmp in split_dir.glob(".shard_*.tmp"):  # left by a killed run; never a shard
        tmp.unlink()
    for k in range(info["num_shards"]):
        shard = _Shard.of(rows, k, run.options.shard_size)
        meta = _shard_metadata(
            split, k, len(shard.ids), shard.offsets[-1], info["data_hash"], run.manifest["vocab_data_hash"]
        )
        path = split_dir / shard_name(k)
        if _shard_ok(path, meta):
            skipped.append(k)
            run.progress.skip(shard.offsets[-1])
        else:
            t0 = time.perf_counter()
            _write_shard(path, meta, rows, shard, run)
            written.append(k)
            run.progress.update(
                shard.offsets[-1],
                f"extract {split} shard {k + 1}/{info['num_shards']}: "
                f"{len(shard.ids)} sequences, {shard.offsets[-1]} tokens, "
                f"{time.perf_counter() - t0:.1f}s",
            )
        if k not in info["complete"]:
            info["complete"] = sorted(info["complete"] + [k])
            write_json(run.out_dir / MANIFEST, run.manifest)


def _write_shard(path: Path, meta: dict[str, str], rows: list, shard: _Shard, run: _Extraction) -> None:
    lens, offsets, ids = shard.lens, shard.offsets, shard.ids
    target, batch_size = run.target, run.options.batch_size
    with atomic_path(path) as tmp:
        w = _ShardWriter(tmp, run.layout.specs(len(ids), offsets[-1]), meta)
        try:
            w.write("offsets", 0, torch.tensor(offsets, dtype=torch.int64))
            w.write("example_index", 0, torch.tensor(ids, dtype=torch.int64))
            order = sorted(range(len(ids)), key=lambda j: lens[j])  # less padding per batch
            for b in range(0, len(order), batch_size):
                js = [j for j in order[b : b + batch_size] if lens[j] > 0]
                if not js:
                    continue
                batch = collate([rows[ids[j]] for j in js], target.tokenizer.pad_token_id)
                tb = teacher_forward(
                    target,
                    batch["input_ids"].to(target.device),
                    batch["attention_mask"].to(target.device),
                    run.t2d,
                    compile=run.options.compile_teacher,
                )
                for r, j in enumerate(js):
                    a, n = offsets[j], lens[j]
                    w.write("aux", a, tb.aux[r, :n])
                    w.write("draft_logits", a, tb.draft_logits[r, :n])
                    w.write("target_argmax", a, tb.target_argmax[r, :n])
                    w.write("in_draft", a, tb.in_draft[r, :n])
            fault_point("extract.shard")
        finally:
            w.close()
