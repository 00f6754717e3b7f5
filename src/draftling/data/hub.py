"""Prompt conversations from a dataset loaded through the Hugging Face ``datasets`` library.

Specs (see docs/datasets.md):
  hf:NAME[:CONFIG][@SPLIT]   ``datasets.load_dataset(NAME, CONFIG, split=SPLIT)``, SPLIT "train"
                             by default (slices such as ``train[:1000]`` pass through)
  a folder                   ``datasets.load_from_disk(folder)``: a Dataset, or a DatasetDict
                             whose "train" split (or only split) is used

The shape is detected once per dataset from its columns:
  conversations   ShareGPT: turns of {"from", "value"}, or {"role", "content"} as SpecForge writes
  messages        OpenAI messages: turns of {"role", "content"} (HuggingFaceH4/ultrachat_200k)
  data            UltraChat (stingning/ultrachat): strings alternating user, assistant, ...
Rows are then parsed by the same helpers as jsonl files (data/prompts.py).

``datasets`` is an optional dependency (``pip install 'draftling[hf]'``): it is imported only here,
inside functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draftling.data.prompts import (
    Conversation,
    _build_conversation,
    _parse_messages,
    _parse_sharegpt,
    _with_system,
)
from draftling.errors import ConfigError, DataError, one_line

HF_PREFIX = "hf:"
INSTALL_HINT = "pip install 'draftling[hf]'"
DEFAULT_SPLIT = "train"
SPEC_SYNTAX = "hf:NAME[:CONFIG][@SPLIT]"

# Files ``save_to_disk`` writes: a Dataset has both of the first two, a DatasetDict the third.
DATASET_FILES = ("dataset_info.json", "state.json")
DATASET_DICT_FILE = "dataset_dict.json"

# The column that holds the turns, in the order they are looked for (``messages`` first, as
# for jsonl lines), and the name of each shape in messages.
SHAPES = {"messages": "OpenAI", "conversations": "ShareGPT", "data": "UltraChat"}
ID_COLUMNS = ("id", "prompt_id", "conversation_id")


@dataclass(frozen=True)
class HubSpec:
    name: str
    config: str | None
    split: str

    def __str__(self) -> str:
        config = f":{self.config}" if self.config else ""
        return f"{HF_PREFIX}{self.name}{config}@{self.split}"


def parse_hf_spec(spec: str, key: str | None = None) -> HubSpec:
    """``hf:NAME[:CONFIG][@SPLIT]`` -> HubSpec; a ConfigError (prefixed with ``key``) if malformed."""
    where = f"{key}: {spec}" if key else spec
    if not spec.startswith(HF_PREFIX):
        raise ConfigError(f"{where}: not a dataset spec (expected {SPEC_SYNTAX})")
    body, at, split = spec[len(HF_PREFIX) :].partition("@")
    name, colon, config = body.partition(":")
    problem = None
    if not name.strip():
        problem = "the dataset NAME is empty"
    elif colon and not config.strip():
        problem = "the CONFIG after ':' is empty"
    elif ":" in config:
        problem = "more than one ':' before the '@'"
    elif at and not split.strip():
        problem = "the SPLIT after '@' is empty"
    elif any(c.isspace() for c in name + config):
        problem = "NAME and CONFIG cannot contain spaces"
    if problem:
        raise ConfigError(
            f"{where}: bad dataset spec: {problem}; expected {SPEC_SYNTAX}, "
            "e.g. hf:HuggingFaceH4/ultrachat_200k@train_sft"
        )
    return HubSpec(name=name, config=config or None, split=split if at else DEFAULT_SPLIT)


def _import_datasets(where: str):
    """The ``datasets`` module, or a one-line ConfigError naming the extra to install."""
    try:
        import datasets
    except ImportError as e:
        if e.name not in (None, "datasets"):  # datasets is there but one of its own imports fails
            raise ConfigError(
                f"{where}: the datasets library failed to import ({e}); reinstall it: {INSTALL_HINT}"
            ) from None
        raise ConfigError(f"{where}: needs the datasets library: {INSTALL_HINT}") from None
    return datasets


def _folder_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a ``save_to_disk`` output, or None if it looks like one."""
    if (folder / DATASET_DICT_FILE).is_file():
        return None
    if all((folder / f).is_file() for f in DATASET_FILES):
        return None
    return (
        f"folder {folder} is not a dataset written by datasets' save_to_disk: expected "
        f"{' and '.join(DATASET_FILES)} (a Dataset) or {DATASET_DICT_FILE} (a DatasetDict) in it"
    )


