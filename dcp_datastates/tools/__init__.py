"""The ``dcp-datastates`` command-line tool and its commands (list, verify, diff, convert, export)."""
