"""Stage 2, annotate: per-node sizes, costs and tags on the joint graph, distilled into the torch-free ``Problem``."""
