"""Stage 1, capture: the joint forward+backward graph through TorchDynamo and AOTAutograd, and why it failed."""
