"""Command-line entry points: one thin ``main`` per command."""