def check_dataset_spec(spec: str, key: str) -> None:
    """Fail early, with one line naming ``key`` and ``spec``, if ``spec`` cannot load: bad ``hf:``
    syntax, a folder that is not a ``save_to_disk`` output, or no ``datasets`` library."""
    where = f"{key}: {spec}"
    if spec.startswith(HF_PREFIX):
        parse_hf_spec(spec, key)
    else:
        problem = _folder_problem(Path(spec))
        if problem:
            raise ConfigError(f"{key}: {problem}")
    _import_datasets(where)
    if spec.startswith(HF_PREFIX):
        from draftling.network import hub_unreachable

        why = hub_unreachable()
        if why and why != "HF_HUB_OFFLINE is set":  # offline mode reads datasets' own cache
            raise DataError(
                f"{where}: the Hugging Face hub is out of reach: {why} (to read a cached copy, set HF_HUB_OFFLINE=1)"
            )


def load_dataset_conversations(spec: str) -> list[Conversation]:
    """The conversations in the dataset that ``spec`` names (``hf:...`` or a folder)."""
    if spec.startswith(HF_PREFIX):
        hub = parse_hf_spec(spec)
        datasets = _import_datasets(spec)
        try:
            ds = datasets.load_dataset(hub.name, hub.config, split=hub.split)
        except Exception as e:  # not found, no network, unknown split or config, ...
            raise DataError(f"{hub}: cannot load the dataset: {one_line(e)}") from None
        if not isinstance(ds, datasets.Dataset):
            raise DataError(f"{hub}: load_dataset gave a {type(ds).__name__}, not a Dataset")
        return dataset_conversations(ds, label=str(hub), name=hub.name, split=hub.split)

    folder = Path(spec)
    problem = _folder_problem(folder)
    if problem:
        raise DataError(problem)
    datasets = _import_datasets(spec)
    try:
        ds = datasets.load_from_disk(str(folder))
    except Exception as e:
        raise DataError(f"{spec}: cannot load the saved dataset: {one_line(e)}") from None
    name = folder.resolve().name
    label = spec
    split = ds.split if isinstance(ds, datasets.Dataset) else None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if DEFAULT_SPLIT in ds:
            split = DEFAULT_SPLIT
        elif len(splits) == 1:
            split = splits[0]
        else:
            raise DataError(
                f"{spec}: a DatasetDict with splits {splits} and none named "
                f"'{DEFAULT_SPLIT}'; save the split you want on its own, e.g. "
                f"dd['{splits[0]}'].save_to_disk(...)"
            )
        ds = ds[split]
        label = f"{spec} (split {split})"
    return dataset_conversations(ds, label=label, name=name, split=str(split) if split else None)


def _list_item(feature):
    """The item feature of a list-typed column (List, Sequence, LargeList or ``[item]``), else None."""
    if isinstance(feature, (list, tuple)):
        return feature[0] if len(feature) == 1 else None
    if type(feature).__name__ in ("List", "Sequence", "LargeList"):
        return getattr(feature, "feature", None)
    return None


def _turn_keys(feature) -> set[str] | None:
    """The keys of a turn in a list-of-turns column, from its features, or None if unknown."""
    item = _list_item(feature)
    if isinstance(item, dict):
        return set(item)
    if isinstance(feature, dict):  # a Sequence of structs is stored as a struct of lists
        return set(feature)
    return None


