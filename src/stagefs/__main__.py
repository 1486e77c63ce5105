"""``python -m stagefs``: the ``stagefs`` command."""

import sys

from stagefs.cli import main

sys.exit(main())
