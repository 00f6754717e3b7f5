import sys

from draftling.cli import main

# vLLM (serve-check) starts worker processes that import this module again: run only as the program.
if __name__ == "__main__":
    sys.exit(main())
