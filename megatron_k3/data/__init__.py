"""Data: tokenizers, the zarr token store and the epoch-exact TokenLoader."""
