"""``python -m pipeline`` = the ``foveate`` command (works with ``ray job submit --working-dir .``)."""

import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main())
