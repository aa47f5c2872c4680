"""``python -m dcp_datastates.demo``: FSDP2 training with asynchronous checkpoints (see cli.py)."""

import sys

from dcp_datastates.demo.cli import main

sys.exit(main())
