"""Plots as data: a figure is a JSON-able ``Plot`` first, a PNG second.

Every figure simdist draws (``python -m simdist.report``, ``scripts/validate_sim.py --plots``)
is built as a ``Plot`` of ``Panel``s of ``Series`` and only then handed to matplotlib by
``render``, which writes ``<name>.png`` and, beside it, ``<name>.json`` holding exactly the
series that were drawn. Tests compare that JSON with the artifacts it came from and ``draw``'s
artists with that JSON; no pixels are ever inspected.

A series is one of:

    line     x, y numbers, joined (markers optional)
    points   x, y numbers, markers only
    bar      x category labels, y heights; bars of one panel sharing a ``stack`` key stack
             on each other, different keys (or none) stand side by side
    hline    a horizontal reference at y[0] (a device's capacity, say); when it is far above
             everything else in a linear panel it is written as a note instead of drawn, so
             the data stays readable
    band     x, y (lower edge), y2 (upper edge), shaded

``source`` on a series says where its numbers came from (``"<file>:<key path>"``) and
``scale`` what they were divided by to reach the plotted unit, so a reader (or a test) can
trace each plotted value back to its artifact.

matplotlib is optional (``pip install simdist[report]``); nothing here imports it until a
plot is drawn.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Series",
    "Panel",
    "Plot",
    "MatplotlibMissing",
    "require_matplotlib",
    "draw",
    "render",
    "load_plot",
    "bytes_unit",
]

KINDS = ("line", "points", "bar", "hline", "band")
HLINE_OFFSCALE = 20.0  # an hline this many times above the panel's data becomes a note


class MatplotlibMissing(ImportError):
    """matplotlib is not installed."""

    def __init__(self) -> None:
        super().__init__("matplotlib is not installed: pip install simdist[report]")


@dataclass
class Series:
    label: str
    x: list[Any]
    y: list[float | None]
    kind: str = "line"
    y2: list[float] | None = None  # band: upper edge
    stack: str | None = None  # bar: bars with the same key stack
    marker: str | None = None
    linestyle: str | None = None
    color: str | None = None
    source: str = ""
    scale: float = 1.0  # plotted value = source value / scale

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"series {self.label!r}: kind must be one of {KINDS}")
        if self.kind != "hline" and len(self.x) != len(self.y):
            raise ValueError(f"series {self.label!r}: {len(self.x)} x but {len(self.y)} y")


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    series: list[Series] = field(default_factory=list)
    xscale: str = "linear"
    yscale: str = "linear"
    xlim: tuple[float, float] | None = None
    ylim: tuple[float, float] | None = None
    xticks: list[float] | None = None  # numeric axes: put ticks exactly here
    note: str = ""  # a second line under the title
    legend: bool = True


@dataclass
class Plot:
    name: str  # file stem: <name>.png and <name>.json
    title: str
    panels: list[Panel]
    cols: int = 2
    caption: str = ""
    panel_size: tuple[float, float] = (5.2, 3.8)  # inches

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plot:
        panels = []
        for p in data["panels"]:
            p = dict(p)
            p["series"] = [Series(**s) for s in p.get("series", [])]
            for key in ("xlim", "ylim"):
                if p.get(key) is not None:
                    p[key] = tuple(p[key])
            panels.append(Panel(**p))
        rest = {k: v for k, v in data.items() if k != "panels"}
        if rest.get("panel_size") is not None:
            rest["panel_size"] = tuple(rest["panel_size"])
        return cls(panels=panels, **rest)


def load_plot(path: str | Path) -> Plot:
    """The ``Plot`` written beside a PNG by ``render``."""
    return Plot.from_dict(json.loads(Path(path).read_text()))


def bytes_unit(largest: float) -> tuple[float, str]:
    """(divisor, name) of a binary unit that keeps ``largest`` readable."""
    for div, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= div:
            return float(div), name
    return 1.0, "bytes"


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or ``MatplotlibMissing``."""
    try:
        import matplotlib
    except ImportError as e:
        raise MatplotlibMissing() from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finite(values: list[Any]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def _draw_panel(ax: Any, panel: Panel) -> dict[int, Any]:
    """Draw one panel; returns {series index: its artist} for inspection."""
    artists: dict[int, Any] = {}
    ax.set_xscale(panel.xscale)  # first: a scale change resets the tick locators
    ax.set_yscale(panel.yscale)
    bars = [(i, s) for i, s in enumerate(panel.series) if s.kind == "bar"]
    categories: list[str] = list(dict.fromkeys(str(c) for _, s in bars for c in s.x))
    groups = list(dict.fromkeys(s.stack if s.stack is not None else f"#{i}" for i, s in bars))
    width = 0.8 / max(len(groups), 1)
    bottoms: dict[str, list[float]] = {g: [0.0] * len(categories) for g in groups}
    for i, s in bars:
        g = s.stack if s.stack is not None else f"#{i}"
        offset = (groups.index(g) - (len(groups) - 1) / 2) * width
        pos = [categories.index(str(c)) for c in s.x]
        heights = [0.0 if v is None else float(v) for v in s.y]
        base = [bottoms[g][p] for p in pos]
        artists[i] = ax.bar(
            [p + offset for p in pos],
            heights,
            width * 0.95,
            bottom=base,
            label=s.label,
            color=s.color,
        )
        for p, h in zip(pos, heights, strict=True):
            bottoms[g][p] += h
    if categories:
        ax.set_xticks(range(len(categories)))
        long = max(len(c) for c in categories) > 10 or len(categories) > 6
        ax.set_xticklabels(categories, rotation=25 if long else 0, ha="right" if long else "center")
        if len(categories) <= 2:  # keep a lone bar from filling the panel
            ax.set_xlim(-1, len(categories))

    data_top = [b for g in bottoms.values() for b in g]
    for i, s in enumerate(panel.series):
        style = {k: v for k, v in (("color", s.color),) if v is not None}
        if s.kind == "line":
            artists[i] = ax.plot(
                s.x, s.y, marker=s.marker, linestyle=s.linestyle or "-", label=s.label, **style
            )[0]
            data_top += _finite(s.y)
        elif s.kind == "points":
            artists[i] = ax.plot(
                s.x, s.y, marker=s.marker or "o", linestyle="none", label=s.label, **style
            )[0]
            data_top += _finite(s.y)
        elif s.kind == "band":
            artists[i] = ax.fill_between(s.x, s.y, s.y2, alpha=0.15, label=s.label, **style)
    for i, s in enumerate(panel.series):
        if s.kind != "hline":
            continue
        value = float(s.y[0])
        top = max(data_top, default=0.0)
        if (
            panel.yscale == "linear"
            and panel.ylim is None
            and top > 0
            and value > top * (HLINE_OFFSCALE)
        ):
            # drawing it would flatten the data to the axis: say where it is instead
            shown = f"{value:,.0f}" if value >= 100 else f"{value:.3g}"
            artists[i] = ax.text(
                0.98,
                0.96,
                f"{s.label}: {shown} {panel.ylabel} (off scale; {100 * top / value:.2g} % used)",
                transform=ax.transAxes,
                ha="right",
                va="top",
                fontsize=8,
            )
            ax.set_ylim(0, top * 1.15)  # room for the note
        else:
            artists[i] = ax.axhline(
                value, linestyle=s.linestyle or "--", color=s.color or "k", lw=1, label=s.label
            )
    if panel.xlim:
        ax.set_xlim(*panel.xlim)
    if panel.ylim:
        ax.set_ylim(*panel.ylim)
    if panel.xticks:
        ax.set_xticks(panel.xticks)
        ax.set_xticklabels([f"{t:g}" for t in panel.xticks])
        ax.minorticks_off()
    ax.set_title(panel.title + (f"\n{panel.note}" if panel.note else ""), fontsize=9)
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    labelled = [s for s in panel.series if s.label and not s.label.startswith("_")]
    if panel.legend and labelled and bars:  # beside the axes: stacks reach the top
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    elif panel.legend and labelled:
        ax.legend(fontsize=7)
    return artists


def draw(plot: Plot) -> tuple[Any, dict[tuple[int, int], Any]]:
    """The matplotlib figure of ``plot`` and {(panel, series): artist}."""
    plt = require_matplotlib()
    n = len(plot.panels)
    cols = max(1, min(plot.cols, n))
    rows = -(-n // cols)
    w, h = plot.panel_size
    fig, axes = plt.subplots(rows, cols, figsize=(w * cols, h * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    artists: dict[tuple[int, int], Any] = {}
    for p, (ax, panel) in enumerate(zip(axes.flat, plot.panels, strict=False)):
        for s, artist in _draw_panel(ax, panel).items():
            artists[(p, s)] = artist
    if plot.title:
        fig.suptitle(plot.title, fontsize=11)
    fig.tight_layout()
    return fig, artists


def render(plot: Plot, directory: str | Path, dpi: int = 110) -> tuple[Path, Path]:
    """Write ``<name>.png`` and ``<name>.json`` (the plotted data) into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plt = require_matplotlib()
    fig, _ = draw(plot)
    png = directory / f"{plot.name}.png"
    fig.savefig(png, dpi=dpi, metadata={"Software": None})  # no version: same data, same bytes
    plt.close(fig)
    data = directory / f"{plot.name}.json"
    data.write_text(json.dumps(plot.to_dict(), indent=1))
    return png, data
