"""``python -m tests.torch_suites``: run torch's own RPC suites against mpidag."""

import sys

from tests.torch_suites.runner import main

sys.exit(main())
