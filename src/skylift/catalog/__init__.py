"""Cloud instances skylift can plan for: hardware, interconnect and sourced prices."""

from skylift.catalog.rows import PRICE_FILE_COLUMNS, InstanceRow, filter_rows, load_catalog, overlay_prices

__all__ = ["PRICE_FILE_COLUMNS", "InstanceRow", "filter_rows", "load_catalog", "overlay_prices"]
