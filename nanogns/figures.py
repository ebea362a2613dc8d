"""
The analysis' figures as PNG files (gns-analysis --figures DIR), drawn with matplotlib, which the
`figures` extra installs: the GNS of each parameter group over tokens, and the normalisation layers'
GNS against the total, as in Gray et al. 2024 (the LayerNorm gradients alone predict the GNS).

matplotlib's Figure object draws them, not pyplot: no window, no global backend to choose. Each
file is written atomically (nanogns.runlog.atomic_write), at a fixed size in pixels, PIXELS.
"""
import os

import numpy as np

from nanogns.logread import x_axis
from nanogns.runlog import atomic_write

INCHES, DPI = (9, 5), 100
PIXELS = (INCHES[0] * DPI, INCHES[1] * DPI)  # width, height of every figure
GNS_FIGURE = "gns_over_tokens.png"
NORM_FIGURE = "norm_vs_total.png"


def positive(values):
    """The values a log axis can show: NaN where not positive (a GNS below 0 is an estimate gone astray)."""
    values = np.asarray(values, dtype=float)
    return np.where(values > 0, values, np.nan)


def gns_figure(results, info):
    """The main estimator's GNS over the x axis (tokens where logged), total and per layer type."""
    from matplotlib.figure import Figure
    x_name, x = x_axis(results)
    fig = Figure(figsize=INCHES, dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    drawn = False
    for group in ["total"] + info["type_groups"]:
        y = positive(results[f"{group}/gns"])
        if np.isfinite(y).any():
            drawn = True
            ax.plot(x, y, color="black" if group == "total" else None, lw=2 if group == "total" else 1.2,
                    label=f"{group} ({len(info['groups'][group])} parameters)" if info["main"] != "ddp" else group)
    if drawn:
        ax.set_yscale("log")
        ax.legend(fontsize=9)
    else:
        ax.text(0.5, 0.5, "no positive GNS to draw", ha="center", transform=ax.transAxes)
    ax.set(xlabel=x_name.replace("_", " "), ylabel="GNS (examples)",
           title=f"GNS over {x_name.replace('_', ' ')} by layer type ({info['main']})")
    return fig


def norm_figure(results, info, compared):
    """The normalisation group's GNS against the total's, over the steps `compared` (the summary's),
    coloured by the x axis, with the line where they are equal."""
    from matplotlib.figure import Figure
    norm = info["norm_group"]
    fig = Figure(figsize=INCHES, dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    c = info["comparison"]
    if norm is None or compared is None or not compared.any():
        why = ("no LayerNorm or RMSNorm parameters in the log" if norm is None
               else f"no step where both the {norm} and the total GNS are defined")
        ax.text(0.5, 0.5, why, ha="center", transform=ax.transAxes)
        ax.set(xlabel="total GNS", ylabel="normalisation layers' GNS", title=f"normalisation layers vs total ({info['main']})")
        return fig
    x_name, x = x_axis(results)
    total, part = (positive(results[f"{g}/gns"])[compared] for g in ("total", norm))
    drawn = np.isfinite(total) & np.isfinite(part)
    if drawn.any():  # log axes, as the GNS spans decades
        total, part = total[drawn], part[drawn]
        points = ax.scatter(total, part, c=x[compared][drawn], s=10, cmap="viridis")
        fig.colorbar(points, ax=ax, label=x_name.replace("_", " "))
        ends = [min(total.min(), part.min()), max(total.max(), part.max())]
        ax.plot(ends, ends, "k--", lw=1, label=f"{norm} GNS = total GNS")
        ax.set(xscale="log", yscale="log")
    left = int((~drawn).sum())
    if left:  # named in the legend: the ratio and r in the title count them
        ax.plot([], [], " ", label=f"{left} of the {len(drawn)} steps have a GNS <= 0: not drawn")
    ax.legend(fontsize=9, loc="upper left")
    r = f", Pearson r {c['pearson']:.3f}" if np.isfinite(c["pearson"]) else ""
    ax.set(xlabel="total GNS", ylabel=f"{norm} GNS",
           title=f"{norm} vs total GNS ({info['main']}, {c['steps']} steps): ratio median {c['ratio_median']:.3f}{r}")
    return fig


def write_figures(results, info, compared, folder):
    """Writes folder/GNS_FIGURE and folder/NORM_FIGURE (the folder made if missing); returns their
    paths. compared: the mask of the steps the summary compares the normalisation group on."""
    os.makedirs(folder, exist_ok=True)
    written = []
    for name, fig in ((GNS_FIGURE, gns_figure(results, info)), (NORM_FIGURE, norm_figure(results, info, compared))):
        path = os.path.join(folder, name)
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=DPI))
        written.append(path)
    return written
