"""Command line and process glue shared by the edge and the node."""

__version__ = "0.1.0"
