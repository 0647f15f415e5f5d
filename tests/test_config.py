import json

import pytest

from wafer_gpt2.model.config import PRESETS, ConfigError, GPT2Config, resolve_config


@pytest.mark.parametrize(
    ("name", "published_millions"),
    [("gpt2", 124), ("gpt2-medium", 355), ("gpt2-large", 774), ("gpt2-xl", 1558)],
)
def test_presets_have_the_published_parameter_counts(name: str, published_millions: int) -> None:
    assert round(PRESETS[name].n_params / 1e6) == published_millions


def test_hf_config_round_trip(tmp_path) -> None:
    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=1000, n_positions=128)
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    loaded = resolve_config(str(tmp_path))
    assert (loaded.n_layer, loaded.n_head, loaded.n_embd, loaded.vocab_size, loaded.n_positions) == (
        2,
        4,
        64,
        1000,
        128,
    )


def test_bad_configs_name_the_problem(tmp_path) -> None:
    with pytest.raises(ConfigError, match="n_embd .* divisible by n_head"):
        GPT2Config(n_layer=1, n_head=5, n_embd=64)
    with pytest.raises(ConfigError, match="'n_layer' must be a positive integer"):
        GPT2Config(n_layer=0)
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": 2}))
    with pytest.raises(ConfigError, match="missing field 'n_head'"):
        resolve_config(str(tmp_path))
    with pytest.raises(ConfigError, match="unknown model 'gpt5'"):
        resolve_config("gpt5")


def test_an_invalid_config_file_is_named(tmp_path) -> None:
    path = tmp_path / "config.json"
    good = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=1000, n_positions=128).to_hf_dict()
    path.write_text(json.dumps({**good, "n_head": 5}))
    with pytest.raises(ConfigError) as info:
        GPT2Config.from_json_file(path)
    assert str(info.value) == f"{path}: n_embd (64) must be divisible by n_head (5)"
    with pytest.raises(ConfigError, match=f"^{path}: config field 'n_layer' must be a positive integer"):
        path.write_text(json.dumps({**good, "n_layer": 0}))
        resolve_config(str(tmp_path))
    path.write_text(json.dumps({**good, "n_embd": "wide"}))
    with pytest.raises(ConfigError, match=f"^{path}: field 'n_embd' must be a number, got 'wide'"):
        GPT2Config.from_json_file(path)
