"""Stage 4, rewrite: a plan emitted into a forward graph and a recomputing (and offloading) backward graph."""
