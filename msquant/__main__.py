"""``python -m msquant`` runs the command line."""

import sys

from msquant.cli import main

sys.exit(main())
