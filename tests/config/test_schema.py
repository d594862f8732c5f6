from __future__ import annotations

import pytest
from pydantic import BaseModel

from skylift.config import RunConfig, load_config, parse_config
from skylift.config.load import apply_overrides, dump_config
from skylift.errors import SkyliftConfigError


def _sections(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", field
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _sections(field.annotation, f"{prefix}{name}.")


def test_every_field_is_documented():
    undocumented = [name for name, field in _sections(RunConfig) if not (field.description or "").strip()]
    assert undocumented == []


def test_required_sections_exist():
    expected = {
        "recipe", "data", "optim", "schedule", "precision", "accumulation", "compile",
        "channels_last", "activation_checkpointing", "distributed", "checkpoint", "monitor", "run_dir",
    }
    assert expected <= set(RunConfig.model_fields)
    assert "model" not in RunConfig.model_fields  # the model is a recipe's setting (recipe.model)


def test_overrides_are_typed():
    config = load_config(None, ["optim.lr=0.01", "schedule.epochs=3", "compile.enabled=true", "optim.grad_clip_norm=null"])
    assert config.optim.lr == 0.01
    assert config.schedule.epochs == 3
    assert config.compile.enabled is True
    assert config.optim.grad_clip_norm is None


def test_unknown_key_names_the_closest_valid_key():
    with pytest.raises(SkyliftConfigError) as caught:
        load_config(None, ["optim.lrr=0.1"])
    message = str(caught.value)
    assert "optim.lrr: unknown key." in message
    assert "Did you mean 'optim.lr'" in message


def test_unknown_section_is_rejected():
    with pytest.raises(SkyliftConfigError, match="Did you mean 'schedule'"):
        parse_config({"schedul": {"epochs": 1}})


def test_wrong_type_names_field_and_value():
    with pytest.raises(SkyliftConfigError) as caught:
        load_config(None, ["schedule.epochs=many"])
    assert "schedule.epochs" in str(caught.value)
    assert "'many'" in str(caught.value)


def test_bad_choice_lists_allowed_values():
    with pytest.raises(SkyliftConfigError) as caught:
        load_config(None, ["precision=fp8"])
    message = str(caught.value)
    assert "precision" in message
    for allowed in ("'auto'", "'fp32'", "'tf32'", "'fp16'", "'bf16'"):
        assert allowed in message


def test_out_of_range_value_is_rejected():
    with pytest.raises(SkyliftConfigError, match="optim.lr"):
        load_config(None, ["optim.lr=-1"])


def test_batch_must_divide_by_ranks_and_accumulation():
    config = load_config(None, ["data.global_batch_size=60", "accumulation.steps=4"])
    assert config.micro_batch_size(world_size=1) == 15
    with pytest.raises(ValueError, match=r"data.global_batch_size \(60\).*multiple of 8"):
        config.micro_batch_size(world_size=2)


def test_override_into_a_value_fails_clearly():
    with pytest.raises(SkyliftConfigError, match="precision is a value, not a section"):
        apply_overrides({}, ["precision=fp32", "precision.x=1"])


def test_malformed_override_shows_the_form():
    with pytest.raises(SkyliftConfigError, match="section.key=value"):
        apply_overrides({}, ["optim.lr"])


def test_missing_file_names_it(tmp_path):
    with pytest.raises(SkyliftConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_dump_round_trips(tmp_path):
    config = load_config(None, ["optim.lr=0.02", "recipe.model=resnet18"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


def test_cross_field_error_names_both_fields():
    with pytest.raises(SkyliftConfigError, match=r"schedule.warmup_steps \(20\) exceeds schedule.max_steps \(5\)"):
        load_config(None, ["schedule.max_steps=5", "schedule.warmup_steps=20"])


def test_yaml_off_means_off():
    assert load_config(None, ["preemption.cloud=off"]).preemption.cloud == "off"
    assert load_config(None, ["monitor.progress_bar=off"]).monitor.progress_bar is False


def test_check_refuses_a_bad_builtin_recipe_arg_naming_it(capsys):
    """The schema leaves the recipe's settings to the recipe; ``skylift check`` still checks them."""
    from skylift.cli.main import main
    from tests.conftest import EXAMPLES

    code = main(["check", str(EXAMPLES / "quickstart.yaml"), "--set", "recipe.label_smoothin=0.1"])
    error = capsys.readouterr().err
    assert code == 2
    assert "recipe.label_smoothin: unknown key. Did you mean 'recipe.label_smoothing'?" in error
    assert "ImageClassification.Settings defines its keys" in error
