"""`python -m rollstore.cli ...` (what torchrun runs, docs/distributed.md): the `rollstore` command line."""

import sys

from rollstore.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
