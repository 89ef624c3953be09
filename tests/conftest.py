"""Every test sees the zoo registered, as a recipe with the default ``model.plugins`` does."""

from veomni.spec import load_plugins

load_plugins()
