"""Model classes (one file per architecture, registered in registry.py), their shared layers
(layers/) and the loaders that fill their weights (loader/)."""
