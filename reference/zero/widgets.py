"""ipywidgets explorers: controls wired to the course's formulas and pictures.

An explorer is an ``ipywidgets.VBox`` of controls, a summary and the picture; each change
calls `update()`, which redraws the figure into ``.figure`` and, as PNG bytes, an ``Image``
widget (no pyplot, no ``Output``), so it works with no frontend: in a test, or headless.

    calc = memory_calculator(num_params=7.5e9, dp=64, stage=3, precision="mixed")
    calc                    # the live widget in JupyterLab
    calc.figure             # the figure of the current settings
"""
from __future__ import annotations

import io
from typing import Optional

import ipywidgets as widgets

from reference.memory import STAGE_NAMES, Precision, model_state_bytes
from reference.viz import fmt_bytes
from reference.zero.viz import plot_memory_calculator

__all__ = ["PRECISIONS", "DEVICES", "MemoryCalculator", "memory_calculator"]

# name -> (label, bytes per parameter for params, grads, optimizer state)
PRECISIONS = {
    "fp32": ("fp32 Adam (4 + 4 + 8)", Precision.fp32_adam()),
    "mixed": ("mixed-precision Adam (2 + 2 + 12)", Precision.mixed_adam()),
}
# Memory of one accelerator, to see whether the model states fit (decimal GB).
DEVICES = {"none": None, "24 GB": 24e9, "40 GB": 40e9, "80 GB": 80e9, "141 GB": 141e9}


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    return buf.getvalue()


class MemoryCalculator(widgets.VBox):
    """Model-state bytes per rank (`reference.memory.model_state_bytes`) over `num_params` (1M to
    1T), `dp`, `stage` (0 = plain data parallelism), `precision` and `device` (its memory)."""

    def __init__(self, num_params: float = 7.5e9, dp: int = 64, stage: int = 3,
                 precision: str = "mixed", device: str = "80 GB"):
        if stage not in STAGE_NAMES:
            raise ValueError(f"stage must be 0 (data parallel), 1, 2 or 3, got {stage!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
        if device not in DEVICES:
            raise ValueError(f"device must be one of {list(DEVICES)}, got {device!r}")
        if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
            raise ValueError(f"dp must be a positive int, got {dp!r}")
        if not 1e6 <= num_params <= 1e12:
            raise ValueError(f"num_params must be between 1e6 and 1e12, got {num_params!r}")
        style = dict(description_width="110px")
        # Buttons as wide as their labels: the default width cuts "mixed-precision Adam ...".
        buttons = dict(description_width="110px", button_width="auto")
        self.num_params = widgets.FloatLogSlider(value=num_params, base=10, min=6, max=12, step=0.01,
                                                 description="parameters Ψ", readout_format=".3g",
                                                 continuous_update=False, style=style)
        self.dp = widgets.BoundedIntText(value=dp, min=1, max=1_000_000, description="dp size",
                                         style=style)
        self.stage = widgets.ToggleButtons(options=[("DDP", 0), ("ZeRO-1", 1), ("ZeRO-2", 2),
                                                    ("ZeRO-3", 3)], value=stage, description="stage",
                                           style=buttons)
        self.precision = widgets.ToggleButtons(options=[(label, key) for key, (label, _) in PRECISIONS.items()],
                                               value=precision, description="precision", style=buttons)
        self.device = widgets.Dropdown(options=list(DEVICES), value=device, description="device memory",
                                       style=style)
        self.summary = widgets.HTML()
        self.image = widgets.Image(format="png")
        self.figure = None
        super().__init__([self.num_params, self.dp, self.stage, self.precision, self.device,
                          self.summary, self.image])
        for control in (self.num_params, self.dp, self.stage, self.precision, self.device):
            control.observe(self._on_change, names="value")
        self.update()

    def _on_change(self, change) -> None:
        self.update()

    def bytes_per_rank(self):
        """`MemoryBytes` of the current settings."""
        _, precision = PRECISIONS[self.precision.value]
        return model_state_bytes(int(self.num_params.value), self.dp.value, self.stage.value, precision)

    def update(self):
        """Recompute for the controls' current values, redraw, and return the figure."""
        label, precision = PRECISIONS[self.precision.value]
        psi, dp, stage = int(self.num_params.value), self.dp.value, self.stage.value
        device_bytes: Optional[float] = DEVICES[self.device.value]
        mem = self.bytes_per_rank()
        fits = ""
        if device_bytes:
            verdict = "fits" if mem.model_states <= device_bytes else "does not fit"
            fits = f"; {verdict} in one {fmt_bytes(device_bytes)} device"
        self.summary.value = (f"<b>{STAGE_NAMES[stage]}</b>, Ψ = {psi:,} parameters, dp = {dp}: "
                              f"params {fmt_bytes(mem.params)} + grads {fmt_bytes(mem.grads)} + "
                              f"optimizer state {fmt_bytes(mem.optimizer_state)} = "
                              f"<b>{fmt_bytes(mem.model_states)}</b> per rank{fits}")
        self.figure = plot_memory_calculator(psi, dp, stage, precision, device_bytes, label)
        self.image.value = _png(self.figure)
        return self.figure

    def __repr__(self) -> str:
        # The default repr lists every child, image bytes included.
        return (f"MemoryCalculator(num_params={self.num_params.value:.3g}, dp={self.dp.value}, "
                f"stage={self.stage.value}, precision={self.precision.value!r}, "
                f"device={self.device.value!r})")


def memory_calculator(num_params: float = 7.5e9, dp: int = 64, stage: int = 3,
                      precision: str = "mixed", device: str = "80 GB") -> MemoryCalculator:
    """The memory calculator widget (defaults: the ZeRO paper's 7.5B model on 64 ranks)."""
    return MemoryCalculator(num_params, dp, stage, precision, device)
