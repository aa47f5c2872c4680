"""``python -m dcp_datastates.demo``: FSDP2 training with asynchronous checkpoints (see main.py)."""

import sys

from dcp_datastates.demo.main import main

sys.exit(main())
