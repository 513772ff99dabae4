"""`python -m pz_sparsecore`: see `pz_sparsecore.cli`."""

import sys

from pz_sparsecore.cli import main

sys.exit(main())
