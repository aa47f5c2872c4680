"""Bridges to the stacks users train and publish with (torchtitan, Hugging Face).

Each module imports its stack lazily, so the package imports without them.
"""
