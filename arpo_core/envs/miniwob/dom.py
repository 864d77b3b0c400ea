"""The MiniWoB++ task area as data: its size and the DOM elements the env reads from the page.

The browser env (`miniwob_env.py`) produces these records and the scripted oracles (`oracles.py`), the
probes and the grounding data read them. They live here, apart from both, so that the oracles need no
browser code and the env can import the oracles without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SCREEN_SIZE", "DomElement"]

SCREEN_SIZE = (160, 210)
"""(width, height) of MiniWoB's task area in screen pixels (`miniwob.constants` TASK_WIDTH, TASK_HEIGHT;
tests/test_miniwob.py checks they agree)."""


@dataclass(frozen=True)
class DomElement:
    """One DOM element of the task area, in screen pixels (oracles and grounding data only)."""

    index: int
    """Position in document order (0 = <body>; jQuery UI menus and dialogs hang below it, not #wrap)."""
    tag: str
    """Lower-case tag; inputs carry their type, e.g. 'input_text', 'input_checkbox'."""
    text: str
    """The element's own text nodes, whitespace-collapsed."""
    full_text: str
    """textContent of the element and its descendants."""
    id: str
    classes: str
    bbox: tuple[float, float, float, float]
    """(left, top, width, height) in screen pixels."""
    visible: bool
    """Non-empty box overlapping the task area and not hidden by CSS."""
    topmost: bool
    """The element (or a descendant) is what a click at its centre would hit."""
    value: str | None
    """Inputs: value, or 'true'/'false' for checkboxes and radios."""
    focused: bool
    bg: str
    """Computed background colour, e.g. 'rgb(255, 0, 0)'."""
    fg: str
    parent: int
    """Index of the parent element (-1 for the root)."""

    @property
    def center(self) -> tuple[float, float]:
        left, top, w, h = self.bbox
        return left + w / 2, top + h / 2
