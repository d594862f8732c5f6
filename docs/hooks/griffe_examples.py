"""Griffe extension for the API reference: a Google-style ``Example:`` section is read as
``Examples:``, so its ``>>>`` lines render as code (griffe takes only the plural form as
an examples section, and reads ``Example:`` as an admonition whose text is Markdown)."""

from __future__ import annotations

import re

import griffe

_SINGULAR = re.compile(r"^(\s*)Example:\s*$", re.M)
# Sphinx roles (:class:`~a.b.C`) as code spans: the reference has no Sphinx inventory.
_ROLE = re.compile(r":(?:py:)?(?:class|mod|func|meth|attr|data|exc|obj):`~?([^`]+)`")


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            value = _SINGULAR.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _ROLE.sub(r"``\1``", value)
