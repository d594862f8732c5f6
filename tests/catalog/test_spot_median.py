"""Spot prices a user would pay: the median zone's, with the cheapest zone beside it."""

from __future__ import annotations

import statistics

import pytest

from skylift.catalog import load_catalog
from skylift.catalog.rows import spot_zone_table
from skylift.cli.catalog import render_rows


def _row(instance_type: str):
    return next(row for row in load_catalog() if row.instance_type == instance_type)


def test_every_row_with_zone_prices_carries_their_median_and_minimum():
    rows = [row for row in load_catalog() if row.spot_zone_prices]
    assert len(rows) >= 10
    for row in rows:
        prices = sorted(spot_zone_table(row.spot_zone_prices).values())
        # statistics.median_low: the lower middle of an even count, a price some zone lists.
        assert row.spot_usd_per_hour == statistics.median_low(prices), row.instance_type
        assert row.spot_cheapest_usd_per_hour == prices[0], row.instance_type


def test_one_cheap_zone_does_not_make_p4d_the_cheapest_a100_spot():
    p4d = _row("p4d.24xlarge")
    # use1-az1 lists 2.4655; the other zones 7.8799 to 8.1915: the median is at least 7.8799.
    assert p4d.spot_cheapest_usd_per_hour == 2.4655 and p4d.spot_cheapest_zone == "use1-az1"
    assert p4d.spot_usd_per_hour >= 7.8799
    assert p4d.spot_usd_per_hour > 3 * p4d.spot_cheapest_usd_per_hour
    # Per GPU-hour it now costs what its sibling p4de does (within the zones' spread),
    # not a third of it as the outlier zone made it.
    p4de = _row("p4de.24xlarge")
    assert p4d.spot_usd_per_hour / p4d.gpu_count > 0.8 * p4de.spot_usd_per_hour / p4de.gpu_count


def test_the_catalog_table_shows_the_cheapest_zone_beside_the_median():
    text = render_rows([_row("p4d.24xlarge"), _row("p3dn.24xlarge")])
    assert "7.8799 (2.4655 use1-az1)" in text
    p3dn_line = next(line for line in text.splitlines() if line.startswith("aws       p3dn"))
    assert "(" not in p3dn_line  # its median is its cheapest zone: nothing to show beside it


def test_a_spot_price_that_is_not_the_zones_median_is_rejected():
    from skylift.catalog import rows as catalog_rows

    row = _row("g5.xlarge").model_dump(mode="json")
    row["spot_usd_per_hour"] = row["spot_cheapest_usd_per_hour"]  # the old rule: cheapest zone
    with pytest.raises(ValueError, match="not the median zone's price"):
        catalog_rows.InstanceRow.model_validate(row)
    row = _row("g5.xlarge").model_dump(mode="json") | {"spot_zone_prices": "use1-az1=cheap"}
    with pytest.raises(ValueError, match="spot_zone_prices item 'use1-az1=cheap' is not zone=USD"):
        catalog_rows.InstanceRow.model_validate(row)


def test_a_users_spot_price_drops_the_shipped_zones(tmp_path):
    price_file = tmp_path / "prices.csv"
    price_file.write_text("provider,instance_type,region,on_demand_usd_per_hour,spot_usd_per_hour\n"
                          "aws,p4d.24xlarge,us-east-1,20.0,6.5\n")  # fmt: skip
    row = next(row for row in load_catalog(price_file) if row.instance_type == "p4d.24xlarge")
    assert row.spot_usd_per_hour == 6.5 and row.spot_cheapest_usd_per_hour is None and row.spot_zone_prices is None
