"""The instance catalog: one validated row per instance type and region, plus price overlays.

The rows ship as ``instances.csv`` next to this module. Every price carries the date it
was read and its public source; a row whose price could not be read from a public
source says ``price_unverified`` and has no number at all. GPU figures (peak FLOP/s,
memory bandwidth) are not repeated here: they come from the one table the monitor's
MFU uses (:mod:`skylift.machine.gpus`).
"""

from __future__ import annotations

import csv
import datetime
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from skylift.cloud.vendors import cloud_names, cloud_vendor
from skylift.errors import SkyliftConfigError

__all__ = ["PRICE_FILE_COLUMNS", "InstanceRow", "filter_rows", "load_catalog", "overlay_prices", "spot_zone_table"]

PRICE_FILE_COLUMNS = ("provider", "instance_type", "region", "on_demand_usd_per_hour", "spot_usd_per_hour")
"""Columns a user's price file must have (``price_source`` and ``price_read_on`` are optional)."""

LOCAL_PROVIDER = "local"
"""The provider of a row that describes this machine, not a cloud's instance."""


class InstanceRow(BaseModel):
    """One instance type in one region: hardware, interconnect, prices and where each came from."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    provider: str
    """Cloud: a registered one (:mod:`skylift.cloud.vendors`: ``aws``, EC2 and SageMaker ``ml.``
    types; ``gcp``, ``azure``, ``aliyun``, ``tencent``), or ``local`` for this machine."""
    instance_type: str = Field(min_length=1)
    """The provider's name for the machine, e.g. ``p4d.24xlarge`` or ``ecs.gn6i-c8g1.2xlarge``."""
    region: str = Field(min_length=1)
    """Region the prices apply to."""
    gpu_model: str = Field(min_length=1)
    """GPU model as the shared GPU table names it (``A100``, ``A100-80GB``, ``T4``...)."""
    gpu_count: int = Field(ge=1)
    """GPUs in one instance."""
    gpu_memory_gib: float = Field(gt=0)
    """Memory of one GPU, GiB."""
    vcpus: int = Field(ge=1)
    """Virtual CPUs of the instance."""
    ram_gib: float = Field(gt=0)
    """Host memory, GiB."""
    gpu_interconnect: Literal["nvlink", "pcie", "none"]
    """How the GPUs of one instance talk: NVLink/NVSwitch, PCIe, or ``none`` (one GPU)."""
    intra_node_gb_s: float = Field(ge=0)
    """Per-GPU link bandwidth inside the instance as the vendor states it, GB/s (0 with one GPU)."""
    network_gbps: float = Field(gt=0)
    """Network bandwidth of the instance, Gb/s ("up to" figures taken at face value)."""
    network_fabric: Literal["efa", "ib", "erdma", "rdma", "none"]
    """RDMA fabric between instances, if any: AWS EFA, InfiniBand, Alibaba eRDMA, RDMA."""
    on_demand_usd_per_hour: float | None = Field(default=None, gt=0)
    """On-demand list price of one instance, USD/hour; ``None`` when unverified."""
    spot_usd_per_hour: float | None = Field(default=None, gt=0)
    """Spot price of one instance, USD/hour: the median zone's of the region (the lower
    middle of an even count: a price one zone lists), what a job that lands in any zone
    pays; one cheap outlier zone does not move it. ``None`` if unknown."""
    spot_cheapest_usd_per_hour: float | None = Field(default=None, gt=0)
    """The cheapest zone's spot price, USD/hour, shown beside the median; ``None`` if unknown."""
    spot_cheapest_zone: str | None = None
    """The zone that lists ``spot_cheapest_usd_per_hour`` (``use1-az1``)."""
    spot_zone_prices: str | None = None
    """Every zone's spot price as read at ``price_source``, ``zone=USD;zone=USD``; when
    given, ``spot_usd_per_hour`` and the cheapest zone must be its median and minimum."""
    price_status: Literal["verified", "price_unverified", "user"]
    """``verified``: read from ``price_source`` on ``price_read_on``; ``price_unverified``: no
    public price was found, so there is no number; ``user``: from the user's price file."""
    price_read_on: datetime.date | None = None
    """The day the price was read."""
    price_source: str | None = None
    """Public URL (with a commit for repositories) or the user's price file."""
    spec_source: str = Field(min_length=1)
    """Where the hardware figures come from (vendor page or catalog commit)."""
    spec_checked: bool
    """Whether the hardware figures were read in ``spec_source`` when the row was written,
    rather than recalled; unchecked rows are marked in ``skylift catalog``."""
    notes: str = ""
    """Anything a reader of the row should know (zone used for spot, caveats)."""

    @field_validator("provider")
    @classmethod
    def _a_registered_cloud(cls, value: str) -> str:
        if value != LOCAL_PROVIDER and cloud_vendor(value) is None:
            raise ValueError(f"{value!r} is not a known cloud; use one of: {', '.join(cloud_names())} "
                             f"or {LOCAL_PROVIDER}")  # fmt: skip
        return value

    @model_validator(mode="after")
    def _prices_have_sources(self) -> InstanceRow:
        has_price = self.on_demand_usd_per_hour is not None or self.spot_usd_per_hour is not None
        if self.price_status == "price_unverified" and has_price:
            raise ValueError("a price_unverified row must not carry a price")
        if self.price_status != "price_unverified" and not (has_price and self.price_source and self.price_read_on):
            raise ValueError("a priced row needs on_demand_usd_per_hour or spot_usd_per_hour, price_source and "
                             "price_read_on")  # fmt: skip
        return self._spot_agrees_with_zones()

    def _spot_agrees_with_zones(self) -> InstanceRow:
        if not self.spot_zone_prices:
            return self
        zones = sorted((price, zone) for zone, price in spot_zone_table(self.spot_zone_prices).items())
        median_price, _ = zones[(len(zones) - 1) // 2]
        if self.spot_usd_per_hour != median_price:
            raise ValueError(f"spot_usd_per_hour {self.spot_usd_per_hour} is not the median zone's price "
                             f"{median_price} of spot_zone_prices")  # fmt: skip
        if (self.spot_cheapest_usd_per_hour, self.spot_cheapest_zone) != zones[0]:
            raise ValueError(f"spot_cheapest_usd_per_hour and spot_cheapest_zone must be the cheapest zone of "
                             f"spot_zone_prices: {zones[0][1]} at {zones[0][0]}")  # fmt: skip
        return self

    @property
    def spot_notice_window_s(self) -> float | None:
        """Seconds between the provider's spot notice and the stop (the preemption watcher's figure)."""
        vendor = cloud_vendor(self.provider)
        return None if vendor is None else vendor.notice_window_s

    def price(self, spot: bool) -> float | None:
        """USD/hour of one instance, spot or on-demand; ``None`` when there is no price."""
        return self.spot_usd_per_hour if spot else self.on_demand_usd_per_hour


def spot_zone_table(text: str) -> dict[str, float]:
    """``"use1-az1=0.37;use1-az2=0.43"`` as ``{zone: USD/hour}``."""
    table = {}
    for item in text.split(";"):
        zone, equals, price = item.partition("=")
        try:
            table[zone.strip()] = float(price)
        except ValueError:
            equals = ""
        if not equals or not zone.strip():
            raise ValueError(f"spot_zone_prices item {item!r} is not zone=USD (e.g. use1-az1=0.3707)")
    return table


def _parse(record: dict[str, str], where: str) -> InstanceRow:
    cleaned = {key: value.strip() for key, value in record.items() if value is not None and value.strip() != ""}
    try:
        return InstanceRow.model_validate(cleaned)
    except ValidationError as error:
        problems = [f"{where}: {'.'.join(map(str, item['loc'])) or 'row'}: {item['msg']}" for item in error.errors()]
        raise SkyliftConfigError(problems, "fix the row, then run: skylift catalog") from None


def load_catalog(price_file: str | Path | None = None) -> list[InstanceRow]:
    """Every catalog row, with the user's ``price_file`` laid over the shipped prices.

    Raises:
        SkyliftConfigError: a row or the price file is malformed (names the line and field).

    Example:
        >>> [row.instance_type for row in load_catalog() if row.gpu_model == "H100"][:1]
        ['p5.48xlarge']
    """
    text = resources.files("skylift.catalog").joinpath("instances.csv").read_text(encoding="utf-8")
    rows = [_parse(record, f"instances.csv line {number}")
            for number, record in enumerate(csv.DictReader(text.splitlines()), start=2)]  # fmt: skip
    return rows if price_file is None else overlay_prices(rows, Path(price_file))


def overlay_prices(rows: list[InstanceRow], price_file: Path) -> list[InstanceRow]:
    """Replace the prices of matching (provider, instance_type, region) rows with the file's.

    The file is a CSV with :data:`PRICE_FILE_COLUMNS` (negotiated or current prices).
    Matching rows become ``price_status: user``; rows the file does not name keep theirs.
    """
    if not price_file.is_file():
        raise SkyliftConfigError(f"--price-file {price_file}: no such file",
                                 f"write a CSV with columns {', '.join(PRICE_FILE_COLUMNS)}")  # fmt: skip
    with price_file.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        missing = [column for column in PRICE_FILE_COLUMNS if column not in (reader.fieldnames or [])]
        if missing:
            raise SkyliftConfigError(f"--price-file {price_file}: missing column(s) {', '.join(missing)}",
                                     f"the header must be: {','.join(PRICE_FILE_COLUMNS)}")  # fmt: skip
        overrides = {(r["provider"], r["instance_type"], r["region"]): r for r in reader}
    by_key = {(row.provider, row.instance_type, row.region): row for row in rows}
    unknown = [f"{key[0]} {key[1]} {key[2]}" for key in overrides if key not in by_key]
    if unknown:
        raise SkyliftConfigError([f"--price-file {price_file}: no catalog row for {name}" for name in unknown],
                                 "list the rows with: skylift catalog --json")  # fmt: skip
    return [_overlaid(row, overrides.get(key), price_file) for key, row in by_key.items()]


def _overlaid(row: InstanceRow, record: dict[str, str] | None, price_file: Path) -> InstanceRow:
    if record is None:
        return row
    fields = row.model_dump()
    fields.update(
        on_demand_usd_per_hour=record.get("on_demand_usd_per_hour") or None,
        spot_usd_per_hour=record.get("spot_usd_per_hour") or None,
        # The shipped zones describe the shipped spot price, not the user's.
        spot_cheapest_usd_per_hour=None, spot_cheapest_zone=None, spot_zone_prices=None,
        price_status="user",
        price_source=record.get("price_source") or str(price_file),
        price_read_on=record.get("price_read_on") or datetime.date.fromtimestamp(price_file.stat().st_mtime),
    )
    return _parse({key: "" if value is None else str(value) for key, value in fields.items()}, str(price_file))


def filter_rows(
    rows: list[InstanceRow],
    *,
    gpus: list[str] | None = None,
    providers: list[str] | None = None,
    spot_only: bool = False,
) -> list[InstanceRow]:
    """Rows whose GPU model (case-insensitive, ``A100`` also matches ``A100-80GB``) and provider match."""
    wanted_gpus = [gpu.lower() for gpu in gpus or []]
    chosen = []
    for row in rows:
        model = row.gpu_model.lower()
        if wanted_gpus and not any(model == gpu or model.startswith(f"{gpu}-") for gpu in wanted_gpus):
            continue
        if providers and row.provider not in providers:
            continue
        if spot_only and row.spot_usd_per_hour is None:
            continue
        chosen.append(row)
    return chosen
