"""Model families, one module each (``qwen3``, ``qwen2``, ...), and their registry (:mod:`.registry`)."""
