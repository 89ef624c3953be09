"""The model zoo. Importing this package registers every model family."""

from . import (
    dit,  # noqa: F401  (registers "dit")
    gnn,  # noqa: F401  (registers "gnn")
    llm,  # noqa: F401  (registers "llm")
    omni,  # noqa: F401  (registers "omni" and the modalities)
    vae,  # noqa: F401  (registers "vae")
    vwn,  # noqa: F401  (registers "vwn")
)
