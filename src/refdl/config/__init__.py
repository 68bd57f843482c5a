"""Configuration: what a run is (``spec.RunSpec``), its mesh (``mesh.MeshSpec``), the
logical-axis rules (``rules``), the vocabulary (``choices``), declared value types
(``values``) and every check of them (``plan``), all without data or devices.

Importing the package itself imports nothing, so a CLI can read ``choices`` before
JAX is loaded; import the modules (or the names ``refdl`` exports).
"""
