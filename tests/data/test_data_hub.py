"""Prompt conversations from ``datasets`` datasets (data/hub.py): hf:NAME[:CONFIG][@SPLIT] specs and
save_to_disk folders. No network: the hub path is tested with ``datasets.load_dataset`` patched to
return a dataset built here."""

import json
import sys

import pytest

datasets = pytest.importorskip("datasets")

from draftling.config import load_config  # noqa: E402
from draftling.data.hub import check_dataset_spec, parse_hf_spec  # noqa: E402
from draftling.data.prepare import load_prompt_files  # noqa: E402
from draftling.data.prompts import prompt_messages  # noqa: E402
from draftling.data.sources import check_prompt_files, check_prompt_spec, load_prompt_spec  # noqa: E402
from draftling.errors import ConfigError, DataError  # noqa: E402

HINT = "pip install 'draftling[hf]'"


def saved(tmp_path, rows_or_ds, name="mydata"):
    """A folder written by save_to_disk (rows become a Dataset)."""
    ds = datasets.Dataset.from_list(rows_or_ds) if isinstance(rows_or_ds, list) else rows_or_ds
    folder = tmp_path / name
    ds.save_to_disk(str(folder))
    return folder


@pytest.fixture
def fake_hub(monkeypatch):
    """serve(ds) makes datasets.load_dataset return ds; returns the list of calls (name, config, split)."""
    calls = []

    def serve(ds):
        if isinstance(ds, list):
            ds = datasets.Dataset.from_list(ds)

        def load_dataset(path, name=None, *args, split=None, **kwargs):
            calls.append((path, name, split))
            return ds

        monkeypatch.setattr(datasets, "load_dataset", load_dataset)
        monkeypatch.setattr("draftling.network.hub_unreachable", lambda: None)  # the hub is "up"
        return calls

    return serve


def turns(conv):
    return [(m["role"], m["content"]) for m in conv.messages]


# Each accepted shape: rows, and per row (id or None for the default id, source or None for the
# default source, the turns expected).
SHAPES = {
    "sharegpt": (
        [
            {
                "id": "s1",
                "system": "be kind",
                "source": None,
                "tools": '[{"name": "w"}]',
                "conversations": [
                    {"from": "human", "value": "hi"},
                    {"from": "gpt", "value": "hello"},
                    {"from": "human", "value": "bye"},
                ],
            },
            {
                "id": "s2",
                "system": "",
                "source": "web",
                "tools": None,
                "conversations": [
                    {"from": "system", "value": "S"},
                    {"from": "user", "value": "q"},
                    {"from": "observation", "value": "{}"},
                ],
            },
        ],
        [
            ("s1", None, [("system", "be kind"), ("user", "hi"), ("assistant", "hello"), ("user", "bye")]),
            ("s2", "web", [("system", "S"), ("user", "q"), ("tool", "{}")]),
        ],
    ),
    "sharegpt_role_content": (  # SpecForge's ShareGPT: role/content turns under 'conversations'
        [
            {
                "conversations": [
                    {"role": "system", "content": "sys"},
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                ]
            },
            {"conversations": [{"role": "user", "content": "c"}]},
        ],
        [(None, None, [("system", "sys"), ("user", "a"), ("assistant", "b")]), (None, None, [("user", "c")])],
    ),
    "openai_messages": (  # HuggingFaceH4/ultrachat_200k's columns
        [
            {
                "prompt": "p1",
                "prompt_id": "abc",
                "messages": [{"role": "user", "content": "p1"}, {"role": "assistant", "content": "r1"}],
            },
            {
                "prompt": "p2",
                "prompt_id": "def",
                "messages": [{"role": "developer", "content": "dev"}, {"role": "user", "content": "p2"}],
            },
        ],
        [("abc", None, [("user", "p1"), ("assistant", "r1")]), ("def", None, [("system", "dev"), ("user", "p2")])],
    ),
    "ultrachat_data": (  # stingning/ultrachat's columns
        [{"id": "0", "data": ["u1", "a1", "u2", "a2"]}, {"id": "1", "data": ["only"]}],
        [
            ("0", None, [("user", "u1"), ("assistant", "a1"), ("user", "u2"), ("assistant", "a2")]),
            ("1", None, [("user", "only")]),
        ],
    ),
}


