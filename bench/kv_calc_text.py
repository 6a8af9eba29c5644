"""`pagedserve kv-calc`'s text report: summary lines (the seed's M_KV per token, the 8-bit
scales, the per-rank share under tensor parallelism), then one aligned row per layout."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.bench import kv_calc_dtype
from pagedserve.workers.kv.memory import LayoutUsage, dtype_bytes

if TYPE_CHECKING:
    from pagedserve.bench.kv_calc_inputs import KvCalcInputs


def _human_bytes(num_bytes: int) -> str:
    """e.g. ``128.0 KiB``, shown beside the exact byte count."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    exponent = min(max(num_bytes.bit_length() - 1, 0) // 10, len(units) - 1)
    return f"{num_bytes / 1024**exponent:.1f} {units[exponent]}"


def percent(useful: int, allocated: int) -> str:
    """Utilization as a percent with two decimals, from one correctly rounded division."""
    return f"{100 * useful / allocated:.2f}%"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Aligned columns: the first left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    return [line(header), *(line(row) for row in rows)]


def format_text(inputs: KvCalcInputs, layouts: list[LayoutUsage]) -> str:
    """The human-readable report: a few summary lines, then one table row per layout."""
    useful = sum(inputs.lengths)
    note = "" if inputs.max_len_given else " (default: the longest length; set with --max-len)"
    lines = [
        f"sequences: {len(inputs.lengths)} (lengths are the given inputs)",
        f"useful positions: {useful}",
        f"max-len: {inputs.max_len}{note}",
    ]
    shape = inputs.shape
    header = ["layout", "allocated", "wasted", "utilization", "block-table entries"]
    header += ["block-table bytes"]
    if shape is not None:
        m_kv = shape.kv_bytes_per_token
        b = dtype_bytes(shape.kv_value_dtype)
        lines.append(
            f"KV bytes per token: M_KV = 2*L*h_kv*d_h*b = 2*{shape.num_layers}*"
            f"{shape.num_kv_heads}*{shape.head_dim}*{b} ({shape.kv_value_dtype}) = {m_kv} "
            f"({_human_bytes(m_kv)})"
        )
        lines += kv_calc_dtype.text_lines(shape.kv_dtype, m_kv, shape.scale_bytes_per_token)
        if shape.tensor_parallel_size > 1:
            per_rank = shape.kv_bytes_per_token_per_rank
            lines.append(
                f"per rank (tensor parallel {shape.tensor_parallel_size}, KV heads split, the "
                f"fullest rank holds {shape.kv_heads_per_rank}): 2*{shape.num_layers}*"
                f"{shape.kv_heads_per_rank}*{shape.head_dim}*{b} = {per_rank} "
                f"({_human_bytes(per_rank)}) per token on each device"
            )
        lines.append(f"useful KV bytes: {useful * m_kv} ({_human_bytes(useful * m_kv)})")
        header += ["allocated bytes", "wasted bytes"]
    rows = []
    for layout in layouts:
        paged = layout.name == "paged"
        name = f"paged B={layout.block_size}" if paged else f"reserve-max {layout.max_len}"
        table = [str(layout.block_table_entries), str(layout.block_table_bytes)]
        row = [name, str(layout.allocated), str(layout.wasted)]
        row += [percent(layout.useful, layout.allocated), *(table if paged else ["-", "-"])]
        if shape is not None:
            row += [str(layout.allocated * m_kv), str(layout.wasted * m_kv)]
        rows.append(row)
    return "\n".join([*lines, "", *_table(header, rows)])
