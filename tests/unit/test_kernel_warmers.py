"""Kernel warmers (server.startup.warmers, issue 45), without a GPU: the thin prefix of layers a warmer loads
(models.loading.thin) holds every kind of layer of each zoo architecture and computes like the whole model's first
layers; the kernel cache's files are published whole, the .ptx last (models.loading.kernel_files); who starts how
many warmers, and why none; the warm-up held while they run (server.lane.warm); one warmer process for real on a zoo
hybrid. A live server's warmers are in tests/integration/test_lane_behaviour.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import mlx.core as mx
import pytest

from models.loading.kernel_files import modules, publish, stage
from models.loading.thin import layer_signature, load_thin, thin_config
from server.lane.warm import HOLD_POLL_S, WarmUp
from tests.fixtures import zoo

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def default_model_dir():
    from models import ensure_default_model

    return ensure_default_model(progress=False)

# the thin prefix each zoo architecture gets (its 4 layers: see tests/fixtures/zoo.py): one layer of a model whose
# layers are all alike; a dense and an expert layer (first_k_dense_replace 1); a window and a full attention; a gated
# delta-net and a full attention (full_attention_interval 2); nemotron_h's "M*M-" needs all four
EXPECTED_LAYERS = {"llama": 1, "qwen3": 1, "qwen3_moe": 1, "deepseek_v3": 2, "glm4_moe": 2, "gpt_oss": 2,
                   "gemma3_text": 2, "qwen3_next": 2, "qwen3_5": 2, "qwen3_5_moe": 2, "nemotron_h": 4, "lfm2": 2,
                   "granitemoehybrid": 2}


def _kinds(name: str, config: dict) -> set:
    module = zoo._module(name)
    model = module.Model(module.ModelArgs.from_dict(config))
    layers = model.layers if hasattr(model, "layers") else model.model.layers
    return {layer_signature(layer) for layer in layers}


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_the_thin_prefix_holds_every_kind_of_layer_and_no_more(name):
    config = zoo.config(name, 64)
    overrides = thin_config(config)
    assert overrides is not None
    k = overrides.get("num_hidden_layers", config["num_hidden_layers"])
    assert k == EXPECTED_LAYERS[name]
    assert _kinds(name, {**config, **overrides}) == _kinds(name, config)
    if name == "gpt_oss":  # its window layers are built like its full ones: the config's list says which is which
        assert overrides["layer_types"] == ["sliding_attention", "full_attention"]


def test_a_config_that_counts_its_layers_in_text_config_is_thinned_there():
    text = {**zoo.config("qwen3_5", 64), "num_hidden_layers": 8}
    overrides = thin_config({"model_type": "qwen3_5", "text_config": text})
    assert overrides is not None and overrides["text_config"]["num_hidden_layers"] == 2
    assert overrides["text_config"]["hidden_size"] == text["hidden_size"]


def test_no_layer_count_or_an_unknown_architecture_gives_no_thin_model():
    assert thin_config({"model_type": "llama", "hidden_size": 8}) is None
    assert thin_config({"model_type": "no_such_arch_xyz", "num_hidden_layers": 4}) is None


@pytest.mark.parametrize("name", ["llama", "gpt_oss", "qwen3_5"])
def test_the_thin_model_computes_as_the_whole_models_first_layers(name, tmp_path, default_model_dir):
    """Its kept layers are the checkpoint's (not fresh random weights): each one's output from the same input equals
    the whole model's layer of the same index."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model as mlx_lm_load_model

    path = zoo.write(name, tmp_path / name, default_model_dir, vocab=64)
    overrides = thin_config(json.loads((path / "config.json").read_text()))
    assert overrides
    thin, _ = load_thin(path, "float32", overrides)
    whole, _ = mlx_lm_load_model(path)
    thin_layers = thin.layers if hasattr(thin, "layers") else thin.model.layers
    whole_layers = whole.layers if hasattr(whole, "layers") else whole.model.layers
    assert len(thin_layers) == overrides["num_hidden_layers"] < len(whole_layers)
    for a, b in zip(thin_layers, whole_layers):
        wa, wb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
        assert wa.keys() == wb.keys()
        assert all(mx.array_equal(wa[k], wb[k]).item() for k in wa)
    out = thin(mx.array([[1, 2, 3, 4, 5]]))
    assert out.shape == (1, 5, 64) and bool(mx.all(mx.isfinite(out)).item())


