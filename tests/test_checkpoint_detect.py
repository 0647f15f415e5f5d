"""Which loader a path goes to, paths that are no checkpoint, and the default (demo) weights."""

from __future__ import annotations

import pytest

from wafer_gpt2.model import checkpoint
from wafer_gpt2.model.checkpoint import CheckpointError, detect_format, load_checkpoint, resolve_weights
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.model.params import GPT2Params

TINY = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=50, n_positions=16, name="tiny")


def test_detects_each_format(write_checkpoint):
    params = GPT2Params.random(TINY, seed=0)
    assert detect_format(write_checkpoint(params)) == "hf"
    assert detect_format(write_checkpoint(params, "llmc")) == "llmc"
    llmc = write_checkpoint(params, "llmc")
    renamed = llmc.with_name("weights.dat")  # detection reads the magic, not the file name
    llmc.rename(renamed)
    assert detect_format(renamed) == "llmc"


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("notes.txt", b"hello", "not a checkpoint this loader knows"),
        ("model.bin", b"\x00" * 2048, "bad magic 0"),
        ("model.safetensors", b"\x00" * 64, "needs the config.json of its directory"),
        ("empty.bin", b"", "not a checkpoint this loader knows"),
    ],
)
def test_files_that_are_no_checkpoint(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(path, progress=False)
    assert str(path) in str(info.value)


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        load_checkpoint(tmp_path / "nowhere", progress=False)
    with pytest.raises(CheckpointError, match="no such file or directory"):
        resolve_weights(tmp_path / "nowhere")


def test_empty_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path, progress=False)


def test_resolve_weights_defaults_to_the_demo_model(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "DEMO_MODEL_DIR", tmp_path / "demo-gpt2")
    with pytest.raises(CheckpointError, match="demo model .*demo-gpt2 is missing"):
        resolve_weights(None)
    (tmp_path / "demo-gpt2").mkdir()
    (tmp_path / "demo-gpt2" / "config.json").write_text("{}")
    assert resolve_weights(None) == tmp_path / "demo-gpt2"
    assert resolve_weights(str(tmp_path)) == tmp_path


def test_the_embedded_demo_model_loads_when_present():
    if not (checkpoint.DEMO_MODEL_DIR / "config.json").is_file():
        pytest.skip("the demo model has not been trained into wafer_gpt2/model/data/demo-gpt2 yet")
    params = load_checkpoint(resolve_weights(None), progress=False)
    assert params.config.vocab_size == 50257
