"""The demo: FSDP2 training of a small GPT-like model with asynchronous checkpoints, a failure and a resume.

``python -m dcp_datastates.demo`` (``--help`` lists the options). One module per job:

- ``cli``: the options and ``main()``; ``workdir``: the working directory;
- ``scenario``: the reference, failing and resumed runs, in order;
  ``checks``: what must hold afterwards; ``results`` and ``report``: what is printed;
- ``launcher``: spawning a run's ranks; ``run_spec``: what each rank is told;
- ``training``: one rank's FSDP2 training loop and the simulated crash;
  ``model``: the model, its data and learning rate;
- ``checkpointer``: the checkpoints (ours through ``CheckpointManager``, or
  DCP's ``FileSystemWriter``) and their cost; ``train_state``: what a
  checkpoint holds and how a resume restores it;
- ``run_log``: the JSON-lines log ranks write and the parent reads;
  ``host_memory``: RSS probes; ``checkpoint_dirs``: step directories on disk;
  ``checkpoint_compare``: ours vs DCP's checkpoint of one step, bit for bit.
"""
