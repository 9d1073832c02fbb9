"""segserve: an OpenAI-compatible chat server on MLX with segmented KV memory.

Installed, every part lives under this one name: `segserve.server` (HTTP, engine, runner,
CLI), `segserve.kv` (segmented KV cache), `segserve.kernels` (attention and layer ops),
`segserve.bank` (session bank and SSD tier), `segserve.config` (settings). In a checkout the
five folders sit at the repository's top level and this folder links to them, so imports
read the same in both layouts.
"""

from segserve.server.version import __version__

__all__ = ["__version__"]
