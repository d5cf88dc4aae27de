"""The Hugging Face layer the actor, the weight sync and the offline converter stand on.

- ``mapping``: the model family's weight table bound to one model config (names, shapes, TP splits);
- ``checkpoint_io``: safetensors reading (lazy slices) and sharded writing, dtypes, tokenizer files;
- ``outdir``: output directories written atomically, with the ownership marker;
- ``config_json``: the source checkpoint's ``config.json`` carried over unchanged.

Importing this package imports nothing.
"""