# -- the kernel cache's files -----------------------------------------------------------------------------------------
def _module_files(folder: Path, name: str, body: bytes = b"code") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.ptx").write_bytes(body)
    (folder / f"{name}.txt").write_text("kernel\tmangled\n")
    (folder / f"{name}.cu").write_text("// source")


def test_staging_starts_with_the_shared_modules_and_publishing_adds_only_whole_new_ones(tmp_path, monkeypatch):
    shared, staging = tmp_path / "shared", tmp_path / "staging"
    _module_files(shared, "old")
    assert stage(shared, staging) == 1 and modules(staging) == {"old"}
    assert os.stat(shared / "old.ptx").st_ino == os.stat(staging / "old.ptx").st_ino  # a link, not a copy
    _module_files(staging, "new", b"compiled")
    (staging / "half.ptx").write_bytes(b"no names yet")  # a .ptx without its .txt is not a module
    order = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (order.append(Path(b).name), real_replace(a, b)))
    assert publish(staging, shared) == 1
    assert order == ["new.txt", "new.cu", "new.ptx"]  # the .ptx last: a reader takes the module once it is there
    assert (shared / "new.ptx").read_bytes() == b"compiled" and not (shared / "half.ptx").exists()
    assert not [p for p in shared.iterdir() if p.name.endswith(".tmp")]
    assert publish(staging, shared) == 0  # nothing new


# -- who starts warmers ------------------------------------------------------------------------------------------------
def _cfg(**kw):
    from server.cli import build_parser
    from server.config import ServerConfig

    return replace(ServerConfig.from_args(build_parser().parse_args(["serve"])), **kw)


def test_chains_are_dealt_over_the_processes_the_prompts_first():
    from server.startup.warmers import split_chains

    chains = ["prefill", "batched step", "batched prefill", "past a cache"]
    assert split_chains(chains, 4) == [["prefill"], ["batched step"], ["batched prefill"], ["past a cache"]]
    assert split_chains(chains, 2) == [["prefill", "batched prefill"], ["batched step", "past a cache"]]
    assert split_chains(chains, 9) == [[c] for c in chains] and split_chains(chains, 0) == []


def test_the_key_changes_with_what_shapes_the_kernels_only(tmp_path, default_model_dir):
    from server.startup.warmers import warm_key

    base = warm_key(_cfg(), default_model_dir, "float32")
    assert warm_key(_cfg(port=9999, api_key="x"), default_model_dir, "float32") == base
    assert warm_key(_cfg(), default_model_dir, "bfloat16") != base
    assert warm_key(_cfg(prefill_chunk=256), default_model_dir, "float32") != base
    assert warm_key(_cfg(kv_bits=8), default_model_dir, "float32") != base


def test_no_warmers_off_a_gpu_by_default_nor_when_told_and_the_reason_is_said(tmp_path, monkeypatch,
                                                                          default_model_dir):
    from server.startup.warmers import start_kernel_warmers

    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    spec = str(default_model_dir)
    assert "CUDA" in start_kernel_warmers(_cfg(kernel_warmers=None), spec).why  # auto on the CPU
    assert start_kernel_warmers(_cfg(), spec).why == "--kernel-warmers 0"  # the default
    assert start_kernel_warmers(_cfg(kernel_warmers=2, warm_up="off"), spec).why == "--warm-up off"
    none = start_kernel_warmers(_cfg(kernel_warmers=2), str(tmp_path / "missing"))
    assert none.as_dict() == {"processes": 0, "why": "the model is not a local mlx-lm directory", "warmers": []}
    assert not none.busy()


