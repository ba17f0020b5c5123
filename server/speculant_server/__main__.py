import sys

from speculant_server.cli import main

sys.exit(main())
