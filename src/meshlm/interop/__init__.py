"""Hugging Face in and out: the safetensors format, the weight tables and `meshlm convert`."""
