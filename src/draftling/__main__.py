import sys

from draftling.cli import main

sys.exit(main())