@pytest.mark.parametrize("loader", ["folder", "hf"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_shape_loads(tmp_path, fake_hub, shape, loader):
    rows, expected = SHAPES[shape]
    if loader == "folder":
        convs = load_prompt_spec(str(saved(tmp_path, rows)))
        default_id, default_source = "mydata:{}", "mydata"
    else:
        calls = fake_hub(rows)
        convs = load_prompt_spec("hf:org/mydata")
        assert calls == [("org/mydata", None, "train")]
        default_id, default_source = "org/mydata:train:{}", "org/mydata"
    assert len(convs) == len(expected)
    for i, (conv, (conv_id, source, want)) in enumerate(zip(convs, expected)):
        assert conv.id == (conv_id if conv_id is not None else default_id.format(i))
        assert conv.source == (source or default_source)
        assert conv.category == "unknown"
        assert turns(conv) == want
    if shape == "sharegpt":
        assert convs[0].tools == [{"name": "w"}] and convs[1].tools is None
    if shape == "openai_messages":
        assert convs[0].meta == {"prompt": "p1"}  # prompt_id went to the id, not to meta
        assert turns(convs[0])[-1][0] == "assistant" and prompt_messages(convs[0]) == [
            {"role": "user", "content": "p1"}
        ]


def test_id_and_category_columns(tmp_path):
    rows = [
        {"id": None, "conversation_id": "c-7", "category": "math", "messages": [{"role": "user", "content": "1+1?"}]},
        {"id": "x", "conversation_id": "c-8", "category": None, "messages": [{"role": "user", "content": "2+2?"}]},
    ]
    a, b = load_prompt_spec(str(saved(tmp_path, rows)))
    assert (a.id, a.category) == ("c-7", "math")
    assert (b.id, b.category) == ("x", "unknown")


def test_mixed_turn_styles_and_tool_calls(tmp_path):
    # Arrow gives every turn every key (None where a row lacked it); the None fields must not
    # reach the messages, and each row keeps its own turn style.
    rows = [
        {"conversations": [{"from": "human", "value": "hi"}]},
        {
            "conversations": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{}"}}],
                },
                {"role": "tool", "content": "sunny"},
            ]
        },
    ]
    a, b = load_prompt_spec(str(saved(tmp_path, rows)))
    assert a.messages == [{"role": "user", "content": "hi"}]
    assert [m["role"] for m in b.messages] == ["user", "assistant", "tool"]
    assert b.messages[0] == {"role": "user", "content": "weather?"}
    assert b.messages[1]["content"] == "" and b.messages[1]["tool_calls"][0]["function"]["name"] == "w"


def test_sequence_of_structs_column(tmp_path):
    # A Sequence of dicts is stored (and read back) as a dict of lists.
    feats = datasets.Features(
        {"conversations": datasets.Sequence({"from": datasets.Value("string"), "value": datasets.Value("string")})}
    )
    ds = datasets.Dataset.from_dict(
        {"conversations": [{"from": ["human", "gpt"], "value": ["q", "a"]}]}, features=feats
    )
    (conv,) = load_prompt_spec(str(saved(tmp_path, ds)))
    assert turns(conv) == [("user", "q"), ("assistant", "a")]


