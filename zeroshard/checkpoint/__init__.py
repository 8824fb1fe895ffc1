"""Universal checkpoints: saved at any world size and stage, loaded at any other, as
safetensors pieces plus a JSON manifest (no pickle). See ``save.py`` and ``load.py``."""
