"""Outside attention implementations behind ringlab's protocol and correctness gate.

Each adapter is a module whose `kernel_specs()` an entry point of ringlab's own package names
(pyproject.toml, group `ringlab.kernels`), so it loads like any plugin: one whose package is
missing is listed as unavailable with the ImportError, never skipped. See docs/plugins.md.
"""
