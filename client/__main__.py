"""``python -m client ...``: the radixkv command line (see ``client/cli.py``)."""

import sys

from .cli import main

sys.exit(main())
