"""``python -m kern.engine.ranks``: one rank of a target with ranks > 1 (see ``worker``)."""

import sys

from kern.engine.ranks.worker import main

sys.exit(main())
