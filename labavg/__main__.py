"""`python -m labavg` runs the command line (mpiexec starts ranks this way)."""

import sys

from labavg.cli.main import main

sys.exit(main())
