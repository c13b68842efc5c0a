"""Pass pipelines (kerncc.pipeline): the `-p` spec, resolution, the runner, instruments.

`base` (scheduling; the Pass base itself is kerncc.passes.base), `spec` (the `-p` syntax), `instruments` (print-ir, time-passes,
dump-dir), `runner` (resolve and run) and `docgen` (the pass reference); this package
re-exports the runner's public names.
"""

from kerncc.pipeline.runner import *  # noqa: F403
from kerncc.pipeline.runner import __all__  # noqa: F401
