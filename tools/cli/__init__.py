"""The ``metalog`` command line: ``main`` (entry point and parser) and one module per subcommand group."""
