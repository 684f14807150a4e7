"""The config, the ``tandem`` command line, and the program that wires the pieces."""
