"""Universal checkpoints: saved at any world size and stage, loaded at any other, as
safetensors pieces plus a JSON manifest (no pickle). See ``save.py`` and ``load.py``;
the manifest format (``format.py``), checksums (``integrity.py``), checks before loading
(``validate.py``, ``coverage.py``), streamed safetensors files (``safetensors_io.py``),
16-bit exports (``export.py``), resuming a restarted job (``resume.py``) and saving on
preemption (``preemption.py``)."""