@pytest.mark.parametrize(
    "spec, call, default_id",
    [
        ("hf:a/b", ("a/b", None, "train"), "a/b:train:0"),
        ("hf:a/b:cfg", ("a/b", "cfg", "train"), "a/b:train:0"),
        ("hf:a/b@test", ("a/b", None, "test"), "a/b:test:0"),
        ("hf:a/b:cfg@validation", ("a/b", "cfg", "validation"), "a/b:validation:0"),
        ("hf:a/b@train[:10]", ("a/b", None, "train[:10]"), "a/b:train[:10]:0"),
    ],
)
def test_hf_spec_parsing(fake_hub, spec, call, default_id):
    calls = fake_hub([{"messages": [{"role": "user", "content": "q"}]}])
    check_prompt_spec(spec)
    (conv,) = load_prompt_spec(spec)
    assert calls == [call]
    assert conv.id == default_id and conv.source == "a/b"
    assert (parse_hf_spec(spec).name, parse_hf_spec(spec).config, parse_hf_spec(spec).split) == call


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("hf:", "NAME is empty"),
        ("hf:@train", "NAME is empty"),
        ("hf:a/b:", "CONFIG after ':' is empty"),
        ("hf:a/b@", "SPLIT after '@' is empty"),
        ("hf:a:b:c", "more than one ':'"),
    ],
)
def test_bad_hf_spec(spec, needle):
    with pytest.raises(ConfigError) as e:
        check_prompt_spec(spec, "data.exclude")
    msg = str(e.value)
    assert msg.startswith(f"data.exclude: {spec}: bad dataset spec") and needle in msg
    assert "hf:NAME[:CONFIG][@SPLIT]" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "columns, needle",
    [
        ({"text": ["t"], "label": [0]}, "columns ['text', 'label']"),
        ({"data": ["just a string"]}, "the 'data' column is"),
    ],
)
def test_unknown_shape(fake_hub, columns, needle):
    fake_hub(datasets.Dataset.from_dict(columns))
    with pytest.raises(DataError) as e:
        load_prompt_spec("hf:x/y")
    msg = str(e.value)
    assert msg.startswith("hf:x/y@train: ") and needle in msg
    if "text" in columns:
        assert msg == (
            "hf:x/y@train: unknown dataset shape: columns ['text', 'label']; expected a "
            "'conversations' (ShareGPT), 'messages' (OpenAI) or 'data' (UltraChat) column"
        )


def test_bad_row_names_spec_and_row(tmp_path, fake_hub):
    good = {"conversations": [{"from": "human", "value": "q"}]}
    bad = {"conversations": [{"from": "robot", "value": "beep"}]}
    fake_hub([good, good, bad])
    with pytest.raises(DataError) as e:
        load_prompt_spec("hf:x/y")
    assert str(e.value).startswith("hf:x/y@train row 2: unknown role 'robot' in message 1")

    folder = saved(tmp_path, [{"data": ["q", "a"]}, {"data": []}])
    with pytest.raises(DataError, match=r"mydata row 1: missing or empty 'data' list"):
        load_prompt_spec(str(folder))
    folder = saved(tmp_path, [{"messages": [{"role": "assistant", "content": "a"}]}], "noq")
    with pytest.raises(DataError, match=r"noq row 0: conversation has no user turn"):
        load_prompt_spec(str(folder))


def test_load_dataset_failure_is_one_line(monkeypatch):
    def load_dataset(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'x/y' on the Hub\n(offline mode is enabled)")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(DataError) as e:
        load_prompt_spec("hf:x/y:c@test")
    assert str(e.value) == (
        "hf:x/y:c@test: cannot load the dataset: ConnectionError: Couldn't "
        "reach 'x/y' on the Hub (offline mode is enabled)"
    )


def test_missing_datasets_names_the_extra(tmp_path, monkeypatch):
    folder = saved(tmp_path, [{"messages": [{"role": "user", "content": "q"}]}])
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ConfigError) as e:
        check_prompt_spec("hf:foo/bar")
    assert str(e.value) == f"data.prompts: hf:foo/bar: needs the datasets library: {HINT}"
    with pytest.raises(ConfigError, match=rf"data.exclude: {folder}: needs the datasets library"):
        check_dataset_spec(str(folder), "data.exclude")
    with pytest.raises(ConfigError, match=r"hf:foo/bar: needs the datasets library: pip install"):
        load_prompt_spec("hf:foo/bar")


