"""The base of every config section: unknown keys refused, non-finite numbers refused
(``.inf``, ``.nan``: a learning rate of infinity trains to NaN, and ``Infinity`` in
``metrics.jsonl`` is not JSON), one docstring per field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Section"]


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        frozen=False,
        allow_inf_nan=False,
    )