def _detect_shape(ds, label: str) -> tuple[str, str]:
    """(column, turn style) for the dataset: style is "sharegpt" (from/value turns), "messages"
    (role/content turns), "auto" (decided per row: the features do not say) or "ultrachat"."""
    columns = list(ds.column_names)
    column = next((c for c in SHAPES if c in columns), None)
    if column is None:
        raise DataError(
            f"{label}: unknown dataset shape: columns {columns}; expected a "
            "'conversations' (ShareGPT), 'messages' (OpenAI) or 'data' (UltraChat) column"
        )
    feature = (ds.features or {}).get(column)
    if column == "data":
        item = _list_item(feature)
        if feature is not None and not (
            type(item).__name__ == "Value" and str(getattr(item, "dtype", "")) in ("string", "large_string")
        ):
            raise DataError(
                f"{label}: the 'data' column is {feature}, not a list of strings "
                f"(UltraChat: user, assistant, user, ...); columns {columns}"
            )
        return column, "ultrachat"
    if column == "messages":
        return column, "messages"
    keys = _turn_keys(feature)
    if keys is None or ({"from", "value"} & keys and {"role", "content"} & keys):
        return column, "auto"  # both kinds of turn in one dataset: look at each row
    if {"from", "value"} & keys:
        return column, "sharegpt"
    if {"role", "content"} & keys:
        return column, "messages"
    raise DataError(
        f"{label}: the 'conversations' turns have keys {sorted(keys)}; expected "
        "'from'/'value' (ShareGPT) or 'role'/'content' (OpenAI-style)"
    )


def _turn_list(turns):
    """A column's turns as a list of dicts: a struct of lists is transposed, and None fields
    (keys that other rows have: Arrow fills them in) are dropped. Anything else is returned as it
    is, for the parsers to reject with a message."""
    if isinstance(turns, dict) and turns and all(isinstance(v, list) for v in turns.values()):
        keys = list(turns)
        turns = [dict(zip(keys, values)) for values in zip(*turns.values())]
    if isinstance(turns, list):
        return [{k: v for k, v in t.items() if v is not None} if isinstance(t, dict) else t for t in turns]
    return turns


def _ultrachat_turns(data, where: str) -> list[dict]:
    if not isinstance(data, list) or not data:
        raise DataError(f"{where}: missing or empty 'data' list")
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(data)]


def _row_messages(row: dict, column: str, style: str, where: str) -> list[dict]:
    turns = row.get(column)
    if style == "ultrachat":
        return _parse_messages(_ultrachat_turns(turns, where), where)
    turns = _turn_list(turns)
    if style == "auto":
        first = turns[0] if isinstance(turns, list) and turns else None
        style = "sharegpt" if isinstance(first, dict) and "from" in first else "messages"
    if style == "sharegpt":
        return _parse_sharegpt(turns, where)
    if not isinstance(turns, list) or not turns:  # name the column the turns came from
        raise DataError(f"{where}: missing or empty '{column}' list")
    return _parse_messages(turns, where)


def dataset_conversations(ds, label: str, name: str, split: str | None) -> list[Conversation]:
    """Every row of a ``datasets.Dataset`` as a Conversation.

    ``label`` names the dataset in messages (a bad row is ``"{label} row N"``, N from 0); ``name``
    is the default source; ids default to ``"{name}:{split}:{N}"`` (``"{name}:{N}"`` without a split).
    """
    column, style = _detect_shape(ds, label)
    drop = set(SHAPES) | set(ID_COLUMNS)
    convs = []
    index = 0
    for batch in ds.with_format(None).iter(batch_size=1000):
        keys = list(batch)
        for values in zip(*batch.values()):
            row = dict(zip(keys, values))
            where = f"{label} row {index}"
            messages = _with_system(_row_messages(row, column, style, where), row.get("system"))
            conv_id = next((row[c] for c in ID_COLUMNS if row.get(c) not in (None, "")), None)
            if conv_id is None:
                conv_id = f"{name}:{split}:{index}" if split else f"{name}:{index}"
            record = {k: v for k, v in row.items() if k not in drop and v is not None}
            record["id"] = conv_id
            convs.append(_build_conversation(record, messages, name, index, where))
            index += 1
    return convs
