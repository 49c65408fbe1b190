"""HBPModelSummary: Lightning's model summary without a FLOPs count it did not measure.

Lightning 2.6 counts FLOPs by running the module's ``example_input_array`` through it; an HBP module has
none (its batches are packs planned at run time, ``HBPDataModule``), so every fit printed a FLOPs column
of zeros and ``Total FLOPs: 0``, a number that reads as measured. The column and the total are left out
when nothing was counted, and kept for a module that has an example input.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from lightning.pytorch.utilities.model_summary.model_summary import (
    _format_summary_table,
    get_formatted_model_size,
    get_human_readable_count,
)

log = logging.getLogger("lightning.pytorch.callbacks.model_summary")  # where Lightning's summary is logged


class HBPModelSummary(ModelSummary):
    """``ModelSummary`` (the rich table when ``rich`` is installed, as Lightning's default) whose FLOPs
    column and total appear only when Lightning counted some. The CLI adds it in place of Lightning's
    default summary; in a Lightning project of one's own pass ``Trainer(callbacks=[HBPModelSummary()])``."""

    def __init__(self, max_depth: int = 1, rich: bool | None = None, **summarize_kwargs: Any) -> None:
        super().__init__(max_depth, **summarize_kwargs)
        self.rich = _RICH_AVAILABLE if rich is None else rich

    def summarize(  # Lightning's is a staticmethod called through the instance: same arguments
        self,
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        flops = bool(total_flops)
        columns = [(name, values) for name, values in summary_data if flops or name != "FLOPs"]
        if not self.rich:
            table = _format_summary_table(
                total_parameters, trainable_parameters, model_size, total_training_modes, total_flops, *columns
            )
            log.info("\n" + (table if flops else table.rsplit("\n", 1)[0]))  # the last line: "... Total Flops"
            return
        from rich import get_console
        from rich.table import Table

        console = get_console()
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        right = {"Params", "Params per Device", "FLOPs", "In sizes", "Out sizes"}
        for i, (name, _) in enumerate(columns):
            table.add_column(name if i else " ", justify="right" if name in right else "left", no_wrap=name == "Name")
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        console.print(table)
        grid = Table.grid(expand=True)
        grid.add_column()
        rows = {
            "Trainable params": get_human_readable_count(int(trainable_parameters)),
            "Non-trainable params": get_human_readable_count(int(total_parameters - trainable_parameters)),
            "Total params": get_human_readable_count(int(total_parameters)),
            "Total estimated model params size (MB)": get_formatted_model_size(model_size),
            "Modules in train mode": total_training_modes["train"],
            "Modules in eval mode": total_training_modes["eval"],
        }
        if flops:
            rows["Total FLOPs"] = get_human_readable_count(total_flops)
        for name, value in rows.items():
            grid.add_row(f"[bold]{name}[/]: {value}")
        console.print(grid)
