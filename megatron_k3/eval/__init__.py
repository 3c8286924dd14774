"""Evaluation: HellaSwag with lm-eval's exact task definition (``hellaswag.py``)."""
