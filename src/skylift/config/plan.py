"""What ``skylift plan`` assumes about prices and spot capacity for this job."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from skylift.config.section import Section

__all__ = ["PlanConfig"]

Provider = Literal["aws", "gcp", "azure", "aliyun", "tencent"]
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
