"""``python -m kvtier_tools.gateway``: the same as ``kvtier gateway``."""

import sys

from kvtier_tools.gateway.cli import main

sys.exit(main())
