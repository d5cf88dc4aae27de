"""The ``torch_dist`` checkpoint format below the actor: metadata, allow-listed unpicklers, record checks.

``torch_dist`` reads what both the actor's resume and the offline converter (top-level ``conversion``)
need; ``dcp_pickles`` reads DCP's two pickles without torch. Importing this package imports nothing.
"""
