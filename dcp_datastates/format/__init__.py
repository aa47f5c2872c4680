"""The on-disk format: file names, the per-rank index, ``.metadata`` and the
stored Python objects. Nothing here imports the save or load paths.

No ``.metadata`` pins a module of ours to a path: format 5 stores the layout
as plain data, and the class paths formats 1-4 pickled (``dcp_datastates.format.CheckpointLayout``
and others) are resolved by the unpicklers to stand-ins (``storage_data.py``),
so nothing needs to be importable under those names.
"""
