"""The `kv-calc --plot` figure: utilization against block size, with the reserve-max line."""

from __future__ import annotations

from typing import Any

from pagedserve.bench.kv_calc import PLOT_SWEEP, lengths_note
from pagedserve.bench.kv_calc_inputs import KvCalcInputs
from pagedserve.bench.kv_calc_text import percent
from pagedserve.workers.kv.memory import paged_usage, reserve_max_usage


def write_plot(path: str, inputs: KvCalcInputs) -> None:
    """Utilization against block size over a sweep, with the reserve-max line, as a PNG.

    Uses matplotlib's object API on an Agg canvas, so no global backend or pyplot state is
    touched, and matplotlib is imported only when a plot is asked for.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sweep = sorted(set(PLOT_SWEEP) | set(inputs.block_sizes))
    swept = [100 * paged_usage(inputs.lengths, size).utilization for size in sweep]
    reserve = reserve_max_usage(inputs.lengths, inputs.max_len)

    fig = Figure(figsize=(9, 5.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(sweep, swept, marker="o", color="C0", label="paged: U = sum n / sum B*ceil(n/B)")
    ax.axhline(
        100 * reserve.utilization,
        color="C1",
        linestyle="--",
        label=f"reserve-max {inputs.max_len}: {percent(reserve.useful, reserve.allocated)}",
    )
    _mark_block_sizes(ax, inputs)
    _label_axes(ax, sweep)
    fig.text(0.01, 0.01, lengths_note(inputs.lengths), fontsize=8, style="italic")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, format="png")


def _mark_block_sizes(ax: Any, inputs: KvCalcInputs) -> None:
    """Ring and label the requested block sizes on the sweep."""
    for size in inputs.block_sizes:
        usage = paged_usage(inputs.lengths, size)
        y = 100 * usage.utilization
        ax.plot([size], [y], marker="o", markersize=11, fillstyle="none", color="C3")
        ax.annotate(
            f"B={size}\n{percent(usage.useful, usage.allocated)}",
            (size, y),
            textcoords="offset points",
            xytext=(0, -30),
            ha="center",
            fontsize=9,
            color="C3",
        )


def _label_axes(ax: Any, sweep: list[int]) -> None:
    """Log2 x axis ticked at every swept block size; utilization in percent on y."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sweep))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(sweep, [str(size) for size in sweep], fontsize=8)
    ax.set_ylim(0, 105)
    ax.set_xlabel("block size B (tokens per block, log2 scale)")
    ax.set_ylabel("utilization U = useful / allocated positions (%)")
    ax.set_title("KV cache position utilization vs block size")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left")
