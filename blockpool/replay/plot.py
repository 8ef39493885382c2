"""The replay figure: load-start delay distribution per policy and a short
stream timeline. matplotlib is imported inside :func:`plot_report` only
(with the non-interactive Agg backend), so importing this module costs
nothing and works without matplotlib installed.
"""

from __future__ import annotations

import os

from blockpool.core.errors import BlockPoolError
from blockpool.replay.report import NEGATIVE_CONTROL, ReplayReport

__all__ = ["TIMELINE_SPAN_S", "PlotUnavailableError", "figure", "plot_report", "require_matplotlib"]

TIMELINE_SPAN_S = 0.6
"""Simulated seconds shown each side of the first load in the timeline."""

_COLORS = {"forward": "#4c72b0", "cow-copy": "#dd8452", "load": "#55a868", "store": "#c44e52"}


class PlotUnavailableError(BlockPoolError, ImportError):
    """matplotlib is not installed (``pip install 'blockpool[replay]'``)."""


def require_matplotlib() -> None:
    """Import matplotlib now (the CLI calls it before a replay with
    ``--plot``, so a missing matplotlib fails at once, not after the run).
    O(1) after the first call.

    Raises:
        PlotUnavailableError: matplotlib cannot be imported.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except ImportError as e:
        raise PlotUnavailableError(f"--plot needs matplotlib ({e}); pip install 'blockpool[replay]'") from None


def plot_report(report: ReplayReport, path: str | os.PathLike[str]) -> None:
    """Write a PNG (:func:`figure`). O(loads + timeline works).

    Raises:
        PlotUnavailableError: matplotlib cannot be imported.
        OSError: ``path`` cannot be written.
    """
    fig = figure(report)
    import matplotlib.pyplot as plt

    try:
        fig.savefig(os.fspath(path), dpi=110, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)


def figure(report: ReplayReport):  # type: ignore[no-untyped-def]
    """The replay figure (a matplotlib ``Figure``): on top, the cumulative
    distribution of load-start delays (simulated ms, symmetric-log axis) of
    every policy that made loads, labelled with its races (the negative
    control named as such); below, the streams of the first policy around
    its first load (bars: works, by what they do; hatched: failed). Legends
    sit outside the plotting areas and list only series that are drawn.
    O(loads + timeline works).

    Raises:
        PlotUnavailableError: matplotlib cannot be imported.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailableError(f"--plot needs matplotlib ({e}); pip install 'blockpool[replay]'") from None

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 8), gridspec_kw={"height_ratios": [3, 2]})
    no_loads = []
    for r in report.results:
        d = sorted(r.load_delays_ms)
        control = " (negative control)" if r.policy == NEGATIVE_CONTROL else ""
        if not d:
            no_loads.append(r.policy)
            continue
        ys = [(i + 1) / len(d) for i in range(len(d))]
        ax1.step(
            d,
            ys,
            where="post",
            label=f"{r.policy}{control}: {r.races} races, mean {r.load_delay_mean_ms:.2f} ms, n={len(d)}",
        )
    ax1.set_xscale("symlog", linthresh=0.01)
    ax1.set_xlabel("load-start delay (simulated ms)")
    ax1.set_ylabel("fraction of loads")
    title = f"Load-start delay per policy: {report.source} ({report.requests} requests)"
    if no_loads:
        title += f"; no loads: {', '.join(no_loads)}"
    ax1.set_title(title)
    ax1.grid(True, alpha=0.3)
    if ax1.get_lines():
        ax1.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)

    if report.results:
        first = report.results[0]
        works = first.timeline
        mid = first.timeline_at if first.timeline_at is not None else (works[-1].start if works else 0.0)
        lo, hi = mid - TIMELINE_SPAN_S, mid + TIMELINE_SPAN_S
        streams = sorted({w.token.stream for w in works})
        shown: set[str] = set()
        for y, s in enumerate(streams):
            for w in works:
                if w.token.stream != s or w.end < lo or w.start > hi:
                    continue
                shown.add(w.what if w.what in _COLORS else "other")
                ax2.broken_barh(
                    [(w.start, max(w.end - w.start, 1e-5))],
                    (y - 0.35 + 0.7 * (w.lane % 4) / 4, 0.7 / 4 if w.lane or s in ("rdma", "xfer") else 0.7),
                    facecolors=_COLORS.get(w.what, "grey"),
                    hatch="//" if w.failed else None,
                    edgecolor="black",
                    linewidth=0.3,
                )
        ax2.set_yticks(range(len(streams)), streams)
        ax2.set_xlim(lo, hi)
        ax2.set_xlabel("simulated time (s)")
        ax2.set_title(f"Streams around the first load ({first.policy})")
        kinds = [k for k in (*_COLORS, "other") if k in shown]
        if kinds:
            handles = [plt.Rectangle((0, 0), 1, 1, color=_COLORS.get(k, "grey")) for k in kinds]
            ax2.legend(handles, kinds, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)
    fig.tight_layout()
    return fig
