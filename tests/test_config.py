"""Config: presets, overrides and clear errors for bad values."""

import re

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
        ("env.image_size=72", "64, 84 or 96"),
        ("inference.compile_mode=reduce-overhead",
         "inference.compile_mode='reduce-overhead' is invalid: must be one of "
         "('default', 'max-autotune-no-cudagraphs')"),
        ("inference.poll_interval_us=0", "inference.poll_interval_us=0 is invalid: must be between 1 and 100000"),
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


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["replay.frame_stack=4"], "replay.frame_stack=4 needs an Atari env"),
        (["learner.consistency_weight=1.0"], "needs replay.next_obs=true"),
        (["learner.target_update_interval=100"], "needs replay.bootstrap_obs=true"),
        (["cluster.num_learners=3", "replay.shards=2"], "must divide cluster.num_learners=3"),
        (["cluster.num_learners=2", "replay.capacity=100", "replay.min_size=10"], "less than one segment"),
    ],
)
def test_rules_between_sections_are_checked_at_load(overrides, message):
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.load("cartpole", overrides)


def test_rules_between_sections_accept_agreeing_fields():
    cfg = config.load("atari", ["replay.frame_stack=4", "learner.consistency_weight=1.0", "replay.next_obs=true",
                                "learner.target_update_interval=100", "replay.bootstrap_obs=true"])
    assert cfg.replay.frame_stack == cfg.env.frame_stack == 4


def test_transformer_sizes_are_model_fields():
    cfg = config.load("cartpole", ["model.kind=transformer", "model.transformer_dim=32", "model.transformer_heads=4"])
    assert cfg.model.transformer_dim == 32 and cfg.model.transformer_heads == 4
    with pytest.raises(config.ConfigError, match="model.transformer_heads=5"):
        config.load("cartpole", ["model.transformer_dim=32", "model.transformer_heads=5"])


def test_describe_documents_every_field_and_loads_back(tmp_path):
    import dataclasses

    cfg = config.load("atari", ["search.num_simulations=7"])
    text = config.describe(cfg)
    assert "  num_simulations: 7" in text
    assert "  # Simulations per search" in text  # the field's docstring, from tree/base.py
    for section in dataclasses.fields(cfg):
        for field in dataclasses.fields(getattr(cfg, section.name)):
            assert f"\n  {field.name}: " in text, (section.name, field.name)
    path = tmp_path / "described.yaml"
    path.write_text(text)
    assert config.load(str(path)) == cfg
