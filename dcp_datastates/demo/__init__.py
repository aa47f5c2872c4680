"""The demo: FSDP2 training of a small GPT-like model with asynchronous checkpoints, a failure and a resume."""
