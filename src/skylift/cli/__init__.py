"""The ``skylift`` command line: one module per command, heavy imports deferred."""
