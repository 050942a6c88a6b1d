"""splitedge: the application layer (CLI and simulation) composing the role runtimes."""

__version__ = "0.1.0"
