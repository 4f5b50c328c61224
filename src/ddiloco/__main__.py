"""`python -m ddiloco ...`: the `ddiloco` command (`ddiloco.cli`), for an environment whose scripts are not on PATH."""

import sys

from ddiloco.cli import main

if __name__ == "__main__":
    sys.exit(main())
