"""Rich display: an object's representations as the SDK's ``Result`` fields, and figures.

An object shows itself the way IPython lets it: ``_repr_mimebundle_`` or the ``_repr_*_``
methods (``_repr_png_`` and the like), binary data base64-encoded as Jupyter sends it; the plain
``repr`` is always the ``text``. matplotlib figures become PNG results when a cell ends or calls
``plt.show()`` (``aenv_interpreter.mpl_backend``), as Jupyter's inline backend shows them.
"""

from __future__ import annotations

import base64
import io
import sys
from collections.abc import Callable
from typing import Any

# Set by the kernel: sends one message (a dict) to the service.
emit: Callable[[dict[str, Any]], None] | None = None

FORMATS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}
METHODS = {f"_repr_{name}_": name for name in FORMATS.values() if name != "text"}
BINARY = {"png", "jpeg", "pdf"}


def _encoded(name: str, value: Any) -> Any:
    if name in BINARY and isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, tuple):  # (data, metadata) as IPython allows
        return _encoded(name, value[0])
    return value


def formats(obj: Any) -> dict[str, Any]:
    """The result fields of ``obj``: its ``text`` and every rich representation it has."""
    fields: dict[str, Any] = {}
    bundle = _call(obj, "_repr_mimebundle_")
    if isinstance(bundle, tuple):
        bundle = bundle[0]
    if isinstance(bundle, dict):
        for mime, value in bundle.items():
            if mime in FORMATS and value is not None:
                fields[FORMATS[mime]] = _encoded(FORMATS[mime], value)
    for method, name in METHODS.items():
        if name not in fields:
            value = _call(obj, method)
            if value is not None:
                fields[name] = _encoded(name, value)
    figure = _figure_png(obj)
    if figure is not None:
        fields.setdefault("png", figure)
    fields.setdefault("text", repr(obj))
    return fields


def _call(obj: Any, method: str) -> Any:
    """``obj.method()`` if the object's type defines it (never what ``__getattr__`` invents)."""
    if isinstance(obj, type) or not callable(getattr(type(obj), method, None)):
        return None
    try:
        return getattr(obj, method)()
    except Exception:  # a broken representation is skipped, as IPython's formatters do
        return None


def display(*objects: Any) -> None:
    """Show objects now, as IPython's ``display()``: a result each that is not the cell's value."""
    for obj in objects:
        send({"type": "result", **formats(obj), "is_main_result": False})


def send(message: dict[str, Any]) -> None:
    if emit is not None:
        emit(message)


def _figure_png(obj: Any) -> str | None:
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None or not isinstance(obj, pyplot.Figure):
        return None
    buffer = io.BytesIO()
    obj.savefig(buffer, format="png", bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def flush_figures() -> None:
    """Send every open matplotlib figure as a PNG result and close it."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    for number in pyplot.get_fignums():
        figure = pyplot.figure(number)
        send({"type": "result", **formats(figure), "is_main_result": False})
    pyplot.close("all")
