"""`python -m nftproxy` runs the CLI."""

import sys

from nftproxy.tools.cli import main

sys.exit(main())
