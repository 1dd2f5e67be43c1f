"""`python -m aenv.cli`: the same as the `aenv` console script."""

import sys

from . import main

sys.exit(main())
