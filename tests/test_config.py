"""Config: presets, overrides and clear errors for bad values."""

import pytest

from rayzero import config


def test_presets_load_and_differ():
    assert {"cartpole", "atari"} <= set(config.presets())
    cartpole = config.load("cartpole")
    atari = config.load("atari")
    assert cartpole.env.id == "CartPole-v1" and cartpole.model.kind == "mlp"
    assert atari.env.id == "ALE/Pong-v5" and atari.model.kind == "resnet" and atari.env.is_atari


def test_overrides_apply_to_their_section():
    cfg = config.load("cartpole", ["search.num_simulations=7", "env.num_envs=3", "search.policy=gumbel"])
    assert cfg.search.num_simulations == 7 and cfg.search.policy == "gumbel" and cfg.env.num_envs == 3


@pytest.mark.parametrize(
    "override, message",
    [
        ("search.num_simulations=-4", "search.num_simulations=-4 is invalid"),
        ("model.bogus=1", "bogus"),
        ("nosection.x=1", "nosection"),
        ("env.num_envs=abc", "env.num_envs"),
        ("search.policy=alphago", "one of ('muzero', 'gumbel')"),
        ("replay.discount=1.5", "replay.discount=1.5 is invalid: must be in (0, 1]"),
        ("env.image_size=64", "84 or 96"),
        ("justtext", "section.field=value"),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(config.ConfigError) as error:
        config.load("cartpole", [override])
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_unknown_preset():
    with pytest.raises(config.ConfigError, match="unknown config preset 'nope'"):
        config.load("nope")


def test_yaml_roundtrip(tmp_path):
    cfg = config.load("atari", ["run.seed=5"])
    path = tmp_path / "c.yaml"
    path.write_text(config.to_yaml(cfg))
    assert config.load(str(path)) == cfg
