"""The on-disk format: file names, the per-rank index, ``.metadata`` and the
stored Python objects. Nothing here imports the save or load paths.

``.metadata`` files written before format 5 pickled ``CheckpointLayout``,
``RankFiles`` and ``ItemLocation`` under the module path
``dcp_datastates.format``; these names stay importable from here so that
those checkpoints keep loading (see ``rank_index.py``).
"""

from dcp_datastates.format.rank_index import CheckpointLayout, ItemLocation, RankFiles

__all__ = ["CheckpointLayout", "ItemLocation", "RankFiles"]
