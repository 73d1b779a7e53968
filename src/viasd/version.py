"""The package version (here, so that any layer can read it without importing the package's API)."""

__version__ = "0.1.0"
