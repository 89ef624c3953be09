"""Building blocks shared by several model families (encoder transformer blocks)."""
