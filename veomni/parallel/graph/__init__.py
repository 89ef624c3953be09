"""Graph parallelism: halo exchange and historical embeddings at the models' aggregation point, and
the layer pipeline of graph models."""
