"""The ``dcp-datastates`` commands: one module each, named after it, with ``run(args) -> exit status``."""
