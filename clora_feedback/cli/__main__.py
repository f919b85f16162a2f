"""`python -m clora_feedback.cli`: the same as the `clora` command.

Not here: argument parsing (see `main`).
"""

import sys

from clora_feedback.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
