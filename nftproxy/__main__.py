"""`python -m nftproxy` runs the CLI."""

import sys

from nftproxy.cli import main

sys.exit(main())
