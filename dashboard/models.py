"""What the top layer keeps for itself: nothing below it (runs, evidence)
reads these tables."""

from __future__ import annotations
