"""matplotlib backend of the kernels (``MPLBACKEND=module://aenv_interpreter.mpl_backend``).

Figures draw with Agg; ``plt.show()`` sends them as PNG results instead of opening a window.
"""

from __future__ import annotations

from typing import Any

from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

from aenv_interpreter.display import flush_figures

FigureCanvas = FigureCanvasAgg
FigureManager = FigureManagerBase


def show(*args: Any, **kwargs: Any) -> None:
    flush_figures()
