"""Reading back the SVG files the plotting tools write."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

SVG_NS = "{http://www.w3.org/2000/svg}"


def svg_text(path: Path) -> str:
    """All the text of the ``<text>`` elements of the SVG file at ``path``, joined by spaces.

    Raises ``xml.etree.ElementTree.ParseError`` when the file is not well-formed XML and
    AssertionError when its root element is not ``<svg>``.
    """
    root = ET.fromstring(path.read_text())
    assert root.tag == f"{SVG_NS}svg", root.tag
    return " ".join("".join(t.itertext()) for t in root.iter(f"{SVG_NS}text"))
