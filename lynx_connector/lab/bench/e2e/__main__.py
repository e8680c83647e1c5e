"""``python -m lynx_connector.lab.bench.e2e [args]``: the same as ``lynx bench e2e [args]``."""

import sys

from lynx_connector.lab.bench.e2e.cli import main

sys.exit(main())
