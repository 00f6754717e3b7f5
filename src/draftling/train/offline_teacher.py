"""The reading side of an offline teacher cache (train/offline.py writes it and documents its
layout): teacher outputs read back from the shards, in the shape of TeacherCache.get."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftling.errors import DataError
from draftling.train.offline import FORMAT, MANIFEST, parse_dtype, shard_name
from draftling.train.teacher import TeacherBatch


class OfflineTeacher:
    """Teacher outputs read back from an `extract` cache, in the shape of TeacherCache.get.

    Shards are memory-mapped on first use (safetensors safe_open) and only the rows of the
    requested examples are read. ``vocab_hash`` is the draft vocab's data hash and
    ``data_hash`` the hash of this split's jsonl; both are checked against the manifest.
    A TeacherSource; ``cacheable`` is False: the cache already holds the final outputs.
    """

    cacheable = False

    def __init__(
        self, cache_dir: str | Path, split: str = "train", vocab_hash: str | None = None, data_hash: str | None = None
    ):
        self.dir = Path(cache_dir)
        self.split = split
        self.manifest_path = self.dir / MANIFEST
        if not self.manifest_path.is_file():
            raise DataError(f"{self.manifest_path}: no offline teacher cache here (run `draftling extract` first)")
        try:
            m = json.loads(self.manifest_path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{self.manifest_path}: unreadable manifest: {e}") from None
        if m.get("format") != FORMAT:
            raise DataError(
                f"{self.manifest_path}: cache format {m.get('format')!r}, expected {FORMAT}; re-run `draftling extract`"
            )
        info = m.get("splits", {}).get(split)
        if info is None:
            raise DataError(f"{self.manifest_path}: no {split!r} split in this cache")
        if vocab_hash is not None and m.get("vocab_data_hash") != vocab_hash:
            raise DataError(
                f"{self.manifest_path}: stale offline cache: it was extracted with a vocab built "
                f"from different data (hash {str(m.get('vocab_data_hash'))[:12]} != "
                f"{vocab_hash[:12]}); re-run `draftling extract` into a fresh directory"
            )
        if data_hash is not None and info.get("data_hash") != data_hash:
            raise DataError(
                f"{self.manifest_path}: stale offline cache: {info.get('file')} changed since "
                "extraction; re-run `draftling extract` into a fresh directory"
            )
        missing = sorted(set(range(info["num_shards"])) - set(info.get("complete", [])))
        if missing:
            raise DataError(
                f"{self.manifest_path}: extraction of {split!r} is incomplete "
                f"({len(missing)} of {info['num_shards']} shards missing); re-run "
                "`draftling extract` to finish it"
            )
        self.manifest = m
        self.info = info
        self.shard_size = int(m["shard_size"])
        self.aux_dtype = parse_dtype(m["aux_dtype"])
        self.aux_width = 3 * int(m["hidden_size"])
        self.draft_vocab = int(m["draft_vocab_size"])
        self._shards: dict[int, tuple] = {}

    def __repr__(self) -> str:
        return f"OfflineTeacher({str(self.dir)!r}, split={self.split!r})"

    def for_split(self, split: str, data_hash: str | None = None) -> OfflineTeacher | None:
        """The same cache's other split (e.g. val), or None when it was not extracted."""
        if split not in self.manifest.get("splits", {}):
            return None
        return OfflineTeacher(self.dir, split, self.manifest.get("vocab_data_hash"), data_hash)

    def check_target(self, target) -> None:
        """Refuse a cache made with other aux layers or another hidden size than `target`."""
        m = self.manifest
        hidden = target.input_embeddings().weight.shape[1]
        if list(m.get("aux_layer_ids", [])) != list(target.aux_layer_ids) or m.get("hidden_size") != hidden:
            raise DataError(
                f"{self.manifest_path}: cache was extracted from {m.get('target')!r} with aux "
                f"layers {m.get('aux_layer_ids')} and hidden size {m.get('hidden_size')}; this "
                f"target has aux layers {list(target.aux_layer_ids)} and hidden size {hidden}"
            )

    def _shard(self, k: int):
        if k not in self._shards:
            from safetensors import safe_open

            path = self.dir / self.split / shard_name(k)
            if not path.is_file():
                raise DataError(f"{path}: shard missing from the offline cache; re-run `draftling extract`")
            f = safe_open(str(path), "pt")
            offsets = f.get_tensor("offsets").tolist()
            index = f.get_tensor("example_index").tolist()
            slices = {n: f.get_slice(n) for n in ("aux", "draft_logits", "target_argmax", "in_draft")}
            self._shards[k] = (path, f, offsets, index, slices)
        return self._shards[k]

    def rows(self, key: int) -> tuple[Path, dict, int, int]:
        if not 0 <= key < self.info["num_examples"]:
            raise DataError(
                f"{self.manifest_path}: example {key} is outside the {self.split!r} split "
                f"({self.info['num_examples']} examples)"
            )
        k, j = divmod(key, self.shard_size)
        path, _, offsets, index, slices = self._shard(k)
        if index[j] != key:
            raise DataError(f"{path}: row {j} holds example {index[j]}, expected {key}; the cache is corrupt")
        return path, slices, offsets[j], offsets[j + 1]

    def get(self, keys: list[int], lengths: list[int], device) -> TeacherBatch:
        t = max(lengths)
        b = len(keys)
        aux = torch.zeros(b, t, self.aux_width, dtype=self.aux_dtype)
        logits = torch.zeros(b, t, self.draft_vocab, dtype=torch.float32)
        argmax = torch.zeros(b, t, dtype=torch.long)
        in_draft = torch.zeros(b, t, dtype=torch.bool)
        for i, (key, n) in enumerate(zip(keys, lengths)):
            path, sl, start, end = self.rows(key)
            if end - start != n:
                raise DataError(
                    f"{path}: example {key} has {end - start} tokens in the cache but {n} in "
                    "the data; the cache is stale, re-run `draftling extract`"
                )
            if n == 0:
                continue
            aux[i, :n] = sl["aux"][start:end]
            logits[i, :n] = sl["draft_logits"][start:end]
            argmax[i, :n] = sl["target_argmax"][start:end]
            in_draft[i, :n] = sl["in_draft"][start:end]
        return TeacherBatch(
            aux=aux.to(device),
            draft_logits=logits.to(device),
            target_argmax=argmax.to(device),
            in_draft=in_draft.to(device),
        )
