"""What ``skylift plan`` assumes about prices and spot capacity for this job."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from skylift.cloud.vendors import cloud_names, cloud_vendor
from skylift.config.section import Section

__all__ = ["PlanConfig"]


def _registered_cloud(name: str) -> str:
    if cloud_vendor(name) is None:
        raise ValueError(f"{name!r} is not a known cloud; use one of: {', '.join(cloud_names())}")
    return name


Provider = Annotated[str, AfterValidator(_registered_cloud)]
"""A registered cloud's name (:mod:`skylift.cloud.vendors`): checked there, not listed here."""
Rate = Annotated[float, Field(ge=0.0, le=100.0)]


class PlanConfig(Section):
    price_file: str | None = None
    """A CSV of your own prices (negotiated, reserved or today's) laid over the catalog's:
    columns ``provider, instance_type, region, on_demand_usd_per_hour, spot_usd_per_hour``
    (``price_source``, ``price_read_on`` optional). ``skylift plan --price-file`` wins."""

    interruptions_per_hour: Rate | dict[Provider, Rate] | None = None
    """Spot interruptions per instance-hour: one rate for every provider, or one per
    provider (``{aws: 0.1, aliyun: 0.02}``; the others keep skylift's assumption of 0.05,
    which no provider publishes). ``--interruptions-per-hour`` wins."""

    restart_minutes: float = Field(default=10.0, gt=0.0, le=24 * 60.0)
    """Minutes from an interruption to training again (new capacity, image pull, resume);
    ``--restart-minutes`` wins."""
