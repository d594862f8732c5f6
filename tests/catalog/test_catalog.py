"""The shipped catalog: every row parses, prices are sourced or marked, overlays and filters work."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from skylift.catalog import InstanceRow, filter_rows, load_catalog
from skylift.cli.main import main
from skylift.errors import SkyliftConfigError
from skylift.machine.gpus import gpu_spec

GUIDE_INSTANCES = ("ml.p3.16xlarge", "ecs.gn6i-c8g1.2xlarge", "GN7.8XLARGE32")


def test_every_row_has_a_sourced_price_or_says_unverified():
    rows = load_catalog()
    assert rows
    for row in rows:
        assert row.spec_source.startswith("https://")
        if row.price_status == "price_unverified":
            assert row.on_demand_usd_per_hour is None and row.spot_usd_per_hour is None
        else:
            assert row.price_source.startswith("https://") and row.price_read_on is not None


def test_issue_instances_are_covered():
    names = {row.instance_type for row in load_catalog()}
    wanted = {"p3.2xlarge", "p3.16xlarge", "p3dn.24xlarge", "p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge",
              "p5en.48xlarge", "g4dn.xlarge", "g5.xlarge", "g5.12xlarge", "g6.xlarge", "g6e.xlarge", *GUIDE_INSTANCES}
    assert wanted <= names
    families = {row.instance_type.split("-")[0].split(".")[0] for row in load_catalog()}
    assert {"GN7", "GN10X", "GT4", "a2", "a3", "g2"} <= families


def test_every_gpu_model_is_in_the_shared_table():
    for row in load_catalog():
        spec = gpu_spec(row.gpu_model)
        assert spec is not None, row.gpu_model
        assert spec.memory_bandwidth_bytes_per_s > 0 and spec.peak_flops_per_s("bf16") > 0


def test_spot_notice_window_comes_from_the_preemption_table():
    row = next(row for row in load_catalog() if row.instance_type == "ecs.gn6i-c8g1.2xlarge")
    assert row.spot_notice_window_s == 300.0


def test_a_price_without_source_is_rejected():
    fields = load_catalog()[0].model_dump()
    fields.update(price_status="verified", on_demand_usd_per_hour=1.0, price_source=None)
    with pytest.raises(ValidationError, match="price_source"):
        InstanceRow.model_validate(fields)
    fields.update(price_status="price_unverified")
    with pytest.raises(ValidationError, match="must not carry a price"):
        InstanceRow.model_validate(fields)


def test_price_file_overlays_matching_rows(tmp_path):
    price_file = tmp_path / "prices.csv"
    price_file.write_text("provider,instance_type,region,on_demand_usd_per_hour,spot_usd_per_hour\n"
                          "tencent,GN7.8XLARGE32,ap-guangzhou,1.5,0.6\n")  # fmt: skip
    rows = {row.instance_type: row for row in load_catalog(price_file)}
    overlaid = rows["GN7.8XLARGE32"]
    assert (overlaid.price_status, overlaid.price(False), overlaid.price(True)) == ("user", 1.5, 0.6)
    assert overlaid.price_source == str(price_file)
    assert rows["p4d.24xlarge"].price_status == "verified"


@pytest.mark.parametrize(
    ("text", "message"),
    [("provider,instance_type,region\n", "missing column"),
     ("provider,instance_type,region,on_demand_usd_per_hour,spot_usd_per_hour\naws,p9.huge,us-east-1,1,\n",
      "no catalog row")],
)  # fmt: skip
def test_bad_price_file_names_the_problem(tmp_path, text, message):
    price_file = tmp_path / "prices.csv"
    price_file.write_text(text)
    with pytest.raises(SkyliftConfigError, match=message):
        load_catalog(price_file)


def test_gpu_filter_keeps_variants_but_not_prefixes():
    models = {row.gpu_model for row in filter_rows(load_catalog(), gpus=["a100"])}
    assert models == {"A100", "A100-80GB", "A100-80GB-PCIe"}
    assert {row.gpu_model for row in filter_rows(load_catalog(), gpus=["A10"])} == {"A10"}


def test_catalog_command_json(capsys):
    assert main(["catalog", "--gpu", "T4", "--provider", "aliyun", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["instance_type"] for row in rows] == ["ecs.gn6i-c8g1.2xlarge"]
    assert rows[0]["price_status"] == "price_unverified" and rows[0]["spot_notice_window_s"] == 300.0


def test_catalog_command_text_marks_unverified_prices(capsys):
    assert main(["catalog", "--gpu", "T4"]) == 0
    out = capsys.readouterr().out
    assert "GN7.8XLARGE32" in out and "price_unverified" in out


def test_unknown_provider_is_a_config_error(capsys):
    assert main(["catalog", "--provider", "oracle"]) == 2
    assert "--provider oracle" in capsys.readouterr().err
