"""The replay figure: the cumulative distribution of load-start delays per
policy. matplotlib is imported inside :func:`plot_report` only
(with the non-interactive Agg backend), so importing this module costs
nothing and works without matplotlib installed.
"""

from __future__ import annotations

import os

from blockpool.core.errors import BlockPoolError
from blockpool.replay.report import NEGATIVE_CONTROL, ReplayReport, plural

__all__ = ["ZERO_LINTHRESH_MS", "PlotUnavailableError", "figure", "plot_report", "require_matplotlib"]

ZERO_LINTHRESH_MS = 0.01
"""Below this delay (ms) the x axis is linear, so 0 ms is a point on it."""


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
        import matplotlib.pyplot
    except ImportError as e:
        raise PlotUnavailableError(
            f"--plot needs matplotlib ({e}); pip install 'blockpool[replay]'"
        ) from None


def plot_report(report: ReplayReport, path: str | os.PathLike[str]) -> None:
    """Write a PNG (:func:`figure`). O(loads).

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
    """The replay figure (a matplotlib ``Figure``): the cumulative
    distribution of load-start delays (simulated ms, on a symmetric-log axis
    linear below :data:`ZERO_LINTHRESH_MS`, so a 0 ms step is visible) of
    every policy that made loads, labelled with its races (the negative
    control named as such). A caption says why the step at 0 ms need not be
    the table's empty-fence share, with the figures where they differ.
    The legend sits outside the plotting area
    and lists only series that are drawn; the title names the policies
    without loads, and a run in which no policy made a load gets the empty
    axes with a note saying so. O(loads).

    Raises:
        PlotUnavailableError: matplotlib cannot be imported.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailableError(
            f"--plot needs matplotlib ({e}); pip install 'blockpool[replay]'"
        ) from None

    fig, ax1 = plt.subplots(1, 1, figsize=(12, 5.5))
    no_loads = []
    notes = []
    for r in report.results:
        d = sorted(r.load_delays_ms)
        control = " (negative control)" if r.policy == NEGATIVE_CONTROL else ""
        if not d:
            no_loads.append(r.policy)
            continue
        ys = [(i + 1) / len(d) for i in range(len(d))]
        ax1.step(
            [0.0, *d] if d[0] > 0 else d,
            [0.0, *ys] if d[0] > 0 else ys,
            where="post",
            label=f"{r.policy}{control}: {plural(r.races, 'race')}, mean {r.load_delay_mean_ms:.2f} ms, n={len(d)}",
        )
        at_zero = sum(1 for x in d if x == 0.0) / len(d)
        if abs(100.0 * at_zero - r.loads_empty_fence_pct) >= 0.05:
            notes.append(
                f"{r.policy}: {100.0 * at_zero:.1f}% start at 0 ms, {r.loads_empty_fence_pct:.1f}% had an empty fence"
            )
    ax1.set_xscale("symlog", linthresh=ZERO_LINTHRESH_MS)
    ax1.set_xlim(left=-ZERO_LINTHRESH_MS)  # 0 ms is a visible step, not the axis edge
    ax1.axvline(0.0, color="grey", linestyle=":", linewidth=0.8)
    ax1.set_xlabel(
        f"load-start delay (simulated ms; symmetric log axis, linear below {ZERO_LINTHRESH_MS} ms; dotted: 0 ms)"
    )
    ax1.set_ylabel("cumulative fraction of loads (delay <= x)")
    title = f"Load-start delay per policy, cumulative: {report.source} ({plural(report.requests, 'request')})"
    if no_loads:
        title += f"; no loads: {', '.join(no_loads)}"
    ax1.set_title(title)
    ax1.grid(True, alpha=0.3)
    if len(no_loads) < len(report.results):  # a series drawn (the dotted 0 ms line is not one)
        ax1.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)
    else:
        ax1.set_ylim(0.0, 1.0)
        ax1.text(
            0.5, 0.5, "no policy made a load: no load-start delays to draw",
            transform=ax1.transAxes, ha="center", va="center", fontsize=11, color="grey",
        )  # fmt: skip
    caption = (
        "The step at 0 ms is the loads that started at once. An empty fence (the table's empty%) need not "
        "start at once (its stream may be busy), and a fenced load whose waits already ended does."
    )
    if notes:
        caption += " Here: " + "; ".join(notes) + "."
    fig.text(0.01, 0.01, caption, fontsize=7, wrap=True, va="bottom")
    fig.subplots_adjust(bottom=0.2)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig
