"""The passes (`kerncc.passes`): one module per pass, collected here in pipeline order.

Importing this package imports every module of `PASS_MODULES`, whose `@register` fills the
registry; `registry()` hands it on. The framework the passes derive from (the Pass base,
`register`, options, named pipelines) is `kerncc.passes.base`, which imports none of them: a
pass module imports `base` (and sibling passes), never this package, and the pipeline
(kerncc.pipeline) imports this package, never a pass imports the pipeline. So the imports run
one way: pipeline -> this package -> pass modules -> base.
"""

from __future__ import annotations

# In PASS_MODULES order: a module registers its passes when imported.
from kerncc.passes import liveness, cut, share_states, slicing, plan_memory, emit  # noqa: F401
from kerncc.passes.base import (
    NAMED_PIPELINES,
    PASS_MODULES,
    REGISTRY,
    OptionInfo,
    Pass,
    PassRegistry,
    pass_options,
    pass_summary,
    register,
)

__all__ = [
    "NAMED_PIPELINES", "PASS_MODULES", "REGISTRY", "OptionInfo", "Pass", "PassRegistry",
    "pass_options", "pass_summary", "register", "registry",
]


def registry() -> PassRegistry:
    """The global registry, every module of `PASS_MODULES` imported (by this package)."""
    return REGISTRY
