"""The chat-with-media dataset kind: chat templates and media items -> packed rows for omni models."""
