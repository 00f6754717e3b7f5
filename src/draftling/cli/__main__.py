"""`python -m draftling.cli`, as before the CLI was a package."""

import sys

from draftling.cli import main

if __name__ == "__main__":
    sys.exit(main())
