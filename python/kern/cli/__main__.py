"""``python -m kern.cli``: the same program as the ``kern`` command."""

import sys

from kern.cli import main

sys.exit(main())
