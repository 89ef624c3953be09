"""The graph dataset kind: the on-disk format, partitions, views and the folder writer."""
