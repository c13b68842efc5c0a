"""`python -m kerncc ...` is the `kerncc` command."""

import sys

from kerncc.cli.main import main

sys.exit(main())
