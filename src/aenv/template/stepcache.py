"""The build cache: each step's disk layer, found again by (layer below, step, files hash).

An entry records the whole layer chain up to the step and the ENV/USER/WORKDIR state after it,
so a rebuild whose first steps are unchanged boots straight on the last cached layer. Layers
nothing else uses may be collected by the node's garbage collection; an entry whose chain is
no longer complete is a miss.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aenv.template.steps import BuildState


@dataclass(frozen=True)
class CachedStep:
    chain: tuple[str, ...]  # disk layers, bottom to top; the top one is the step's
    state: BuildState


class StepCache:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def get(self, key: str, exists: Callable[[str], bool]) -> CachedStep | None:
        try:
            data = json.loads((self.root / f"{key}.json").read_text())
            hit = CachedStep(tuple(data["chain"]), BuildState.from_json(data["state"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return hit if all(exists(layer) for layer in hit.chain) else None

    def put(self, key: str, step: CachedStep) -> None:
        path = self.root / f"{key}.json"
        temp = path.with_suffix(".tmp")
        temp.write_text(json.dumps({"chain": list(step.chain), "state": step.state.to_json()}))
        os.replace(temp, path)
