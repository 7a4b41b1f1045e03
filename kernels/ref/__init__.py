"""The reference backend: a plain NumPy definition of every IR op (reference.py), bound
as the ``ref`` backend (backend.py). Every other backend is validated against it."""
