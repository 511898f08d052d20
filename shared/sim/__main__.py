import sys

from pdserve.sim.cli import main

sys.exit(main())
