"""``python -m dcp_datastates``: the ``dcp-datastates`` command-line tool."""

import sys

from .cli import main

sys.exit(main())
