"""Render the committed dashboards to PNG from a live Prometheus, with matplotlib.

    python -m dashboards.render --prometheus http://127.0.0.1:9090 --out docs/img/
    python -m dashboards.render --prometheus URL --start 1764430000 --end 1764430600 --step 2

Each dashboard becomes one PNG laid out like Grafana's grid (24 columns, rows as bands): every
panel runs its targets with query_range (tables: an instant query at the end), with Grafana's
variables set to "All" and `$__rate_interval` replaced. Used for the README and by
tests/test_dashboards_live.py, which asserts on `query_dashboard()` directly.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dashboards.promql import substitute

HERE = Path(__file__).resolve().parent
DASHBOARDS = ("load-pipeline.json", "errors-and-store.json")


# --- querying -----------------------------------------------------------------------------------

@dataclass
class Series:
    labels: dict[str, str]
    times: list[float]
    values: list[float]

    @property
    def has_data(self) -> bool:
        return any(not math.isnan(v) for v in self.values)


@dataclass
class TargetResult:
    expr: str  # as sent (variables substituted)
    legend: str
    series: list[Series] = field(default_factory=list)
    error: str = ""

    @property
    def has_data(self) -> bool:
        return any(s.has_data for s in self.series)


@dataclass
class PanelResult:
    panel: dict
    targets: list[TargetResult]

    @property
    def title(self) -> str:
        return self.panel["title"]

    @property
    def has_data(self) -> bool:
        return any(t.has_data for t in self.targets)


def _get(prometheus: str, path: str, params: dict) -> dict:
    url = prometheus.rstrip("/") + path + "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:  # 400 carries the PromQL error as JSON
        body = json.loads(e.read() or b"{}") or {"status": "error", "error": str(e)}
    if body.get("status") != "success":
        raise ValueError(body.get("error", body))
    return body["data"]


def _float(v: str) -> float:
    try:
        return float(v)
    except ValueError:
        return math.nan


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        if p.get("type") == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def query_panel(prometheus: str, panel: dict, start: float, end: float, step: float,
                rate_interval: str) -> PanelResult:
    results = []
    for t in panel.get("targets", []):
        expr = substitute(t["expr"], rate_interval=rate_interval)
        tr = TargetResult(expr=expr, legend=t.get("legendFormat", ""))
        try:
            if t.get("instant"):
                data = _get(prometheus, "/api/v1/query", {"query": expr, "time": end})
                for r in data["result"]:
                    ts, v = r["value"]
                    tr.series.append(Series(r["metric"], [float(ts)], [_float(v)]))
            else:
                data = _get(prometheus, "/api/v1/query_range",
                            {"query": expr, "start": start, "end": end, "step": step})
                for r in data["result"]:
                    tr.series.append(Series(r["metric"], [float(ts) for ts, _ in r["values"]],
                                            [_float(v) for _, v in r["values"]]))
        except (ValueError, OSError) as e:
            tr.error = str(e)
        results.append(tr)
    return PanelResult(panel, results)


def query_dashboard(prometheus: str, dash: dict, start: float, end: float, step: float,
                    rate_interval: str) -> list[PanelResult]:
    return [query_panel(prometheus, p, start, end, step, rate_interval) for p in panels(dash)]


def load_dashboards(names: tuple[str, ...] = DASHBOARDS) -> dict[str, dict]:
    return {n: json.loads((HERE / n).read_text()) for n in names}


# --- units and legends --------------------------------------------------------------------------

def legend(fmt: str, labels: dict[str, str]) -> str:
    if not fmt or fmt == "__auto":
        pairs = [f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__"]
        return ", ".join(pairs) or "value"
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)
    return re.sub(r"\s+", " ", text).strip()


_SCALES = {
    "s": [(1, "s"), (1e-3, "ms"), (1e-6, "µs")],
    "Bps": [(1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s"), (1, "B/s")],
    "bytes": [(2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B")],
    "ops": [(1, "/s")],
    "reqps": [(1, "req/s")],
    "percentunit": [(0.01, "%")],
    "short": [(1e6, "M"), (1e3, "k"), (1, "")],
}


def unit_scale(unit: str, values: list[float]) -> tuple[float, str]:
    """A divisor and suffix that keep the axis readable (what Grafana's unit would show)."""
    scales = _SCALES.get(unit, [(1, unit)])
    if unit in ("percentunit", "ops", "reqps"):
        return scales[0]
    finite = [abs(v) for v in values if not math.isnan(v) and v != 0]
    peak = max(finite) if finite else 0
    for div, suffix in scales:
        if peak >= div:
            return div, suffix
    return scales[-1]


# --- drawing ------------------------------------------------------------------------------------

_UNIT_IN = 0.30  # inches per Grafana grid row unit (30 px)
_FIG_W = 22.0  # inches for 24 grid columns
_HEADER_IN = 0.7


def render_dashboard(dash: dict, results: list[PanelResult], out: Path, start: float,
                     end: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_id = {r.panel["id"]: r for r in results}
    height_units = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dash["panels"])
    fig_h = _HEADER_IN + height_units * _UNIT_IN + 0.2
    fig = plt.figure(figsize=(_FIG_W, fig_h), dpi=90)
    span = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(start)) + " to " + \
        time.strftime("%H:%M:%S", time.localtime(end))
    fig.text(0.01, 1 - 0.35 / fig_h, dash["title"], fontsize=16, fontweight="bold", va="center")
    variables = [v["name"] for v in dash.get("templating", {}).get("list", [])
                 if v.get("type") == "query"]
    fig.text(0.99, 1 - 0.35 / fig_h, f"{span}   {', '.join(variables)} = All",
             fontsize=10, color="#555555", ha="right", va="center")

    def box(g: dict) -> tuple[float, float, float, float]:
        """Figure-fraction rectangle (x0, y0, w, h) of a grid cell, in inches converted."""
        x0 = 0.15 + g["x"] / 24 * (_FIG_W - 0.3)
        w = g["w"] / 24 * (_FIG_W - 0.3)
        top = _HEADER_IN + g["y"] * _UNIT_IN
        return x0, top, w, g["h"] * _UNIT_IN

    for p in dash["panels"]:
        x0, top, w, h = box(p["gridPos"])
        if p.get("type") == "row":
            y = 1 - (top + 0.2) / fig_h
            fig.text(x0 / _FIG_W, y, p["title"], fontsize=13, fontweight="bold", color="#1f3b73",
                     va="center")
            fig.add_artist(plt.Line2D([x0 / _FIG_W, (x0 + w) / _FIG_W],
                                      [y - 0.14 / fig_h] * 2, color="#1f3b73", lw=0.8))
            continue
        r = by_id[p["id"]]
        unit = p["fieldConfig"]["defaults"].get("unit", "")
        # Inside the cell: 0.3 in title, the plot, 0.25 in ticks, the legend rows, 0.15 in gap.
        if p["type"] == "table":
            rect = [(x0 + 0.1) / _FIG_W, 1 - (top + h - 0.1) / fig_h, (w - 0.2) / _FIG_W,
                    (h - 0.5) / fig_h]
            ax = fig.add_axes(rect)
            _draw_table(ax, r)
        else:
            left, right = 0.65, 0.15
            names = [name for name, _ in _lines(r)]
            # Legend columns that fit the panel width: ~0.07 in per character at 8 pt.
            col_in = 0.45 + 0.07 * max((len(n) for n in names), default=0)
            ncol = max(1, min(len(names), int((w - left) // col_in)))
            keys = {_pair_key(n) for n in names}
            if all(n.startswith(("p50", "p99")) for n in names) and len(keys) <= ncol:
                ncol = len(keys)  # one legend column per series: p99 above its p50
            legend_in = 0.19 * math.ceil(len(names) / ncol) if names else 0
            plot_top, plot_bottom = top + 0.35, top + h - 0.45 - legend_in
            rect = [(x0 + left) / _FIG_W, 1 - plot_bottom / fig_h, (w - left - right) / _FIG_W,
                    (plot_bottom - plot_top) / fig_h]
            ax = fig.add_axes(rect)
            _draw_timeseries(ax, r, unit, start, end, ncol, legend_in)
        ax.set_title(p["title"], fontsize=11, fontweight="bold", loc="left", pad=5)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def _draw_timeseries(ax, r: PanelResult, unit: str, start: float, end: float, ncol: int,
                     legend_in: float) -> None:
    import datetime as dt

    import matplotlib
    import matplotlib.dates as mdates

    lines = _lines(r)
    div, suffix = unit_scale(unit, [v for _, s in lines for v in s.values])
    ax.set_xlim(dt.datetime.fromtimestamp(start), dt.datetime.fromtimestamp(end))
    ax.xaxis.set_major_locator(mdates.AutoDateLocator(maxticks=6))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.3)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if not lines:
        errors = [t.error for t in r.targets if t.error]
        ax.text(0.5, 0.5, "query error: " + errors[0][:80] if errors else "No data",
                ha="center", va="center", fontsize=12, color="grey", transform=ax.transAxes)
        ax.set_yticks([])
        return
    ax.set_ylabel(suffix, fontsize=9)
    cmap = matplotlib.colormaps["tab10"]
    colors: dict[str, object] = {}
    peak = 0.0
    for name, s in lines:
        color = colors.setdefault(_pair_key(name), cmap(len(colors) % 10))
        ys = [v / div for v in s.values]
        peak = max([peak] + [y for y in ys if not math.isnan(y)])
        xs = [dt.datetime.fromtimestamp(x) for x in s.times]
        style = "--" if name.startswith("p50") else "-"
        ax.plot(xs, ys, style, lw=1.4, color=color, label=name)
    if unit == "percentunit":
        ax.set_ylim(0, 105)
    else:
        ax.set_ylim(0, peak * 1.08 if peak > 0 else 1)
    if peak == 0:
        ax.text(0.5, 0.55, "every series is 0", ha="center", va="center", fontsize=11,
                color="grey", transform=ax.transAxes)
    ax.legend(loc="upper left", bbox_to_anchor=(0, -0.06 - 0.25 / ax.figure.get_figheight() /
                                                ax.get_position().height),
              ncol=ncol, fontsize=8, frameon=False, handlelength=1.8,
              columnspacing=1.2, borderaxespad=0)


def _pair_key(name: str) -> str:
    """The series a p50/p99 legend belongs to ("p99 thread 3" -> "thread 3")."""
    return re.sub(r"^p(50|99)\b ?", "", name)


def _lines(r: PanelResult) -> list[tuple[str, Series]]:
    """(legend, series) of every series with data: natural order, each p99 next to its p50."""
    lines = [(legend(t.legend, s.labels), s) for t in r.targets for s in t.series if s.has_data]
    return sorted(lines, key=lambda x: (_natural(_pair_key(x[0])), not x[0].startswith("p99"),
                                        _natural(x[0])))


def _draw_table(ax, r: PanelResult) -> None:
    ax.axis("off")
    rows = [s for t in r.targets for s in t.series]
    if not rows:
        ax.text(0.5, 0.5, "No data", ha="center", va="center", color="grey",
                transform=ax.transAxes)
        return
    hide: dict = {}
    rename: dict = {}
    for tr in r.panel.get("transformations", []):  # Grafana's "organize" transformation
        hide |= tr.get("options", {}).get("excludeByName", {})
        rename |= tr.get("options", {}).get("renameByName", {})
    cols = sorted({k for s in rows for k in s.labels if k != "__name__" and not hide.get(k)})
    rows.sort(key=lambda s: [_natural(s.labels.get(c, "")) for c in cols])
    show_value = not hide.get("Value")
    cells = [[s.labels.get(c, "") for c in cols] + ([f"{s.values[-1]:g}"] if show_value else [])
             for s in rows]
    header = [rename.get(c, c) for c in cols] + ([rename.get("Value", "Value")]
                                                 if show_value else [])
    ax_h_in = ax.get_position().height * ax.figure.get_figheight()
    table_h = min(1.0, 0.27 * (len(cells) + 1) / ax_h_in)
    tab = ax.table(cellText=cells, colLabels=header, cellLoc="left", colLoc="left",
                   bbox=[0, 1 - table_h, 1, table_h])
    tab.auto_set_font_size(False)
    tab.set_fontsize(10)
    for (row, _), cell in tab.get_celld().items():
        cell.set_edgecolor("#cccccc")
        if row == 0:
            cell.set_text_props(fontweight="bold")
            cell.set_facecolor("#eef2f8")


def _natural(s: str) -> list:
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", s)]


# --- CLI ----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prometheus", required=True, help="Prometheus base URL")
    ap.add_argument("--out", type=Path, default=HERE.parent / "docs" / "img",
                    help="output directory (the docs site's pictures)")
    ap.add_argument("--start", type=float, help="unix seconds (default: end - --minutes)")
    ap.add_argument("--end", type=float, help="unix seconds (default: now)")
    ap.add_argument("--minutes", type=float, default=15, help="window when --start is not given")
    ap.add_argument("--step", type=float, help="query_range step in seconds")
    ap.add_argument("--rate-interval",
                    help="value for $__rate_interval (default: max(15s, 4 step))")
    args = ap.parse_args(argv)
    end = args.end or time.time()
    start = args.start or end - args.minutes * 60
    step = args.step or max(1.0, round((end - start) / 300))
    rate_interval = args.rate_interval or f"{int(max(15, 4 * step))}s"
    for name, dash in load_dashboards().items():
        results = query_dashboard(args.prometheus, dash, start, end, step, rate_interval)
        out = render_dashboard(dash, results, args.out / name.replace(".json", ".png"),
                               start, end)
        empty = [r.title for r in results if not r.has_data]
        print(f"wrote {out} ({len(results) - len(empty)}/{len(results)} panels with data"
              + (f"; empty: {', '.join(empty)}" if empty else "") + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
