"""The packed text dataset kind: documents -> tokens -> padding-free micro-batches."""
