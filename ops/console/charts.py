"""The overview's chart, drawn on the server as SVG: no script, nothing to build, nothing vendored."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timezone
from typing import Sequence

WIDTH, HEIGHT, PAD = 720, 160, 24


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    label: str
    css: str


def minute_bars(rows: Sequence[dict], series: Sequence[tuple[str, str]]) -> tuple[list[Bar], int]:
    """Side-by-side bars per minute for each (key, css class) of ``series``; and the scale's top."""
    top = max([1] + [int(row[key]) for row in rows for key, _ in series])
    slot = (WIDTH - 2 * PAD) / max(1, len(rows))
    width = max(1.0, slot / (len(series) + 1))
    bars = []
    for i, row in enumerate(rows):
        for j, (key, css) in enumerate(series):
            value = int(row[key])
            height = (HEIGHT - 2 * PAD) * value / top
            bars.append(Bar(PAD + i * slot + j * width, HEIGHT - PAD - height, width, height,
                            f"{row['minute'].astimezone(timezone.utc):%H:%M} UTC {key}: {value}", css))
    return bars, top
