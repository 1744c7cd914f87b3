"""``python -m mpidag`` is the launcher: see :mod:`mpidag.run`."""

import sys

from mpidag.run import main

sys.exit(main())
