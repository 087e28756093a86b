import sys

from loraplex_operator.gateway.cli import main

sys.exit(main())
