"""The one place segserve's version is written.

`pyproject.toml` reads it (setuptools' dynamic `attr`), so the wheel's metadata,
`segserve --version`, `/health` and `/openapi.json` all report the same string. This module
imports nothing, so reading it never loads MLX.
"""

__version__ = "0.3.0"
