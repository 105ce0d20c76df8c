"""The fxamp version, in its own module so that any layer can read it without importing
the package ``__init__`` (which imports every layer)."""
__version__ = "0.1.0"
