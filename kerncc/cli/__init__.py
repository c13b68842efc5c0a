"""The command line (`kerncc ...`): one module per command group; nothing imports this package.

`main` builds the parser and dispatches; `run` holds `kerncc run` and `kerncc example`.
Every command imports what it needs inside its function, so `kerncc --help` and `verify` stay
fast.
"""
