"""``python -m dcp_datastates``: the ``dcp-datastates`` command-line tool."""

import sys

from dcp_datastates.tools.cli import main

sys.exit(main())
