"""JSON numbers as every request schema reads them (the node's API and the template builder's).

JSON has one number type: `30.0` is the integer 30, as JSON Schema's `integer` says too, while a
string or a fraction is not an integer. Request models are strict (no `"6"` → 6 coercion), so an
integer field takes `INTEGRAL` before its strict check.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, StrictInt


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Bounds go before it in an Annotated type, so that they are declared in the JSON schema as
# minimum and maximum.
INTEGRAL = BeforeValidator(_integral)
Int = Annotated[StrictInt, INTEGRAL]
