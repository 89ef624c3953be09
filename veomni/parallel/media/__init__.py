"""Media encoders beside an LLM: routing items to the ranks that encode them, colocation, encoder
sequence parallelism and encoders under pipeline parallelism. Used by ``parallel/apply.py`` and the
pipeline's stage hooks; the generic parallel code never imports it."""
