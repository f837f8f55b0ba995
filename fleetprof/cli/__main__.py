"""`python -m fleetprof.cli`: how the demo and the tests start the command."""

import sys

from fleetprof.cli import main

if __name__ == "__main__":
    sys.exit(main())