def test_folder_that_is_not_a_saved_dataset(tmp_path):
    folder = tmp_path / "jsonl_files"
    folder.mkdir()
    (folder / "a.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError) as e:
        check_prompt_spec(str(folder))
    msg = str(e.value)
    assert msg.startswith(f"data.prompts: folder {folder} is not a dataset written by datasets' save_to_disk")
    assert "dataset_dict.json" in msg and "state.json" in msg
    with pytest.raises(DataError, match="save_to_disk"):
        load_prompt_spec(str(folder))


def test_dataset_dict_folder_picks_train(tmp_path):
    def one(text):
        return datasets.Dataset.from_list([{"messages": [{"role": "user", "content": text}]}])

    folder = saved(tmp_path, datasets.DatasetDict({"test": one("from test"), "train": one("from train")}))
    check_prompt_spec(str(folder))
    (conv,) = load_prompt_spec(str(folder))
    assert turns(conv) == [("user", "from train")] and conv.id == "mydata:train:0"

    folder = saved(tmp_path, datasets.DatasetDict({"validation": one("only")}), "single")
    (conv,) = load_prompt_spec(str(folder))
    assert turns(conv) == [("user", "only")] and conv.id == "single:validation:0"

    folder = saved(tmp_path, datasets.DatasetDict({"a": one("1"), "b": one("2")}), "two")
    with pytest.raises(DataError, match=r"splits \['a', 'b'\] and none named 'train'"):
        load_prompt_spec(str(folder))


def test_load_prompt_files_end_to_end(tmp_path):
    rows = [
        {
            "id": f"r{i}",
            "conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}],
        }
        for i in range(4)
    ]
    folder = saved(tmp_path, rows)
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"id": "r1", "messages": [{"role": "user", "content": "x"}]}) + "\n")
    cfg = load_config(None, [f"data.prompts=[{folder}]", f"data.exclude=[{held}]"])
    assert cfg.data.prompts == [str(folder)]
    check_prompt_files(cfg)
    convs, excluded = load_prompt_files(cfg)
    assert excluded == 1
    assert [c.id for c in convs] == ["r0", "r2", "r3"]
    assert [turns(c)[0] for c in convs] == [("user", "question 0"), ("user", "question 2"), ("user", "question 3")]
    assert {c.source for c in convs} == {"mydata"}


def test_an_unreachable_hub_fails_at_once_naming_the_spec(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused at once
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(DataError, match=r"hf:a/b.*hub is out of reach.*127.0.0.1:9.*HF_HUB_OFFLINE=1"):
        check_prompt_spec("hf:a/b")


def test_exclude_ids_keeps_a_replay_set_out_of_training(tmp_path):
    """data.exclude_ids (`data --exclude-ids FILE`): ids one per line or as jsonl rows."""
    from draftling.data.prepare import read_id_file

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "messages": [{"role": "user", "content": f"q {i}"}]}) + "\n" for i in range(5)
        )
    )
    (tmp_path / "ids.txt").write_text("t1  # the replay set\n\n# a comment line\nt3\n")
    (tmp_path / "ids.jsonl").write_text(json.dumps({"id": "t4"}) + "\n")
    cfg = load_config(
        None, [f"data.prompts=[{prompts}]", f"data.exclude_ids=[{tmp_path / 'ids.txt'}, {tmp_path / 'ids.jsonl'}]"]
    )
    convs, excluded = load_prompt_files(cfg)
    assert [c.id for c in convs] == ["t0", "t2"] and excluded == 3
    (tmp_path / "bad.jsonl").write_text('{"task": 1}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: a JSON row without an \"id\""):
        read_id_file(tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match="data.exclude_ids: .*missing.txt: no such file"):
        read_id_file(tmp_path / "missing.txt")
