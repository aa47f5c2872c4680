"""The demo: a training script that checkpoints through ``CheckpointManager``, crashes and resumes.

``python -m dcp_datastates.demo`` (``--help`` lists the options). Read in this order:

- ``__main__.py``: the options, the three runs (reference, failing, resumed) and their launch;
- ``train.py``: one rank's FSDP2 training loop with its checkpoints (``CheckpointManager``, or
  DCP's ``FileSystemWriter`` for the reference), the resume and the simulated crash;
- ``model.py``: the model, its synthetic data and its learning rate;
- ``report.py``: the checks after the runs and what is printed.
"""
