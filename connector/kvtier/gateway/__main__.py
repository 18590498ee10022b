"""``python -m kvtier.gateway``: the same as ``kvtier gateway``."""

import sys

from kvtier.gateway.cli import main

sys.exit(main())