def test_the_warm_up_is_held_while_the_warmers_run():
    class Clock:
        now = 10.0

        def __call__(self):
            return self.now

    clock, ran = Clock(), []
    from server.lane.seam import WarmStep

    warm = WarmUp("behind", grace_s=0.0, settle_s=0.0, clock=clock)
    warm.load([WarmStep("a", lambda: ran.append("a"))])
    busy = [True]
    warm.hold_while(lambda: busy[0])
    warm.on_ready()
    assert warm.delay() == HOLD_POLL_S
    busy[0] = False
    assert warm.delay() == 0.0
    warm.step()
    assert ran == ["a"] and warm.finished


# -- one warmer, for real (the CPU: it runs its steps and marks its chains; nothing to publish) -------------------------
def test_a_warmer_process_runs_its_chains_on_a_thin_hybrid_and_marks_them(tmp_path, default_model_dir):
    path = zoo.write("qwen3_5", tmp_path / "qwen3_5", default_model_dir, vocab=64)
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(asdict(_cfg(dtype="float32")), default=list))
    shared, markers = tmp_path / "ptx", tmp_path / "ptx" / "warmed" / "k"
    _module_files(shared, "earlier")
    r = subprocess.run([sys.executable, "-m", "server.startup.warmer", "--config", str(cfg_file), "--model-dir",
                        str(path), "--dtype", "float32", "--chains",
                        "prefill,batched step", "--shared", str(shared), "--staging", str(tmp_path / "staging"),
                        "--markers", str(markers)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["layers"] == 2 and result["staged"] == 1 and result["published"] == 0
    assert result["steps"][0] == "prefill chunk 1" and "one-token steps" in result["steps"]
    assert sorted(p.name for p in markers.iterdir()) == ["batched step", "prefill"]
    assert not (tmp_path / "staging").exists()  # removed at exit


def test_a_warmer_that_fails_says_why_and_marks_nothing(tmp_path, default_model_dir):
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(asdict(_cfg()), default=list))
    markers = tmp_path / "warmed"
    r = subprocess.run([sys.executable, "-m", "server.startup.warmer", "--config", str(cfg_file), "--model-dir",
                        str(tmp_path / "nowhere"), "--dtype", "float32", "--chains", "prefill",
                        "--shared", str(tmp_path / "ptx"), "--staging", str(tmp_path / "staging"),
                        "--markers", str(markers)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 1
    assert "error" in json.loads(r.stdout.strip().splitlines()[-1]) and not markers.exists()


def test_the_card_holds_as_many_warmers_as_half_its_room_beside_the_weights(tmp_path, monkeypatch):
    """A 40 GB checkpoint of 24 layers (gpt-oss-20b in bf16): on an 80 GB card one warmer, on a 141 GB card four;
    a card that the weights nearly fill, none."""
    from server import device_memory
    from server.startup import warmers as kernel_warmers

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 24}))
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(40 << 30)  # sparse: its size is what counts
    monkeypatch.setattr(kernel_warmers, "_on_cuda", lambda: True)
    for total_gib, expected in ((80, 1), (141, 4), (44, 0)):
        card = type("Card", (), {"card": lambda self, t=total_gib: (1 << 29, t << 30)})()
        monkeypatch.setattr(device_memory, "driver", lambda c=card: c)
        assert kernel_warmers.card_room(tmp_path) == expected, total_gib
    monkeypatch.setattr(kernel_warmers, "_on_cuda", lambda: False)
    assert kernel_warmers.card_room(tmp_path) is None


def test_the_model_is_found_without_mlx_lm_for_directories_it_has_classes_for(tmp_path, default_model_dir):
    from server.startup.warmers import _local_model_dir

    assert _local_model_dir(str(default_model_dir)) == default_model_dir
    assert _local_model_dir("default") == default_model_dir  # the packaged default, once fetched
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no_such_arch_xyz", "num_hidden_layers": 2}))
    assert _local_model_dir(str(unknown)) is None  # mlx-lm has no module for it (mlx-vlm's, say)
    assert _local_model_dir("owner/some-repo") is None  # a hub id: never fetched here
