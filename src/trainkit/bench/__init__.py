"""The strategy benchmark (``python -m trainkit.bench``): see ``__main__.py``."""
