"""The drafter registry: each drafter kind a deployment may name, and its class.

A new drafter is one class implementing `models.speculative.drafters.Drafter` plus one line in
`DRAFTERS`; the deployment args accept its kind (`serve_app.configuration.args.DrafterArgs`), the
docs list it, and `MlxRunner.from_paths` builds it (`Drafter.load`). Classes are named
by import path and imported only when a runner builds one, so the deployment config
(validated where no model is loaded) does not import mlx.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

NO_DRAFTER = "none"  # the deployment's kind for "classic decode only"


@dataclass(frozen=True)
class DrafterKind:
    class_path: str  # "module:Class", a `models.speculative.drafters.Drafter`
    description: str  # one line, for the deployment args' docs
    needs_weights: bool = False  # the deployment's `drafter.path` names a draft model to load

    def load_class(self) -> type:
        module, _, name = self.class_path.partition(":")
        return getattr(importlib.import_module(module), name)


DRAFTERS: dict[str, DrafterKind] = {
    "draft_model": DrafterKind(
        "models.speculative.drafters:DraftModelDrafter",
        "a small model sharing the target's vocabulary",
        needs_weights=True,
    ),
    "ngram": DrafterKind("models.speculative.drafters:NgramDrafter", "prompt lookup (no weights)"),
}
