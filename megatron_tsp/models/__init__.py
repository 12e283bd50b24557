"""Model descriptions (``*.json``, read by ``core/model_shape.py``) and ``hf_import`` (Hugging
Face checkpoint directories into TSP models)."""
